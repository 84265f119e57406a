"""Unit tests of counts.namespace: fingerprints, the vocabulary limit, token widths, layouts and stale records."""

from __future__ import annotations

import pytest

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.namespace import (
    StaleNamespace,
    normalize_fingerprint,
    rerun_if_stale,
    token_width,
    validate_layout,
    validate_vocab_size,
)
from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError
from ngramcache.client.kernel.rows import MAX_VOCAB


def test_token_width() -> None:
    assert [token_width(v) for v in (1, 256, 257, 65_536, 65_537, 1 << 24)] == [1, 1, 2, 2, 3, 3]
    assert token_width(MAX_VOCAB) == 3  # so a field token never needs 4 bytes
    for too_big in ((1 << 24) + 1, 2**31 - 1):
        with pytest.raises(InvalidArgumentError):
            token_width(too_big)


def test_vocab_size_is_limited_to_max_vocab() -> None:
    assert MAX_VOCAB == 2**24
    assert validate_vocab_size(1) == 1 and validate_vocab_size(MAX_VOCAB) == MAX_VOCAB
    for bad in (0, -1, MAX_VOCAB + 1, 2**31 - 1, True, 1.0, "5"):
        with pytest.raises(InvalidArgumentError):
            validate_vocab_size(bad)  # type: ignore[arg-type]
    store = open_counts_store(None)
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        store.create_namespace("big", bytes(32), MAX_VOCAB + 1)
    assert store.create_namespace("big", bytes(32), MAX_VOCAB).token_width == 3


def test_fingerprints_normalize() -> None:
    assert normalize_fingerprint(bytes(range(32))) == bytes(range(32)).hex()
    assert normalize_fingerprint("AB" * 32) == "ab" * 32
    for bad in (b"x" * 31, "zz" * 32, "ab" * 31, 5):
        with pytest.raises(InvalidArgumentError):
            normalize_fingerprint(bad)  # type: ignore[arg-type]


def test_layouts() -> None:
    assert validate_layout(1024, 64) == (1024, 64)
    for buckets, shards in ((1000, 1), (1024, 3), (4, 8), (0, 1), (2**31, 1), (2**20, 2**15)):
        with pytest.raises(InvalidArgumentError):
            validate_layout(buckets, shards)


def test_a_stale_record_is_read_again_and_the_action_rerun_once() -> None:
    asked: list[str | None] = []

    def record(stale: str | None) -> str:
        asked.append(stale)
        return "cached" if stale is None else "fresh"

    def action(current: str) -> str:
        if current == "cached":
            raise StaleNamespace
        return current

    assert rerun_if_stale("ns", record, action) == "fresh" and asked == [None, "cached"]

    def always_stale(current: str) -> str:
        raise StaleNamespace

    with pytest.raises(NamespaceNotFoundError, match="dropped or recreated"):  # changed again: no third run
        rerun_if_stale("ns", record, always_stale)
