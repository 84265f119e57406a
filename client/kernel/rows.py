"""Count rows: the one Python definition of the delta/count row (twin of native/include/ngc/rows.h).

A row is `ROW_WIDTH` integers ``(n, t0, t1, t2, t3, follower, count)``: an n-gram of n
tokens t0..t(n-1) (``1 <= n <= NGRAM_MAX``; unused slots are -1), the token that followed
it, and a count > 0. Deltas (what a client pushes and a store receives) are `DELTA_DTYPE`
(int32) rows; absolute counts (what a store returns: `export`, `changes_since`) are
`COUNTS_DTYPE` (int64) rows. A sender validates with `validate_deltas` before pushing, the
store again after receiving.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from ngramcache.client._core import MAX_VOCAB, NGRAM_MAX
from ngramcache.client._core import ROW_WIDTH as _CORE_ROW_WIDTH
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = [
    "COUNT",
    "COUNTS_DTYPE",
    "DELTA_DTYPE",
    "FOLLOWER",
    "KEY_WIDTH",
    "MAX_VOCAB",
    "NGRAM_MAX",
    "ROW_WIDTH",
    "T0",
    "T1",
    "T2",
    "T3",
    "TOKENS",
    "N",
    "empty_counts",
    "validate_deltas",
]

# Column indexes of a row.
N: Final = 0
T0: Final = 1
T1: Final = 2
T2: Final = 3
T3: Final = 4
FOLLOWER: Final = 5
COUNT: Final = 6

ROW_WIDTH: Final[int] = _CORE_ROW_WIDTH
"""Integers in a row: (n, t0, t1, t2, t3, follower, count); the core's rows::kWidth."""
assert ROW_WIDTH == COUNT + 1

KEY_WIDTH: Final = COUNT
"""The leading columns that identify an entry: (n, t0, t1, t2, t3, follower)."""

TOKENS: Final = slice(T0, T0 + NGRAM_MAX)
"""The n-gram's token slots t0..t3."""

DELTA_DTYPE: Final = np.dtype(np.int32)
"""dtype of delta rows (pushed increments)."""

COUNTS_DTYPE: Final = np.dtype(np.int64)
"""dtype of absolute-count rows (what a store returns)."""

if FOLLOWER != T0 + NGRAM_MAX:  # the core and this file describe the same row
    raise ImportError(f"client.rows has {T3 - T0 + 1} token slots, the core NGRAM_MAX={NGRAM_MAX}")

_ROW_PROBLEMS: Final = (
    f"n must be in 1..{NGRAM_MAX}",
    "a token of the n-gram is outside [0, vocab_size)",
    f"an unused token slot (t{{n}}..t{NGRAM_MAX - 1}) is not -1",
    "follower is outside [0, vocab_size)",
    "count must be > 0",
)


def empty_counts(k: int = 0) -> np.ndarray:
    """An int64 count-row array (k, ROW_WIDTH) filled with -1 (unused token slots stay -1)."""
    return np.full((k, ROW_WIDTH), -1, dtype=COUNTS_DTYPE)


def validate_deltas(deltas: Any, vocab_size: int, max_rows: int | None = None) -> np.ndarray:
    """Check a delta batch whole; return it unchanged if valid.

    Args:
        deltas: C-contiguous int32 array of shape (m, ROW_WIDTH), rows (n, t0, t1, t2, t3,
            follower, count).
        vocab_size: tokens and followers lie in [0, vocab_size); at most MAX_VOCAB.
        max_rows: the largest m accepted (None: no limit).

    Returns:
        ``deltas`` itself.

    Raises:
        InvalidArgumentError: naming the first bad row and what is wrong with it.
    """
    if not isinstance(deltas, np.ndarray):
        raise InvalidArgumentError(f"deltas must be a numpy array, got {type(deltas).__name__}")
    if deltas.dtype != DELTA_DTYPE:
        raise InvalidArgumentError(f"deltas must have dtype int32, got {deltas.dtype}")
    if deltas.ndim != 2 or deltas.shape[1] != ROW_WIDTH:
        raise InvalidArgumentError(f"deltas must have shape (m, {ROW_WIDTH}), got {deltas.shape}")
    if not deltas.flags.c_contiguous:
        raise InvalidArgumentError("deltas must be C-contiguous")
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise InvalidArgumentError(f"vocab_size must be in [1, {MAX_VOCAB}], got {vocab_size}")
    m = deltas.shape[0]
    if max_rows is not None and m > max_rows:
        raise InvalidArgumentError(f"batch has {m} rows, more than max_batch_rows={max_rows}")
    if m == 0:
        return deltas
    n = deltas[:, N]
    toks = deltas[:, TOKENS]
    follower = deltas[:, FOLLOWER]
    count = deltas[:, COUNT]
    bad_n = (n < 1) | (n > NGRAM_MAX)
    used = np.arange(NGRAM_MAX)[None, :] < n[:, None]
    bad_tok = (used & ((toks < 0) | (toks >= vocab_size))).any(axis=1)
    bad_pad = (~used & (toks != -1)).any(axis=1) & ~bad_n
    bad_follower = (follower < 0) | (follower >= vocab_size)
    bad_count = count <= 0
    problems = np.stack([bad_n, bad_tok & ~bad_n, bad_pad, bad_follower, bad_count])
    if problems.any():
        row = int(np.flatnonzero(problems.any(axis=0))[0])
        what = _ROW_PROBLEMS[int(np.flatnonzero(problems[:, row])[0])]
        raise InvalidArgumentError(
            f"bad delta batch, refused whole: row {row} {deltas[row].tolist()}: {what} "
            f"(vocab_size={vocab_size})")
    return deltas
