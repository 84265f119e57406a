"""client/build.py: build_static_from_tokens returns what it wrote and says, with a result and a warning, what did not fit in the corpus index."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ngramcache import UNTAGGED, BuildResult, IndexBudgetWarning, StaticCache, build_static_from_tokens
from ngramcache.client.errors import InvalidArgumentError


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
