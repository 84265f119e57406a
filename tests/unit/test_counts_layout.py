"""Unit tests of counts.layout: the bucket hash, the field codec and batches encoded by (shard, bucket)."""

from __future__ import annotations

import random

import mmh3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramcache.cache_service.counts.layout import (
    HASH_SEED,
    decode_fields,
    encode_batch,
    encode_group,
    murmur3_32,
    ngram_bucket,
)
from ngramcache.cache_service.counts.namespace import NamespaceRecord
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.rows import ROW_WIDTH

INFO = NamespaceRecord("ns", "ab" * 32, 70_000, 1024, 4, "0123abcd")
GOLDEN = [54, 39, 149, 672, 391]  # buckets of the n-grams in test_bucket_hash_is_pinned


def rows(*r: list[int]) -> np.ndarray:
    return np.array(r, dtype=np.int32).reshape(-1, ROW_WIDTH)


def test_encode_sums_repeats_and_groups_by_shard_then_bucket() -> None:
    deltas = rows([2, 5, 7, -1, -1, 9, 3], [1, 5, -1, -1, -1, 8, 1], [2, 5, 7, -1, -1, 9, 2],
                  [4, 1, 2, 3, 4, 5, 10], [2, 5, 7, -1, -1, 10, 1])
    enc = encode_batch(deltas, INFO)
    assert enc.entries == 4 and int(enc.counts.sum()) == 17
    shards = enc.buckets % INFO.shards
    assert np.all(np.diff(shards) >= 0)
    for s in range(INFO.shards):
        lo, hi = enc.shard_bounds[s], enc.shard_bounds[s + 1]
        assert np.all(shards[lo:hi] == s) and np.all(np.diff(enc.buckets[lo:hi]) >= 0)
    decoded = decode_fields(enc.field_list(), enc.counts.tolist(), INFO.token_width)
    got = {tuple(r[:6]): r[6] for r in decoded.tolist()}
    assert got == {(2, 5, 7, -1, -1, 9): 5, (1, 5, -1, -1, -1, 8): 1, (4, 1, 2, 3, 4, 5): 10,
                   (2, 5, 7, -1, -1, 10): 1}
    # every follower of an n-gram shares the n-gram's bucket, the one lookup reads
    for r, bucket in zip(decoded.tolist(), enc.buckets.tolist()):
        assert ngram_bucket(r[1:1 + r[0]], INFO) == bucket


def test_summed_counts_are_capped() -> None:
    big = rows(*([[1, 1, -1, -1, -1, 1, 2**31 - 1]] * 50_000))
    with pytest.raises(InvalidArgumentError, match="10\\*\\*14"):
        encode_batch(big, INFO)


def test_bucket_hash_is_pinned() -> None:
    """The bucket of an n-gram is part of the stored layout: changing it orphans stored data."""
    key = (5).to_bytes(3, "little") + (7).to_bytes(3, "little")
    assert ngram_bucket([5, 7], INFO) == mmh3.hash(key, HASH_SEED, signed=False) & 1023
    assert [ngram_bucket(g, INFO) for g in ([5, 7], [0], [1, 2], [69_999, 3, 2], [1, 2, 3, 4])] == GOLDEN


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(0, 2**32 - 1), st.integers(1, 40), st.randoms(use_true_random=False))
def test_vectorized_murmur3_equals_mmh3(length: int, seed: int, k: int, rnd: random.Random) -> None:
    data = np.frombuffer(bytes(rnd.getrandbits(8) for _ in range(length * k)), dtype=np.uint8)
    data = data.reshape(k, length)
    expected = [mmh3.hash(bytes(r), seed, signed=False) for r in data]
    assert murmur3_32(data, seed).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 69_999), min_size=5, max_size=5),
                          st.integers(1, 1000)), min_size=1, max_size=60))
def test_encode_then_decode_round_trips(entries: list[tuple[int, list[int], int]]) -> None:
    deltas = rows(*[[n, *(toks[:n] + [-1] * (4 - n)), toks[4], c] for n, toks, c in entries])
    enc = encode_batch(deltas, INFO)
    decoded = decode_fields(enc.field_list(), enc.counts.tolist(), INFO.token_width)
    expected: dict[tuple[int, ...], int] = {}
    for r in deltas.tolist():
        expected[tuple(r[:6])] = expected.get(tuple(r[:6]), 0) + r[6]
    assert {tuple(r[:6]): r[6] for r in decoded.tolist()} == expected


def test_foreign_fields_are_refused() -> None:
    width = INFO.token_width
    for field in (b"\x01" * width, b"\x01" * (width + 1), b"\x01" * (6 * width)):
        with pytest.raises(InvalidArgumentError, match="not a valid entry"):
            decode_fields([field], [1], width)


def _random_rows(rng: np.random.Generator, m: int) -> np.ndarray:
    n = rng.integers(1, 5, m)
    toks = rng.integers(0, 6, (m, 4))
    toks[np.arange(4)[None, :] >= n[:, None]] = -1
    out = np.empty((m, ROW_WIDTH), dtype=np.int32)
    out[:, 0], out[:, 1:5], out[:, 5], out[:, 6] = n, toks, rng.integers(0, 6, m), rng.integers(1, 4, m)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_encode_group_equals_the_concatenation_and_knows_each_items_share(seed: int) -> None:
    rng = np.random.default_rng(seed)
    items = [_random_rows(rng, int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 7)))]
    group = encode_group(items, INFO)
    whole = encode_batch(np.concatenate(items), INFO)
    for name in ("buckets", "counts", "lengths", "field_matrix", "shard_bounds"):
        assert np.array_equal(getattr(group.batch, name), getattr(whole, name)), name
    for i, item in enumerate(items):
        alone = encode_batch(item, INFO)
        assert group.item_entries[i] == alone.entries
        assert group.item_shards[i].tolist() == (np.diff(alone.shard_bounds) > 0).tolist()


def test_encode_group_refuses_a_sum_over_the_cap() -> None:
    big = rows(*[[1, 5, -1, -1, -1, 8, 2**31 - 1]] * 25_000)  # 5.4e13 an item
    assert int(encode_group([big], INFO).batch.counts[0]) == 25_000 * (2**31 - 1)
    with pytest.raises(InvalidArgumentError):
        encode_group([big, big], INFO)
