"""`ngramcache export-sglang`: a generation's corpus index as SGLang's external n-gram corpus (JSONL of strings), and its careless inputs."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import main, one_line_error, run

from ngramcache import UNTAGGED, StaticCache, build_static_from_tokens
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.sglang_corpus import corpus_documents, export_sglang
from ngramcache.client.kernel.tokenizer import load_tokenizer

TOKENIZER = "tiktoken:qwen"
MODULES = ["bisect.py", "heapq.py", "textwrap.py"]




@pytest.fixture(scope="module")
def generation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A generation with a corpus index built from real text (CPython modules), and those texts."""
    d = tmp_path_factory.mktemp("sglang")
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in MODULES:
        (d / name).write_bytes((lib / name).read_bytes())
        texts.append((lib / name).read_text(encoding="utf-8"))
    run("build", *(d / name for name in MODULES), "-o", d / "gen.ngc", "--tokenizer", TOKENIZER, "--corpus-index",
        "--quiet")
    return d / "gen.ngc", texts


def test_each_document_is_one_json_string_that_encodes_back_to_the_corpus(generation, tmp_path):
    gen, texts = generation
    out = tmp_path / "corpus.jsonl"
    r = run("export-sglang", gen, "-o", out, "--tokenizer", TOKENIZER)
    assert f"{len(texts)} documents" in r.stdout
    lines = out.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    # What SGLang's loader accepts: every non-blank line a JSON string.
    assert all(isinstance(rec, str) and rec.strip() for rec in records)
    assert sorted(records) == sorted(texts)
    tok = load_tokenizer(TOKENIZER)
    streams = list(corpus_documents(StaticCache.open(str(gen))))
    assert [tok.encode(rec).tolist() for rec in records] == [s.tolist() for s in streams]
    assert sum(len(s) for s in streams) == StaticCache.open(str(gen)).n_indexed


def test_a_file_without_a_corpus_index_is_refused(generation, tmp_path, capsys):
    gen, _ = generation
    plain = tmp_path / "plain.ngc"
    run("build", gen.parent / MODULES[0], "-o", plain, "--tokenizer", TOKENIZER, "--quiet")
    out = tmp_path / "corpus.jsonl"
    rc, _, err = main(capsys, "export-sglang", plain, "-o", out, "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "has no corpus index", "--corpus-index")
    assert not out.exists()


def test_another_tokenizer_is_refused(generation, tmp_path, capsys):
    gen, _ = generation
    out = tmp_path / "corpus.jsonl"
    rc, _, err = main(capsys, "export-sglang", gen, "-o", out, "--tokenizer", "tiktoken:cl100k_base")
    assert rc == 2
    one_line_error(err, "built with another tokenizer")
    assert not out.exists()


def test_careless_outputs_are_refused_before_any_work(generation, tmp_path, capsys):
    gen, _ = generation
    before = gen.read_bytes()
    rc, _, err = main(capsys, "export-sglang", gen, "-o", gen, "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, f"-o {gen} is the input", "would destroy the input")
    rc, _, err = main(capsys, "export-sglang", gen, "-o", tmp_path / "nowhere" / "c.jsonl", "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, f"the folder {tmp_path / 'nowhere'} does not exist")
    rc, _, err = main(capsys, "export-sglang", tmp_path / "missing.ngc", "-o", tmp_path / "c.jsonl", "--tokenizer",
                      TOKENIZER)
    assert rc == 2
    one_line_error(err, "does not exist")
    assert gen.read_bytes() == before


def test_an_existing_output_is_replaced_whole(generation, tmp_path):
    gen, texts = generation
    out = tmp_path / "corpus.jsonl"
    out.write_text("an older corpus\n")
    run("export-sglang", gen, "-o", out, "--tokenizer", TOKENIZER, "--quiet")
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(texts)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_ctrl_c_leaves_no_partial_file(generation, tmp_path, capsys, monkeypatch):
    gen, _ = generation
    out = tmp_path / "corpus.jsonl"
    out.write_text("the previous export\n")
    calls = []

    class Interrupting:
        def __init__(self, inner):
            self.inner = inner
            self.fingerprint = inner.fingerprint

        def decode(self, ids):
            calls.append(len(ids))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return self.inner.decode(ids)

    from ngramcache.client.tools.cli import commands

    real = commands.load_tokenizer_spec
    monkeypatch.setattr(commands, "load_tokenizer_spec", lambda spec: Interrupting(real(spec)))
    rc, _, err = main(capsys, "export-sglang", gen, "-o", out, "--tokenizer", TOKENIZER)
    assert rc == 130 and "Traceback" not in err
    assert out.read_text() == "the previous export\n"  # untouched: the new file was never renamed over it
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]  # no temporary file left


def test_a_corrupt_corpus_is_refused(generation, tmp_path, capsys):
    gen, _ = generation
    bad = tmp_path / "bad.ngc"
    data = bytearray(gen.read_bytes())
    text = next(s for s in StaticCache.open(str(gen)).sections if s["name"] == "TEXT")
    data[int(text["offset"]) + 8] ^= 0x01
    bad.write_bytes(bytes(data))
    out = tmp_path / "corpus.jsonl"
    rc, _, err = main(capsys, "export-sglang", bad, "-o", out, "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "bad.ngc")
    assert not out.exists()


def test_streams_split_on_separators_across_reads(tmp_path, monkeypatch):
    """Documents longer than one read of the mapped section, and empty ones, come out whole and in order."""
    from ngramcache.client.kernel import sglang_corpus

    monkeypatch.setattr(sglang_corpus, "_CHUNK", 7)
    rng = np.random.default_rng(3)
    streams = [rng.integers(0, 90, n).astype(np.int32) for n in (1, 20, 7, 3)]
    path = tmp_path / "raw.ngc"
    build_static_from_tokens(streams, path, 100, fingerprint=UNTAGGED, corpus_index=True)
    got = list(corpus_documents(StaticCache.open(str(path))))
    assert [g.tolist() for g in got] == [s.tolist() for s in streams]


def test_the_library_call_refuses_a_plain_file(tmp_path):
    path = tmp_path / "raw.ngc"
    build_static_from_tokens([np.arange(50, dtype=np.int32)], path, 100, fingerprint=UNTAGGED)
    with pytest.raises(InvalidArgumentError, match="no corpus index"):
        export_sglang(StaticCache.open(str(path)), load_tokenizer(TOKENIZER), tmp_path / "c.jsonl")
    assert not (tmp_path / "c.jsonl").exists()


def test_json_prints_the_figures_as_one_object(generation, tmp_path, capsys):
    gen, texts = generation
    out = tmp_path / "corpus.jsonl"
    rc, stdout, err = main(capsys, "export-sglang", gen, "-o", out, "--tokenizer", TOKENIZER, "--json")
    assert rc == 0, err
    assert json.loads(stdout) == {"input": str(gen), "output": str(out), "format": "sglang", "documents": len(texts),
                                  "tokens": StaticCache.open(str(gen)).n_indexed, "file_bytes": out.stat().st_size}
