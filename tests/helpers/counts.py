"""Delta batches, one-batch writes and export helpers shared by the counts store tests (unit, integration) and benchmarks."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.counts.values import ApplyResult
from ngramcache.client.kernel.rows import COUNT, DELTA_DTYPE, FOLLOWER, KEY_WIDTH, NGRAM_MAX, ROW_WIDTH, TOKENS, N

__all__ = ["CONTRACT_BACKENDS", "FP", "OTHER_FP", "VOCAB", "apply", "as_counter", "batch", "exported", "random_batch",
           "row"]

FP = bytes(range(32))
OTHER_FP = bytes(range(1, 33))
VOCAB = 70_000  # 3-byte tokens

CONTRACT_BACKENDS = ("embedded", "standalone", "cluster", "sentinel")
"""The backends of the counts store contract: tests/integration/conftest.py's, and Sentinel (the contract holds
through redis+sentinel:// too). Each module of the contract sets ``BACKENDS`` to it: conftest's pytest_generate_tests
reads that name."""


def row(ngram: list[int], follower: int, count: int = 1) -> list[int]:
    """One delta row for an n-gram (unused token slots -1)."""
    return [len(ngram), *ngram, *([-1] * (NGRAM_MAX - len(ngram))), follower, count]


def batch(rows: list[list[int]]) -> np.ndarray:
    """A delta batch (m, ROW_WIDTH) int32 from row lists."""
    return np.array(rows, dtype=DELTA_DTYPE).reshape(-1, ROW_WIDTH)


def random_batch(rng: np.random.Generator, m: int, vocab: int = VOCAB, hot: int = 40) -> np.ndarray:
    """m rows over a small token range (``hot``) so keys repeat within and across batches."""
    n = rng.integers(1, NGRAM_MAX + 1, m)
    unused = np.arange(NGRAM_MAX)[None, :] >= n[:, None]
    toks = rng.integers(0, hot, (m, NGRAM_MAX))
    toks[unused] = -1
    toks[rng.random((m, NGRAM_MAX)) < 0.02] = vocab - 1  # the largest id survives the round trip
    toks[unused] = -1
    out = np.empty((m, ROW_WIDTH), dtype=DELTA_DTYPE)
    out[:, N] = n
    out[:, TOKENS] = toks
    out[:, FOLLOWER] = rng.integers(0, hot, m)
    out[:, COUNT] = rng.integers(1, 5, m)
    return out


def apply(store: CountsStore, namespace: str, client_id: str, seq: int, deltas: np.ndarray, *,
          fingerprint: bytes | str | None = None) -> ApplyResult:
    """`CountsStore.apply`: one sender's batch through the store's one write path (`apply_group` with one item)."""
    return store.apply(namespace, client_id, seq, deltas, fingerprint=fingerprint)


def as_counter(rows: np.ndarray) -> Counter[tuple[int, ...]]:
    """The summed count of each entry (n, t0..t3, follower) of delta rows."""
    total: Counter[tuple[int, ...]] = Counter()
    for r in rows.tolist():
        total[tuple(r[:KEY_WIDTH])] += r[COUNT]
    return total


def exported(store: CountsStore, namespace: str, **kwargs: int) -> Counter[tuple[int, ...]]:
    """A full export as {entry: count}, checking the chunks' dtype and shape and that no entry repeats."""
    result: Counter[tuple[int, ...]] = Counter()
    for chunk in store.export(namespace, **kwargs):
        assert chunk.dtype == np.int64 and chunk.shape[1] == ROW_WIDTH
        for r in chunk.tolist():
            key = tuple(r[:KEY_WIDTH])
            assert key not in result, f"export returned {key} twice"
            result[key] = r[COUNT]
    return result
