"""client/kernel/build.py: build_static_from_tokens returns what it wrote and says, with a result and a warning, what did not fit in the corpus index."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ngramcache import UNTAGGED, BuildResult, IndexBudgetWarning, StaticCache, build_static_from_tokens
from ngramcache.client.kernel.errors import InvalidArgumentError


def test_result_counts_what_was_written(tmp_path):
    rng = np.random.default_rng(1)
    streams = [rng.integers(0, 50, 1000).astype(np.int32), rng.integers(0, 50, 500).astype(np.int32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything fits: no warning
        r = build_static_from_tokens(streams, tmp_path / "a.ngc", 50, fingerprint=UNTAGGED, corpus_index=True)
    assert isinstance(r, BuildResult)
    cache = StaticCache.open(tmp_path / "a.ngc")
    assert (r.n_tokens, r.n_streams, r.n_keys, r.n_not_indexed) == (1500, 2, cache.n_keys, 0)
    assert r.n_indexed == cache.n_indexed == 1500


def test_tokens_past_the_index_budget_are_reported_and_warned(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 1000, 600_000).astype(np.int32)
    with pytest.warns(IndexBudgetWarning, match="did not fit"):
        r = build_static_from_tokens([tokens], tmp_path / "b.ngc", 1000, fingerprint=UNTAGGED, corpus_index=True,
                                     memory_budget=16 << 20)
    assert r.n_not_indexed > 0 and r.n_indexed + r.n_not_indexed == 600_000
    assert StaticCache.open(tmp_path / "b.ngc").n_indexed == r.n_indexed
    big = build_static_from_tokens([tokens], tmp_path / "c.ngc", 1000, fingerprint=UNTAGGED, corpus_index=True,
                                   memory_budget=256 << 20)
    assert big.n_not_indexed == 0 and big.n_indexed == 600_000


def test_budget_below_the_minimum_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="16 MiB"):
        build_static_from_tokens([np.arange(10, dtype=np.int32)], tmp_path / "d.ngc", 10, fingerprint=UNTAGGED,
                                 memory_budget=1 << 20)


def test_text_is_tokenized_in_batches_that_scale_with_the_budget(tmp_path):
    from pathlib import Path

    from ngramcache.client.kernel import corpus
    from ngramcache.client.kernel.build import build_static
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    assert corpus.text_batch_bytes(16 << 20) == 1 << 20
    assert corpus.text_batch_bytes(64 << 20) == 2 << 20
    assert corpus.text_batch_bytes(1 << 30) == corpus.TEXT_BATCH_BYTES == 8 << 20
    tok = load_tokenizer("tiktoken:qwen")
    batches: list[int] = []

    class Recording:  # the real tokenizer, recording how much text each batch holds
        vocab_size, fingerprint = tok.vocab_size, tok.fingerprint

        def encode_batch(self, texts):
            batches.append(sum(len(t.encode()) for t in texts))
            return tok.encode_batch(texts)

    lib = Path(__file__).resolve().parents[2] / "client" / "kernel"
    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(40):  # 40 files of 100 KB: 4 batches of 1 MiB under a 16 MiB budget
        (folder / f"{i:02}.py").write_text(((lib / "build.py").read_text() * 20)[:100_000])
    build_static([folder], tmp_path / "a.ngc", vocab_size=tok.vocab_size, fingerprint=tok.fingerprint,
                 tokenizer=Recording(), memory_budget=16 << 20)  # type: ignore[arg-type]
    assert len(batches) == 4 and max(batches) < (1 << 20) + 100_000
    batches.clear()
    build_static([folder], tmp_path / "b.ngc", vocab_size=tok.vocab_size, fingerprint=tok.fingerprint,
                 tokenizer=Recording(), memory_budget=1 << 30)  # type: ignore[arg-type]
    assert batches == [4_000_000]
    assert (tmp_path / "a.ngc").read_bytes() == (tmp_path / "b.ngc").read_bytes()
