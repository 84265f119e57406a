"""Unit tests of counts.history: record, batch, group, cursor and budget checks, and the near-duplicate key."""

from __future__ import annotations

import numpy as np
import pytest

from ngramcache.cache_service.counts.config import CountsStoreConfig
from ngramcache.cache_service.counts.history import (
    MAX_BATCH_RECORDS,
    MAX_RECORD_TOKENS,
    HistoryBudget,
    HistoryRecord,
    duplicate_key,
    format_composite_cursor,
    is_prompt,
    parse_cursor,
    partition_of,
    partitions_of_groups,
    validate_batch_seq,
    validate_limit,
    validate_partitions,
    validate_records,
)
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.history_buffer import validate_group
from ngramcache.client.kernel.history_sources import prompt_group

VOCAB = 1000


def rec(tokens: object = (1, 2, 3), *, seq: object = 7, group: object = "g", offset: object = 0) -> HistoryRecord:
    return HistoryRecord("ignored", seq, group, offset, np.asarray(tokens))  # type: ignore[arg-type]


def test_records_are_checked_and_normalised() -> None:
    out = validate_records([rec(np.array([1, 2, 3], dtype=np.int64), seq=-(2**63), offset=2**40 - 1)], "me", VOCAB)
    assert out[0].client_id == "me" and out[0].seq == -(2**63) and out[0].offset == 2**40 - 1
    assert out[0].tokens.dtype == np.dtype("<i4") and out[0].tokens.flags.c_contiguous
    assert validate_records([], "me", VOCAB) == []
    assert len(validate_records([rec(np.zeros(MAX_RECORD_TOKENS, dtype=np.int32))], "me", VOCAB)) == 1


@pytest.mark.parametrize("bad, words", [
    (rec(()), "1..4096 tokens"),
    (rec(np.zeros(MAX_RECORD_TOKENS + 1, dtype=np.int32)), "1..4096 tokens"),
    (rec((1, VOCAB)), f"token {VOCAB} is outside"),
    (rec((-1, 2)), "token -1 is outside"),
    (rec((1.5, 2.0)), "integer array"),
    (rec([[1, 2]]), "integer array"),
    (rec(seq=2**63), "seq must be an int64"),
    (rec(seq=True), "seq must be an int64"),
    (rec(offset=-1), "offset"),
    (rec(offset=2**40), "offset"),
    (rec(group="a b"), "group"),
    (rec(group="x" * 65), "group"),
    (rec(group=None), "group"),
])
def test_a_bad_record_is_named(bad: HistoryRecord, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match="history record 1") as caught:
        validate_records([rec(), bad, rec()], "me", VOCAB)
    assert words in str(caught.value)


def test_batch_level_checks() -> None:
    with pytest.raises(InvalidArgumentError, match="at most 256"):
        validate_records([rec()] * (MAX_BATCH_RECORDS + 1), "me", VOCAB)
    with pytest.raises(InvalidArgumentError, match="client_id"):
        validate_records([rec()], "bad id", VOCAB)
    with pytest.raises(InvalidArgumentError, match="not a HistoryRecord"):
        validate_records([(1, 2)], "me", VOCAB)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="sequence"):
        validate_records(rec(), "me", VOCAB)  # type: ignore[arg-type]
    assert validate_batch_seq(0) == 0 and validate_batch_seq(2**53 - 1) == 2**53 - 1
    for bad in (-1, 2**53, 1.0, True, "1"):
        with pytest.raises(InvalidArgumentError, match="batch_seq"):
            validate_batch_seq(bad)  # type: ignore[arg-type]
    assert validate_limit(1) == 1 and validate_limit(65536) == 65536
    for bad in (0, 65537, 2.0, False):
        with pytest.raises(InvalidArgumentError, match="limit"):
            validate_limit(bad)  # type: ignore[arg-type]


def test_groups() -> None:
    for good in ("", "a", "prompt:1a2b", "A-z_0.9", "x" * 64):
        assert validate_group(good, empty_ok=True) == good
    for bad in ("x" * 65, "a/b", "é", " "):
        with pytest.raises(InvalidArgumentError):
            validate_group(bad, empty_ok=True)
    with pytest.raises(InvalidArgumentError, match="1..64"):
        validate_group("")  # a client's group is never empty


def test_cursors() -> None:
    assert parse_cursor("") is None
    cursor = parse_cursor("abc123.1700000000000-5")
    assert cursor is not None and (cursor.incarnation, cursor.position) == ("abc123", "1700000000000-5")
    cursor = parse_cursor("f00.42")
    assert cursor is not None and cursor.position == "42"
    for bad in ("x", "abc.", ".5", "a.b", "a.1-", "a.-1", "a b.1", "a.1.2", "a" * 65 + ".1"):
        with pytest.raises(InvalidArgumentError, match="cursor"):
            parse_cursor(bad)
    with pytest.raises(InvalidArgumentError, match="cursor"):
        parse_cursor(5)  # type: ignore[arg-type]


