"""SglangSync's pieces without a network (tests/unit; the live ones: tests/integration/test_sglang_sync.py): the corpus cut to the budget, whose corpora it removes, the targets it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ngramcache import StaticCache, build_static_from_tokens
from ngramcache.client.errors import InvalidArgumentError
from ngramcache.client.sglang_http import SglangTarget
from ngramcache.client.sglang_sync import SglangSync, prepare_corpus
from ngramcache.client.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("tiktoken:qwen")


def generation(tmp_path: Path, docs: list[str], **options: object) -> StaticCache:
    path = tmp_path / "g.ngc"
    build_static_from_tokens([TOKENIZER.encode(d) for d in docs], str(path), vocab_size=TOKENIZER.vocab_size,
                             fingerprint=TOKENIZER.fingerprint, generation=7, **options)  # type: ignore[arg-type]
    return StaticCache.open(str(path))


def test_corpus_cut_to_the_budget_keeps_a_prefix_of_the_first_document_past_it(tmp_path: Path) -> None:
    docs = ["alpha beta gamma " * 20, "delta epsilon " * 30, "zeta eta theta " * 10]
    sizes = [len(TOKENIZER.encode(d)) for d in docs]
    cache = generation(tmp_path, docs, corpus_index=True)
    whole = prepare_corpus(cache, TOKENIZER, "ns", 10_000)
    assert (whole.documents, whole.tokens, whole.cut_documents, whole.cut_tokens) == (3, sum(sizes) + 2, 0, 0)
    budget = sizes[0] + 1 + 5
    cut = prepare_corpus(cache, TOKENIZER, "ns", budget)
    assert (cut.documents, cut.tokens) == (2, budget)
    assert (cut.cut_documents, cut.cut_tokens) == (2, sizes[1] - 5 + sizes[2])
    assert cut.corpus_id == "ngramcache-ns-g7" and b'"corpus_id": "ngramcache-ns-g7"' in cut.body


def test_a_generation_without_a_corpus_index_is_refused(tmp_path: Path) -> None:
    cache = generation(tmp_path, ["some text here"])
    with pytest.raises(InvalidArgumentError, match="has no corpus index"):
        prepare_corpus(cache, TOKENIZER, "ns", 100)


def test_only_this_namespaces_older_corpora_are_removed(tmp_path: Path) -> None:
    sync = SglangSync("127.0.0.1:1", "a", TOKENIZER, [SglangTarget("http://127.0.0.1:2")], cache_dir=tmp_path)
    listed = {"ngramcache-a-g1": 1, "ngramcache-a-g2": 1, "ngramcache-a-g1-g3": 1, "ngramcache-ab-g1": 1,
              "ngramcache-a-gx": 1, "mine": 1}
    assert sync._older(listed, "ngramcache-a-g2") == ["ngramcache-a-g1"]


@pytest.mark.parametrize(("url", "message"), [
    ("127.0.0.1:30000", "--sglang 127.0.0.1:30000: not an http:// or https:// URL with a host"),
    ("ftp://h:1", "--sglang ftp://h:1: not an http:// or https:// URL"),
    ("http://h:1/?x=1", "give the server's base URL, without ?query or #fragment"),
])
def test_targets_must_be_base_urls(url: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("?", r"\?")):
        SglangTarget(url)
    assert SglangTarget("http://h:1/prefix/").url == "http://h:1/prefix"


def test_arguments_are_checked(tmp_path: Path) -> None:
    target = [SglangTarget("http://127.0.0.1:2")]
    with pytest.raises(InvalidArgumentError, match="at least one SGLang server"):
        SglangSync("127.0.0.1:1", "a", TOKENIZER, [], cache_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"interval must be in 0.05..3600 seconds, got 0.01"):
        SglangSync("127.0.0.1:1", "a", TOKENIZER, target, cache_dir=tmp_path, interval=0.01)
    with pytest.raises(InvalidArgumentError, match="--server"):
        SglangSync("http://127.0.0.1:1", "a", TOKENIZER, target, cache_dir=tmp_path)
