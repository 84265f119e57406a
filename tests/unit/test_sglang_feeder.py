"""SglangSync's pieces without a network (tests/unit; the live ones: tests/integration/test_sglang_sync.py): the corpus cut to the budget, whose corpora it removes, the targets it accepts."""

from __future__ import annotations

import datetime
import json
import re
import time
from pathlib import Path

import pytest

from ngramcache import StaticCache, build_static_from_tokens
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.tools.cli.sglang import _Printer
from ngramcache.client.tools.sglang_http import SglangTarget
from ngramcache.client.tools.sglang_sync import SglangSync, prepare_corpus

TOKENIZER = load_tokenizer("tiktoken:qwen")


def generation(tmp_path: Path, docs: list[str], **options: object) -> StaticCache:
    path = tmp_path / "g.ngc"
    build_static_from_tokens([TOKENIZER.encode(d) for d in docs], str(path), vocab_size=TOKENIZER.vocab_size,
                             fingerprint=TOKENIZER.fingerprint, generation=7, **options)  # type: ignore[arg-type]
    return StaticCache.open(str(path))


def test_corpus_is_cut_at_whole_documents_and_kept_plus_cut_is_the_total(tmp_path: Path) -> None:
    docs = ["alpha beta gamma " * 20, "delta epsilon " * 30, "zeta eta theta " * 10]
    sizes = [len(TOKENIZER.encode(d)) for d in docs]
    cache = generation(tmp_path, docs, corpus_index=True)
    whole = prepare_corpus(cache, TOKENIZER, "ns", 10_000)
    assert (whole.documents, whole.tokens, whole.cut_documents, whole.cut_tokens) == (3, sum(sizes) + 2, 0, 0)
    # Room for the first document and 5 tokens of the second: the second is left out whole, and the third after it
    # (SGLang cuts its own corpora the same way), so what is sent is whole documents only.
    budget = sizes[0] + 1 + 5
    cut = prepare_corpus(cache, TOKENIZER, "ns", budget)
    assert (cut.documents, cut.tokens) == (1, sizes[0])
    assert (cut.cut_documents, cut.cut_tokens, cut.shortened_tokens) == (2, sizes[1] + sizes[2], 0)
    assert cut.documents + cut.cut_documents == cut.total_documents == 3
    assert json.loads(cut.body)["documents"] == [docs[0]]
    assert cut.corpus_id == "ngramcache-ns-g7" and b'"corpus_id": "ngramcache-ns-g7"' in cut.body


def test_a_first_document_alone_past_the_budget_keeps_its_beginning(tmp_path: Path) -> None:
    """Else a corpus of one long stream (a token file built without offsets) could never be sent."""
    docs = ["alpha beta gamma " * 20, "delta epsilon " * 30]
    sizes = [len(TOKENIZER.encode(d)) for d in docs]
    cut = prepare_corpus(generation(tmp_path, docs, corpus_index=True), TOKENIZER, "ns", 10)
    assert (cut.documents, cut.tokens, cut.first_document_tokens) == (1, 10, 10)
    assert (cut.cut_documents, cut.shortened_tokens, cut.cut_tokens) == (1, sizes[0] - 10, sizes[0] - 10 + sizes[1])
    assert cut.documents + cut.cut_documents == cut.total_documents == 2


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


def test_json_events_carry_their_time(capsys: pytest.CaptureFixture[str]) -> None:
    before = time.time()
    _Printer(as_json=True, quiet=False)("removed", {"server": "http://h:1", "corpus_id": "ngramcache-a-g1"})
    event = json.loads(capsys.readouterr().out)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", event["time"]), event  # serve's JSON log format
    stamp = datetime.datetime.strptime(event["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
    assert before - 1 <= stamp.timestamp() <= time.time() + 1
    assert event["event"] == "removed" and event["corpus_id"] == "ngramcache-a-g1"


def test_the_generation_line_says_what_was_cut_of_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    fields = {"generation": 3, "corpus_id": "ngramcache-a-g3", "documents": 2, "tokens": 2_900, "bytes": 12_000,
              "total_documents": 5, "cut_documents": 3, "cut_tokens": 4_100, "shortened_tokens": 0,
              "budget_tokens": 3_000}
    _Printer(as_json=False, quiet=False)("generation", fields)
    assert capsys.readouterr().out.strip() == ("generation 3: 2 of its 5 documents, 2,900 tokens, 0.01 MB to send to "
                                               "each server; the 3 documents after them (4,100 tokens) are cut, "
                                               "whole, past the budget of 3,000 tokens (half of --max-tokens)")
    _Printer(as_json=False, quiet=False)("generation", {**fields, "documents": 1, "tokens": 3_000, "cut_documents": 4,
                                                        "shortened_tokens": 500, "cut_tokens": 7_000})
    assert capsys.readouterr().out.strip() == ("generation 3: 1 of its 5 documents, 3,000 tokens, 0.01 MB to send to "
                                               "each server; its first document alone is past the budget of 3,000 "
                                               "tokens (half of --max-tokens): its beginning is sent, its last 500 "
                                               "tokens and the 4 documents after it (7,000 tokens in all) are cut")


def test_a_refused_add_says_when_it_is_sent_again(capsys: pytest.CaptureFixture[str]) -> None:
    _Printer(as_json=False, quiet=True)("error", {
        "server": "http://h:1", "message": "generation 2's corpus was refused: /add_external_corpus answered 400: x",
        "status": 400, "retry_seconds": 600.0, "generation": 2, "refused": True})
    assert capsys.readouterr().err.strip() == (
        "http://h:1: error: generation 2's corpus was refused: /add_external_corpus answered 400: x; not sent to this "
        "server again before a newer generation lands or 600 s pass")
