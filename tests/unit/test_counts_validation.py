"""Unit tests of the counts store's shared logic: batch validation, the bucket/field layout, config and URL handling."""

from __future__ import annotations

import mmh3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramcache.cache_service import redis_schema
from ngramcache.cache_service.counts_store import (
    HASH_SEED,
    CountsStoreConfig,
    NamespaceInfo,
    decode_fields,
    encode_batch,
    murmur3_32,
    ngram_bucket,
    normalize_fingerprint,
    redact_url,
    token_width,
    validate_deltas,
)
from ngramcache.cache_service.redis_store import _parse_url
from ngramcache.client.errors import InvalidArgumentError

INFO = NamespaceInfo("ns", "ab" * 32, 70_000, 1024, 4, "0123abcd")
GOLDEN = [54, 39, 149, 672, 391]  # buckets of the n-grams in test_bucket_hash_is_pinned


def rows(*r: list[int]) -> np.ndarray:
    return np.array(r, dtype=np.int32).reshape(-1, 7)


def test_token_width() -> None:
    assert [token_width(v) for v in (1, 256, 257, 65_536, 65_537, 1 << 24, (1 << 24) + 1, 2**31 - 1)] == \
        [1, 1, 2, 2, 3, 3, 4, 4]


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
    for bad in (ok.astype(np.int64), ok.astype(np.uint32), ok[:, :6].copy(), ok.reshape(-1),
                np.asfortranarray(np.repeat(ok, 2, axis=0)), [[1, 5, -1, -1, -1, 6, 1]]):
        with pytest.raises(InvalidArgumentError):
            validate_deltas(bad, 70_000, 10)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_batch_rows"):
        validate_deltas(np.repeat(ok, 3, axis=0), 70_000, 2)
    assert len(validate_deltas(np.zeros((0, 7), dtype=np.int32), 70_000, 2)) == 0


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
def test_vectorized_murmur3_equals_mmh3(length: int, seed: int, k: int, rnd: object) -> None:
    data = np.frombuffer(bytes(rnd.getrandbits(8) for _ in range(length * k)), dtype=np.uint8)  # type: ignore[attr-defined]
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


def test_fingerprints_normalize() -> None:
    assert normalize_fingerprint(bytes(range(32))) == bytes(range(32)).hex()
    assert normalize_fingerprint("AB" * 32) == "ab" * 32
    for bad in (b"x" * 31, "zz" * 32, "ab" * 31, 5):
        with pytest.raises(InvalidArgumentError):
            normalize_fingerprint(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- config and URLs


def test_config_from_url_and_env() -> None:
    config = CountsStoreConfig.from_url("redis://h:1/0?epoch_seconds=0.5&prefix=x&default_shards=none")
    assert (config.epoch_seconds, config.prefix, config.default_shards) == (0.5, "x", None)
    assert CountsStoreConfig.from_url(None).url is None
    env = {"NGC_COUNTS_URL": "redis+cluster://a:1,b:2", "NGC_COUNTS_HISTORY_EPOCHS": "7",
           "NGC_COUNTS_PREFIX": "p"}
    config = CountsStoreConfig.from_env(env)
    assert (config.url, config.history_epochs, config.prefix) == ("redis+cluster://a:1,b:2", 7, "p")
    for bad in ("http://x", "redis://h?epoch_seconds=abc", "redis://h?default_buckets=1000"):
        with pytest.raises(InvalidArgumentError):
            CountsStoreConfig.from_url(bad)
    with pytest.raises(InvalidArgumentError):
        CountsStoreConfig.from_url(None, no_such_option=1)


def test_passwords_are_redacted_everywhere() -> None:
    assert redact_url("redis://:hunter2@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://user:hunter2@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("rediss://hunter2@h:1") == "rediss://***@h:1"
    assert redact_url("redis+cluster://u:p%40ss@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("redis://h:1") == "redis://h:1" and redact_url(None) is None
    config = CountsStoreConfig.from_url("redis://user:hunter2@h:1/0")
    assert "hunter2" not in repr(config) and "hunter2" not in str(config)
    with pytest.raises(InvalidArgumentError) as caught:
        CountsStoreConfig.from_url("http://user:hunter2@h")
    assert "hunter2" not in str(caught.value)


def test_parse_url_forms() -> None:
    parts = _parse_url("rediss://us%3Aer:p%40ss@host:6380/3")
    assert (parts["ssl"], parts["hosts"], parts["db"], parts["username"], parts["password"]) == \
        (True, [("host", 6380)], 3, "us:er", "p@ss")
    parts = _parse_url("redis+cluster://:pw@a:1,b:2,[::1]:3/?prefix=x")
    assert parts["cluster"] and parts["hosts"] == [("a", 1), ("b", 2), ("::1", 3)] and parts["password"] == "pw"
    assert _parse_url("redis://h")["hosts"] == [("h", 6379)]
    for bad in ("redis://a:1,b:2", "redis://h:port", "redis://", "redis://h:1/db"):
        with pytest.raises(InvalidArgumentError):
            _parse_url(bad)


# --------------------------------------------------------------------------- key schema


def test_shard_tags_spread_evenly_over_slots_and_keys_of_a_shard_share_a_slot() -> None:
    from redis.crc import key_slot

    tags = redis_schema.shard_tags("ns", "0123abcd", 64)
    slots = [key_slot(t.encode()) for t in tags]
    assert [s * 64 // 16384 for s in slots] == list(range(64))
    keys = redis_schema.shard_keys("ngc", "ns", "0123abcd", 64)[5]
    names = [keys.state, keys.changes, keys.history, keys.index, keys.dedup("client-1"), keys.bucket(12345)]
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert redis_schema.bucket_of_key(keys.bucket(12345).encode()) == 12345
