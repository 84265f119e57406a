"""Unit tests of client.rows: the delta/count row contract and its one validation path."""

from __future__ import annotations

import numpy as np
import pytest

from ngramcache.client import _core
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.rows import (
    COUNT,
    COUNTS_DTYPE,
    DELTA_DTYPE,
    FOLLOWER,
    KEY_WIDTH,
    MAX_VOCAB,
    NGRAM_MAX,
    ROW_WIDTH,
    T0,
    T3,
    TOKENS,
    N,
    empty_counts,
    validate_deltas,
)


def rows(*r: list[int]) -> np.ndarray:
    return np.array(r, dtype=np.int32).reshape(-1, ROW_WIDTH)


def test_the_row_layout_matches_the_core() -> None:
    assert (NGRAM_MAX, MAX_VOCAB) == (_core.NGRAM_MAX, _core.MAX_VOCAB) == (4, 2**24)
    assert (N, T0, T3, FOLLOWER, COUNT, ROW_WIDTH, KEY_WIDTH) == (0, 1, 4, 5, 6, 7, 6)
    assert TOKENS == slice(T0, T3 + 1)
    assert (DELTA_DTYPE, COUNTS_DTYPE) == (np.int32, np.int64)
    empty = empty_counts(2)
    assert empty.shape == (2, ROW_WIDTH) and empty.dtype == COUNTS_DTYPE and (empty == -1).all()
    # the core's own rows use the same layout
    table = _core.CountTable()
    table.add([5, 7], 9, 3)
    assert table.to_rows().tolist() == [[2, 5, 7, -1, -1, 9, 3]]
    assert validate_deltas(table.to_rows(), 10) is not None


@pytest.mark.parametrize("bad, message", [
    ([0, -1, -1, -1, -1, 1, 1], "n must be in 1..4"),
    ([5, 1, 1, 1, 1, 1, 1], "n must be in 1..4"),
    ([2, 1, 70_000, -1, -1, 1, 1], "outside"),
    ([2, -2, 1, -1, -1, 1, 1], "outside"),
    ([1, 1, 7, -1, -1, 1, 1], "unused token slot"),
    ([3, 1, 2, 3, 0, 1, 1], "unused token slot"),
    ([1, 1, -1, -1, -1, 70_000, 1], "follower"),
    ([1, 1, -1, -1, -1, 3, 0], "count"),
    ([1, 1, -1, -1, -1, 3, -1], "count"),
])
def test_validation_names_the_first_bad_row(bad: list[int], message: str) -> None:
    good = [1, 5, -1, -1, -1, 6, 1]
    with pytest.raises(InvalidArgumentError, match=f"row 1 .*{message}"):
        validate_deltas(rows(good, bad, bad), 70_000, 100)


def test_validation_of_the_array_itself() -> None:
    ok = rows([1, 5, -1, -1, -1, 6, 1])
    assert validate_deltas(ok, 70_000, 1) is ok
    assert validate_deltas(ok, 70_000) is ok  # no row limit
    for bad in (ok.astype(np.int64), ok.astype(np.uint32), ok[:, :6].copy(), ok.reshape(-1),
                np.asfortranarray(np.repeat(ok, 2, axis=0)), [[1, 5, -1, -1, -1, 6, 1]]):
        with pytest.raises(InvalidArgumentError):
            validate_deltas(bad, 70_000, 10)
    with pytest.raises(InvalidArgumentError, match="max_batch_rows"):
        validate_deltas(np.repeat(ok, 3, axis=0), 70_000, 2)
    assert len(validate_deltas(np.zeros((0, ROW_WIDTH), dtype=np.int32), 70_000, 2)) == 0


def test_validation_refuses_a_vocabulary_beyond_the_core_limit() -> None:
    ok = rows([1, 5, -1, -1, -1, 6, 1])
    assert validate_deltas(ok, MAX_VOCAB) is ok
    for vocab in (0, MAX_VOCAB + 1):
        with pytest.raises(InvalidArgumentError, match="vocab_size"):
            validate_deltas(ok, vocab)
