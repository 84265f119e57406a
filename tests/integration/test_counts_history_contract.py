"""One contract for the fleet history of every counts store backend: embedded, a real standalone redis-server, a real 3-master Redis Cluster.

On the Cluster a namespace's history is partitioned (12 partitions by default): records of
different partitions stored in the same millisecond come in no fixed order, so these tests
check order within a sequence (one partition) and compare the rest as sets; the
partition-specific rules are in test_history_partitions.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from helpers.counts import FP, OTHER_FP, VOCAB

from ngramcache.cache_service.counts.history import (
    MAX_BATCH_RECORDS,
    HistoryAppend,
    HistoryBatch,
    HistoryPage,
    HistoryRecord,
)
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError, TokenizerMismatchError
from ngramcache.client.kernel.history_sources import prompt_group

pytestmark = pytest.mark.integration


def rec(tokens: list[int] | np.ndarray, *, seq: int = 1, group: str = "", offset: int = 1) -> HistoryRecord:
    return HistoryRecord("", seq, group, offset, np.asarray(tokens, dtype=np.int32))


def read_all(store: CountsStore, namespace: str, after: str = "", limit: int = 1024) -> tuple[list[HistoryRecord],
                                                                                                 HistoryPage]:
    """Every record after ``after``, page by page; and the last page."""
    out: list[HistoryRecord] = []
    while True:
        page = store.read_history(namespace, after, limit)
        out += page.records
        if not page.records:
            return out, page
        after = page.cursor


def shape(records: list[HistoryRecord]) -> list[tuple[str, int, str, int, list[int]]]:
    return [(r.client_id, r.seq, r.group, r.offset, r.tokens.tolist()) for r in records]


def partitioned(store: CountsStore, namespace: str) -> bool:
    return store.namespace_info(namespace).history_partitions > 1


def test_a_batch_is_stored_exactly_once(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    first = [HistoryRecord("whoever", -(2**63), "g1", 0, np.array([5, 6, 7], dtype=np.int32)),
             rec([69_999], seq=2**63 - 1, offset=2**40 - 1)]
    assert store.append_history(namespace, "a", 3, first, fingerprint=FP) == HistoryAppend(True, 2, 4)
    assert store.append_history(namespace, "a", 3, first) == HistoryAppend(False)  # a retry
    # Below the highest (on a partitioned history: the highest in the record's partition, here g1's).
    assert store.append_history(namespace, "a", 1, [rec([9], group="g1")]) == HistoryAppend(False)
    assert store.append_history(namespace, "b", 1, [rec([8])]).stored  # another sender has its own seqs
    assert store.append_history(namespace, "a", 4, [rec([1, 2])]) == HistoryAppend(True, 1, 2)
    assert store.append_history(namespace, "a", 5, []) == HistoryAppend(True)  # empty: stores nothing, takes the seq
    assert not store.append_history(namespace, "a", 5, []).stored
    records, _ = read_all(store, namespace)
    expected = [("a", -(2**63), "g1", 0, [5, 6, 7]), ("a", 2**63 - 1, "", 2**40 - 1, [69_999]),
                ("b", 1, "", 1, [8]), ("a", 1, "", 1, [1, 2])]
    assert shape(records) == expected or (partitioned(store, namespace) and sorted(shape(records)) == sorted(expected))
    assert all(r.tokens.dtype == np.int32 for r in records)
    assert store.history_stats(namespace) == {"records": 4, "tokens": 7, "bytes": 28}


def test_bad_batches_are_refused_whole(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    good = rec([1, 2, 3])
    cases: list[tuple[list[HistoryRecord], str]] = [
        ([good, rec([1, VOCAB])], "history record 1"),
        ([good, rec([])], "history record 1"),
        ([rec([1], group="no spaces")], "group"),
        ([rec([1], offset=-1)], "offset"),
        ([rec(np.zeros(4097, dtype=np.int32))], "4096"),
        ([good] * (MAX_BATCH_RECORDS + 1), "at most 256"),
    ]
    for records, words in cases:
        with pytest.raises(InvalidArgumentError, match=words):
            store.append_history(namespace, "a", 1, records)
    with pytest.raises(TokenizerMismatchError):
        store.append_history(namespace, "a", 1, [good], fingerprint=OTHER_FP)
    for bad_seq in (-1, 2**53):
        with pytest.raises(InvalidArgumentError, match="batch_seq"):
            store.append_history(namespace, "a", bad_seq, [good])
    with pytest.raises(InvalidArgumentError, match="client_id"):
        store.append_history(namespace, "", 1, [good])
    assert store.history_stats(namespace)["records"] == 0
    assert store.append_history(namespace, "a", 1, [good]).stored  # the refused calls took no seq
    missing = "t-missing-" + uuid.uuid4().hex[:8]
    with pytest.raises(NamespaceNotFoundError):
        store.append_history(missing, "a", 1, [good])
    with pytest.raises(NamespaceNotFoundError):
        store.read_history(missing)
    with pytest.raises(NamespaceNotFoundError):
        store.history_stats(missing)
    for bad_cursor in ("junk", "abc.", "x.y", 5):
        with pytest.raises(InvalidArgumentError, match="cursor"):
            store.read_history(namespace, bad_cursor)  # type: ignore[arg-type]
    for bad_limit in (0, 65537):
        with pytest.raises(InvalidArgumentError, match="limit"):
            store.read_history(namespace, "", bad_limit)


def test_reads_page_in_order_and_resume_after_a_cursor(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    before = time.time() * 1000
    for b in range(1, 6):
        store.append_history(namespace, "a", b, [rec([b, i], seq=b, offset=10 * i) for i in range(3)])
    everything = store.read_history(namespace, "", 65536)
    expected = [(b, 10 * i) for b in range(1, 6) for i in range(3)]
    got = [(r.seq, r.offset) for r in everything.records]
    assert got == expected or (partitioned(store, namespace) and sorted(got) == expected)
    for b in range(1, 6):  # a sequence's records in order (one partition)
        assert [offset for seq, offset in got if seq == b] == [0, 10, 20]
    assert everything.cursor == everything.records[-1].cursor and not everything.gap
    assert len({r.cursor for r in everything.records}) == 15
    assert all(before - 1000 <= r.time_ms <= time.time() * 1000 + 1000 for r in everything.records)
    paged, last = read_all(store, namespace, limit=4)
    assert shape(paged) == shape(everything.records) and not last.gap
    assert last.cursor == everything.cursor  # nothing new: the cursor given back
    middle = everything.records[6].cursor
    # At most 2; a partitioned history may answer fewer (each partition's share of the page), never out of order.
    after_middle = store.read_history(namespace, middle, 2).records
    assert len(after_middle) == 2 or (partitioned(store, namespace) and len(after_middle) == 1)
    assert shape(after_middle) == shape(everything.records[7:7 + len(after_middle)])
    store.append_history(namespace, "a", 6, [rec([42])])
    page = store.read_history(namespace, everything.cursor)
    assert shape(page.records) == [("a", 1, "", 1, [42])] and not page.gap


def test_the_byte_budget_drops_the_oldest(make_store: Callable[..., CountsStore], namespace: str) -> None:
    store = make_store(history_max_bytes=4 * 100, history_partitions=1)  # one stream (the budget split: partitions)
    store.create_namespace(namespace, FP, VOCAB)
    store.append_history(namespace, "a", 1, [rec(list(range(30)), seq=0)])
    start = store.read_history(namespace).cursor
    for b in range(2, 12):
        store.append_history(namespace, "a", b, [rec(list(range(30)), seq=b)])
    assert store.history_stats(namespace) == {"records": 3, "tokens": 90, "bytes": 360}
    kept = store.read_history(namespace)
    assert [r.seq for r in kept.records] == [9, 10, 11] and not kept.gap
    behind = store.read_history(namespace, start)  # its successors were trimmed unseen
    assert behind.gap and [r.seq for r in behind.records] == [9, 10, 11]
    assert not store.read_history(namespace, behind.records[0].cursor).gap
    store.append_history(namespace, "a", 20, [rec(list(range(150)), seq=20)])  # alone over the budget
    assert store.history_stats(namespace)["records"] == 0
    assert store.read_history(namespace, kept.cursor).gap


def test_the_age_budget_drops_old_records(make_store: Callable[..., CountsStore], namespace: str) -> None:
    store = make_store(history_max_age=0.4)
    store.create_namespace(namespace, FP, VOCAB)
    store.append_history(namespace, "a", 1, [rec([1, 2], seq=1)])
    cursor = store.read_history(namespace).cursor
    time.sleep(0.6)
    old = store.read_history(namespace, "")  # a read trims too: no expired record is answered
    assert old.records == [] and not old.gap
    assert store.history_stats(namespace) == {"records": 0, "tokens": 0, "bytes": 0}
    store.append_history(namespace, "a", 2, [rec([3], seq=2)])
    page = store.read_history(namespace, cursor)
    assert [r.seq for r in page.records] == [2] and not page.gap  # nothing unseen was lost after cursor
    gone = store.read_history(namespace, "")
    time.sleep(0.6)
    store.append_history(namespace, "a", 3, [rec([4], seq=3)])
    late = store.read_history(namespace, gone.records[0].cursor)
    assert not late.gap and [r.seq for r in late.records] == [3]
    stale = store.read_history(namespace, cursor)
    assert stale.gap and [r.seq for r in stale.records] == [3]


def test_another_incarnations_cursor_reads_from_the_oldest_with_a_gap(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    store.append_history(namespace, "a", 1, [rec([1], seq=1), rec([2], seq=2)])
    old = store.read_history(namespace)
    other = namespace + "-o"
    try:
        store.create_namespace(other, FP, VOCAB)
        store.append_history(other, "a", 1, [rec([9], seq=9)])
        foreign = store.read_history(other).cursor
        page = store.read_history(namespace, foreign)
        assert page.gap and sorted(r.seq for r in page.records) == [1, 2]
        assert not store.read_history(namespace, page.cursor).gap
    finally:
        store.drop_namespace(other)
    assert store.drop_namespace(namespace)
    store.create_namespace(namespace, FP, VOCAB)
    assert store.history_stats(namespace) == {"records": 0, "tokens": 0, "bytes": 0}  # the drop took the history
    empty = store.read_history(namespace, old.cursor)
    assert empty.gap and empty.records == [] and empty.cursor != old.cursor
    assert not store.read_history(namespace, empty.cursor).gap  # the gap is reported once
    assert store.append_history(namespace, "a", 1, [rec([3], seq=3)]).stored  # dedup records went too
    again = store.read_history(namespace, empty.cursor)
    assert [r.seq for r in again.records] == [3] and not again.gap


def test_a_prompt_sent_by_siblings_is_stored_once_and_counted_as_skipped(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    prompt = [11, 12, 13, 14]
    p1 = prompt_group(np.array(prompt))  # the client's default group: the prompt's hash
    replies = [store.append_history(namespace, f"w{sibling}", 1,
                                    [rec(prompt, seq=sibling, group=p1, offset=0),
                                     rec([sibling], seq=sibling, group=p1, offset=4)])
               for sibling in range(8)]
    # Every record is stored or skipped, and the reply says which: stored + skipped is the batch.
    assert replies == [HistoryAppend(True, 2, 5)] + [HistoryAppend(True, 1, 1, 1, 4)] * 7
    assert store.append_history(namespace, "w0", 2, [rec(prompt, seq=20, group="p2", offset=0),  # another group
                                                     rec(prompt, seq=21, group=p1, offset=7)]  # not at offset 0
                                ) == HistoryAppend(True, 2, 8)
    records, _ = read_all(store, namespace)
    assert sum(r.offset == 0 and r.group == p1 for r in records) == 1
    assert sorted(r.tokens.tolist()[0] for r in records if r.offset == 4) == list(range(8))
    assert {(r.seq, r.group) for r in records[-2:]} == {(20, "p2"), (21, p1)}
    assert store.history_stats(namespace) == {"records": 11, "tokens": 4 + 8 + 8, "bytes": 80}


def test_a_sequence_start_that_is_not_a_prompt_is_never_skipped(store: CountsStore, namespace: str) -> None:
    """Equal records at offset 0 that are not a prompt in its own group (an explicit group's opening, a prompt drained
    together with generated tokens) are each sibling's own start: all kept."""
    store.create_namespace(namespace, FP, VOCAB)
    opening = [11, 12, 13, 14, 15]
    explicit = [store.append_history(namespace, f"e{s}", 1, [rec(opening, seq=s, group="rollout-1", offset=0)])
                for s in range(3)]
    drained = prompt_group(np.array(opening[:4]))  # the group names the prompt, the record holds one token more
    longer = [store.append_history(namespace, f"d{s}", 1, [rec(opening, seq=s, group=drained, offset=0)])
              for s in range(3)]
    assert explicit + longer == [HistoryAppend(True, 1, 5)] * 6
    records, _ = read_all(store, namespace)
    got = [(r.client_id, r.offset, r.tokens.tolist()) for r in records]
    expected = [(f"e{s}", 0, opening) for s in range(3)] + [(f"d{s}", 0, opening) for s in range(3)]
    assert got == expected or (partitioned(store, namespace) and sorted(got) == sorted(expected))