def test_composite_cursors_hold_a_position_per_partition() -> None:
    cursor = parse_cursor("abc.1700000000000-5__1700000000001-0")
    assert cursor is not None and cursor.position == "" and cursor.positions == ("1700000000000-5", "", "1700000000001-0")
    assert format_composite_cursor("abc", cursor.positions) == "abc.1700000000000-5__1700000000001-0"
    empty = parse_cursor("abc._")  # two partitions, both from their oldest
    assert empty is not None and empty.positions == ("", "")
    assert parse_cursor("abc.1-2").positions == ()  # type: ignore[union-attr]  # single position: as before
    assert parse_cursor("a." + "_" * 63).positions == ("",) * 64  # type: ignore[union-attr]
    for bad in ("a." + "_" * 64, "a.1_2", "a.1-2_x", "a.1-2__-3", "a.1-2 _"):
        with pytest.raises(InvalidArgumentError, match="cursor"):
            parse_cursor(bad)


def test_records_go_to_the_partition_of_their_group_or_sequence() -> None:
    def where(client_id: str, seq: int, group: str, partitions: int = 12) -> int:
        return partition_of(HistoryRecord(client_id, seq, group, 0, np.zeros(1, dtype=np.int32)), partitions)

    # Pinned: every replica and version must agree (a stable hash, never Python's).
    assert [where("", 0, "grp1"), where("client-a", 7, ""), where("client-a", 8, "")] == [9, 0, 9]
    assert where("a", 1, "g") == where("b", 2, "g") and where("a", 1, "g", 1) == 0
    counts = np.bincount([where(f"c{i % 50}", i, "") for i in range(12_000)], minlength=12)
    assert counts.min() > 0.9 * 1000 and counts.max() < 1.1 * 1000  # sequences spread evenly
    assert partitions_of_groups(["grp1"], 12) == [9]
    assert partitions_of_groups([], 3) == [0, 1, 2] and partitions_of_groups(["", "g"], 3) == [0, 1, 2]
    assert validate_partitions(64) == 64
    for bad in (0, 65, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="partitions"):
            validate_partitions(bad)  # type: ignore[arg-type]
    assert CountsStoreConfig.from_env({"NGC_COUNTS_HISTORY_PARTITIONS": "3"}).history_partitions == 3
    assert CountsStoreConfig().history_partitions is None
    assert CountsStoreConfig.from_url("redis://h:1?history_partitions=3").history_partitions == 3
    with pytest.raises(InvalidArgumentError, match=r"history_partitions must be an integer in \[1, 64\], got 0"):
        CountsStoreConfig(history_partitions=0)


def test_budget_and_config() -> None:
    assert HistoryBudget() == HistoryBudget(64 << 20, 3600.0)
    assert HistoryBudget(max_age_s=0.0005).max_age_ms == 1
    for bad in ({"max_bytes": 0}, {"max_bytes": 1.5}, {"max_age_s": 0}, {"max_age_s": -1.0}):
        with pytest.raises(InvalidArgumentError, match="history"):
            HistoryBudget(**bad)  # type: ignore[arg-type]
    config = CountsStoreConfig.from_url("redis://h:1?history_max_bytes=4096&history_max_age=2.5")
    assert config.history_budget == HistoryBudget(4096, 2.5)
    assert CountsStoreConfig.from_env({"NGC_COUNTS_HISTORY_MAX_BYTES": "8"}).history_max_bytes == 8
    with pytest.raises(InvalidArgumentError, match="history"):
        CountsStoreConfig(history_max_bytes=0)
    with pytest.raises(InvalidArgumentError, match="history"):
        CountsStoreConfig.from_url(None, history_max_age=-1.0)


def test_duplicate_key_is_group_and_tokens_of_a_prompt_only() -> None:
    """Only a prompt (offset 0, in the group its tokens name: the client's default group) has a near-duplicate key;
    any other record at offset 0 (an explicit group's, a prompt drained with generated tokens) is a sequence's own
    start and is never skipped for a sibling's."""
    g12, g13 = prompt_group(np.array([1, 2], np.int32)), prompt_group(np.array([1, 3], np.int32))
    (a, b, c, d, e, f) = validate_records([rec((1, 2), group=g12), rec((1, 2), seq=9, group=g12),
                                           rec((1, 3), group=g13), rec((1, 2), group="h"), rec((1, 2), group=g12,
                                                                                                offset=5),
                                           rec((1, 2, 3), group=g12)], "me", VOCAB)
    assert [is_prompt(r) for r in (a, b, c, d, e, f)] == [True, True, True, False, False, False]
    assert duplicate_key(a) == duplicate_key(b) and duplicate_key(a) is not None
    assert duplicate_key(a) != duplicate_key(c)
    assert duplicate_key(d) is None and duplicate_key(e) is None and duplicate_key(f) is None
    # The store's rule and the client's default group agree on the digest (int32 little-endian, 8-byte BLAKE2b).
    tokens = np.arange(300, dtype=np.int64)
    assert is_prompt(HistoryRecord("c", 1, prompt_group(tokens), 0, tokens.astype("<i4")))