def test_drop_namespace_removes_the_history(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    store.append_history(namespace, "a", 1, [rec([1, 2, 3])])
    assert store.drop_namespace(namespace)
    with pytest.raises(NamespaceNotFoundError):
        store.read_history(namespace)
    with pytest.raises(NamespaceNotFoundError):
        store.append_history(namespace, "a", 2, [rec([1])])
    store.create_namespace(namespace, FP, VOCAB)
    assert store.read_history(namespace).records == []


def test_concurrent_appenders_lose_nothing(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    clients, batches, per_batch = 6, 20, 4
    errors: list[BaseException] = []

    def sender(c: int) -> None:
        try:
            for b in range(1, batches + 1):
                records = [rec([c, b, i], seq=c, offset=b * per_batch + i) for i in range(per_batch)]
                assert store.append_history(namespace, f"c{c}", b, records) == HistoryAppend(True, per_batch, 3 * per_batch)
                assert store.append_history(namespace, f"c{c}", b, records) == HistoryAppend(False)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    records, _ = read_all(store, namespace, limit=37)
    assert len(records) == clients * batches * per_batch
    assert Counter(r.client_id for r in records) == {f"c{c}": batches * per_batch for c in range(clients)}
    for c in range(clients):  # each sender's records in the order it sent them
        mine = [r.offset for r in records if r.client_id == f"c{c}"]
        assert mine == sorted(mine) and len(set(mine)) == len(mine)
    assert len({r.cursor for r in records}) == len(records)


def test_many_senders_batches_at_once_each_exactly_once_each_refused_alone(store: CountsStore, namespace: str) -> None:
    """append_history_many (the service's gathered pushes): one store call per partition, the rules of each batch."""
    store.create_namespace(namespace, FP, VOCAB)
    batches = [HistoryBatch(f"s{c}", 4, [rec([c, i], seq=c, group=f"g{c}", offset=i) for i in range(3)], FP)
               for c in range(6)]
    batches.insert(2, HistoryBatch("s-bad", 1, [rec([VOCAB])]))
    batches.insert(4, HistoryBatch("s-other", 1, [rec([1])], OTHER_FP))
    batches.append(HistoryBatch("s0", 4, batches[0].records, FP))  # the same batch twice in one call: once
    batches.append(HistoryBatch("s-empty", 1, []))
    answers = store.append_history_many(namespace, batches)
    assert isinstance(answers[2], InvalidArgumentError) and "history record 0" in str(answers[2])
    assert isinstance(answers[4], TokenizerMismatchError)
    assert [a for i, a in enumerate(answers) if i not in (2, 4)] == (
        [HistoryAppend(True, 3, 6)] * 6 + [HistoryAppend(False), HistoryAppend(True)])
    again = store.append_history_many(namespace, batches)  # a retry of every batch: nothing stored twice
    assert [a for i, a in enumerate(again) if i not in (2, 4)] == [HistoryAppend(False)] * 8
    assert store.append_history(namespace, "s-bad", 1, [rec([1])]).stored  # the refused batch took no seq
    records, _ = read_all(store, namespace)
    assert Counter(r.client_id for r in records) == {**{f"s{c}": 3 for c in range(6)}, "s-bad": 1}
    for c in range(6):
        assert [r.offset for r in records if r.client_id == f"s{c}"] == [0, 1, 2]
