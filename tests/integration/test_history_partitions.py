"""A namespace's fleet history in partitions: spread over a real 3-master Redis Cluster, exactly once over retries, composite and older cursors, group-first reads, budgets per partition, the service's tail over them."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers.counts import FP, VOCAB

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.history import (
    CLUSTER_HISTORY_PARTITIONS,
    HistoryAppend,
    HistoryRecord,
    parse_cursor,
    partition_of,
)
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.history_tail import HistoryTails, TailOptions
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client.kernel.errors import InvalidArgumentError

pytestmark = pytest.mark.integration

OPTIONS: dict[str, Any] = {"epoch_seconds": 0, "default_buckets": 256, "socket_timeout": 10}


def rec(tokens: list[int], *, seq: int = 1, group: str = "", offset: int = 1) -> HistoryRecord:
    return HistoryRecord("", seq, group, offset, np.asarray(tokens, dtype=np.int32))


@pytest.fixture(params=["standalone-3", "cluster"])
def layout(request: pytest.FixtureRequest) -> tuple[str, int]:
    """(url, partitions): 3 partitions on one standalone Redis (configured), the default 12 on the Cluster."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url, CLUSTER_HISTORY_PARTITIONS
    return request.getfixturevalue("redis_standalone").url, 3


@pytest.fixture
def make(layout: tuple[str, int]) -> Iterator[Callable[..., CountsStore]]:
    url, partitions = layout
    opened: list[CountsStore] = []

    def make(**options: Any) -> CountsStore:
        extra = {} if url.startswith("redis+cluster") else {"history_partitions": partitions}
        store = open_counts_store(url, **{**OPTIONS, **extra, **options})
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def ns(make: Callable[..., CountsStore]) -> Iterator[str]:
    name = "t-" + uuid.uuid4().hex[:12]
    yield name
    make().drop_namespace(name)


def read_all(store: CountsStore, namespace: str, after: str = "", limit: int = 1024,
             groups: tuple[str, ...] = ()) -> tuple[list[HistoryRecord], str]:
    out: list[HistoryRecord] = []
    while True:
        page = store.read_history(namespace, after, limit, groups=groups)
        out += page.records
        after = page.cursor
        if not page.records:
            return out, after


def key(r: HistoryRecord) -> tuple[str, int, str, int, tuple[int, ...]]:
    return (r.client_id, r.seq, r.group, r.offset, tuple(r.tokens.tolist()))


def test_one_namespace_spreads_over_the_three_masters(redis_cluster: Any) -> None:
    store = open_counts_store(redis_cluster.url, **OPTIONS)
    name = "t-" + uuid.uuid4().hex[:12]
    try:
        info = store.create_namespace(name, FP, VOCAB)
        assert info.history_partitions == CLUSTER_HISTORY_PARTITIONS
        for b in range(300):  # 300 sequences: half in groups of 2 siblings, half without a group
            records = [rec([b, i], seq=b, group=f"g{b // 2}" if b % 2 else "", offset=2 * i) for i in range(2)]
            assert store.append_history(name, f"c{b}", 1, records) == HistoryAppend(True, 2, 4)
        handle = store._handle(name)  # type: ignore[attr-defined]
        client = store._conn.client  # type: ignore[attr-defined]
        per_master: Counter[str] = Counter()
        partitions_per_master: Counter[str] = Counter()
        for keys in handle.history:
            node = client.get_node_from_key(keys.stream).name
            per_master[node] += client.xlen(keys.stream)
            partitions_per_master[node] += 1
        assert len(per_master) == 3 and sum(per_master.values()) == 600
        assert sorted(partitions_per_master.values()) == [4, 4, 4]  # each master one third of the slots' slices
        mean = 600 / 3
        assert all(abs(n - mean) <= 0.2 * mean for n in per_master.values()), per_master
    finally:
        store.drop_namespace(name)
        store.close()


def test_a_batch_over_partitions_is_stored_once_whatever_retries(make: Callable[..., CountsStore], ns: str,
                                                                  layout: tuple[str, int]) -> None:
    store = make()
    partitions = store.create_namespace(ns, FP, VOCAB).history_partitions
    assert partitions == layout[1]
    batch = [rec([g, 1], seq=g, group=f"grp{g}") for g in range(16)]
    spots = {partition_of(r, partitions) for r in batch}
    assert len(spots) >= 2
    # A first try that stored only one partition's part before failing (what a store call that died after one
    # node answered leaves behind): the retry of the whole batch stores the other parts, and only them.
    first = min(spots)
    part = [r for r in batch if partition_of(r, partitions) == first]
    assert store.append_history(ns, "c", 7, part) == HistoryAppend(True, len(part), 2 * len(part))
    retried = store.append_history(ns, "c", 7, batch)
    assert retried == HistoryAppend(True, 16 - len(part), 2 * (16 - len(part)))
    assert store.append_history(ns, "c", 7, batch) == HistoryAppend(False)  # every part stored: a duplicate
    assert store.append_history(ns, "c", 3, batch) == HistoryAppend(False)  # below the highest in every partition
    assert store.append_history(ns, "c", 8, []) == HistoryAppend(True)
    assert store.append_history(ns, "c", 8, []) == HistoryAppend(False)
    records, _ = read_all(store, ns)
    assert sorted(key(r) for r in records) == sorted(key(HistoryRecord("c", r.seq, r.group, r.offset, r.tokens))
                                                     for r in batch)
    assert store.history_stats(ns) == {"records": 16, "tokens": 32, "bytes": 128}


def test_cursors_span_every_partition_and_resume_in_each(make: Callable[..., CountsStore], ns: str) -> None:
    store = make()
    partitions = store.create_namespace(ns, FP, VOCAB).history_partitions
    for b in range(1, 13):
        store.append_history(ns, f"c{b}", 1, [rec([b, i], seq=b, offset=i) for i in range(5)])
    everything = store.read_history(ns, "", 65536)
    assert len(everything.records) == 60 and not everything.more
    cursor = parse_cursor(everything.cursor)
    assert cursor is not None and len(cursor.positions) == partitions
    for limit in (1, 7, 50):  # pages of any size: every record once, each sequence in order
        paged, last = read_all(store, ns, limit=limit)
        assert [key(r) for r in paged] == [key(r) for r in everything.records]
        assert last == everything.cursor
    for b in range(1, 13):
        assert [r.offset for r in everything.records if r.seq == b] == list(range(5))
    store.append_history(ns, "c1", 2, [rec([99], seq=1, offset=5)])
    store.append_history(ns, "c2", 2, [rec([98], seq=2, offset=5)])
    page = store.read_history(ns, everything.cursor)
    assert sorted(r.tokens.tolist() for r in page.records) == [[98], [99]] and not page.gap
    with pytest.raises(InvalidArgumentError, match="partitions"):
        store.read_history(ns, everything.cursor.rsplit("_", 1)[0])  # a position short


def test_an_older_single_position_cursor_names_partition_0(make: Callable[..., CountsStore], ns: str) -> None:
    store = make()
    info = store.create_namespace(ns, FP, VOCAB)
    batch = [rec([g], seq=g, group=f"grp{g}") for g in range(40)]
    store.append_history(ns, "c", 1, batch)
    zero = [r for r in batch if partition_of(r, info.history_partitions) == 0]
    assert len(zero) >= 2
    stream = store._handle(ns).history[0].stream  # type: ignore[attr-defined]
    assert stream.endswith(f":{{{ns}}}:hist")  # partition 0 is where the one stream always was
    ids = [entry[0].decode() for entry in store._conn.client.xrange(stream)]  # type: ignore[attr-defined]
    old = f"{info.instance}.{ids[0]}"  # what a replica from before partitions handed out
    page = store.read_history(ns, old, 65536)
    assert not page.gap
    # Partition 0 after its first record, every other partition from its oldest.
    assert sorted(r.seq for r in page.records) == sorted(r.seq for r in batch if r is not zero[0])
    assert store.read_history(ns, page.cursor).records == []


def test_a_namespace_from_before_partitions_reads_as_one(make: Callable[..., CountsStore], ns: str) -> None:
    store = make(history_partitions=1)
    info = store.create_namespace(ns, FP, VOCAB)
    client = store._conn.client  # type: ignore[attr-defined]
    meta = store._handle(ns).meta  # type: ignore[attr-defined]
    client.hdel(meta, "history_partitions")  # the record an older version wrote
    fresh = make()  # a replica that would make new namespaces partitioned
    assert fresh.namespace_info(ns).history_partitions == 1 and info.history_partitions == 1
    fresh.append_history(ns, "c", 1, [rec([g], seq=g, group=f"grp{g}") for g in range(10)])
    page = fresh.read_history(ns)
    assert [r.seq for r in page.records] == list(range(10))
    assert parse_cursor(page.cursor).positions == ()  # type: ignore[union-attr]


def test_the_partition_count_is_the_namespaces_not_the_replicas(make: Callable[..., CountsStore], ns: str,
                                                                 layout: tuple[str, int]) -> None:
    make().create_namespace(ns, FP, VOCAB)
    other = make(history_partitions=5)
    assert other.namespace_info(ns).history_partitions == layout[1]
    other.append_history(ns, "c", 1, [rec([1], seq=1)])
    assert len(make().read_history(ns).records) == 1


def test_group_first_reads_touch_only_the_groups_partition(make: Callable[..., CountsStore], ns: str) -> None:
    store = make()
    partitions = store.create_namespace(ns, FP, VOCAB).history_partitions
    batch = [rec([g, s], seq=10 * g + s, group=f"grp{g}") for g in range(12) for s in range(2)]
    store.append_history(ns, "c", 1, batch)
    target = batch[0]
    home = partition_of(target, partitions)
    records, cursor = read_all(store, ns, groups=(target.group,))
    assert {partition_of(r, partitions) for r in records} == {home}
    assert sorted(r.seq for r in records) == sorted(r.seq for r in batch if partition_of(r, partitions) == home)
    positions = parse_cursor(cursor).positions  # type: ignore[union-attr]
    assert [i for i, text in enumerate(positions) if text] == [home]  # the cursor moved in that partition alone
    rest, _ = read_all(store, ns, after=cursor)  # the tail from there reads every other partition whole
    assert sorted(r.seq for r in rest) == sorted(r.seq for r in batch if partition_of(r, partitions) != home)


def test_each_partition_keeps_its_share_of_the_byte_budget(make: Callable[..., CountsStore], ns: str,
                                                           layout: tuple[str, int]) -> None:
    partitions = layout[1]
    store = make(history_max_bytes=4 * 10 * partitions)  # 10 tokens a partition
    store.create_namespace(ns, FP, VOCAB)
    store.append_history(ns, "a", 1, [rec([1, 2, 3, 4], seq=0, group="hot")])
    start = store.read_history(ns).cursor
    for b in range(2, 8):  # one group: one partition over its share
        store.append_history(ns, "a", b, [rec([b] * 4, seq=b, group="hot")])
    store.append_history(ns, "b", 1, [rec([7, 7], seq=1, group="cold")])
    kept = store.read_history(ns)
    hot = [r.seq for r in kept.records if r.group == "hot"]
    assert hot == [6, 7]  # 8 tokens of 10: the oldest went
    assert [r.group for r in kept.records].count("cold") == 1  # partition_of("cold") differs, or shares the 10
    behind = store.read_history(ns, start)
    assert behind.gap and [r.seq for r in behind.records if r.group == "hot"] == [6, 7]
    assert not store.read_history(ns, behind.cursor).gap  # reported once


def test_drop_removes_every_partition(make: Callable[..., CountsStore], ns: str) -> None:
    store = make()
    store.create_namespace(ns, FP, VOCAB)
    store.append_history(ns, "c", 1, [rec([g], seq=g, group=f"grp{g}") for g in range(30)])
    handle = store._handle(ns)  # type: ignore[attr-defined]
    client = store._conn.client  # type: ignore[attr-defined]
    assert sum(client.exists(keys.stream) for keys in handle.history) >= 2
    assert store.drop_namespace(ns)
    assert sum(client.exists(*keys.all(), keys.guard) for keys in handle.history) == 0
    store.create_namespace(ns, FP, VOCAB)
    assert store.read_history(ns).records == [] and store.history_stats(ns)["records"] == 0


def test_the_service_tail_reads_every_partition(make: Callable[..., CountsStore], ns: str) -> None:
    """The replica's tail (what PullHistory answers from): a pull from "" gets every partition's records, a later
    pull what is new in any of them, a group-first pull outside the ring only the group's partition."""
    store = make()
    partitions = store.create_namespace(ns, FP, VOCAB).history_partitions

    async def body() -> None:
        tails = HistoryTails(StoreRunner(store), TailOptions(poll_interval=0.01))
        try:
            for c in range(6):
                await tails.push(ns, f"c{c}", 1, [rec([c, i], seq=c, group=f"grp{c}", offset=i) for i in range(3)],
                                 FP)
            got: list[HistoryRecord] = []
            cursor = ""
            while len(got) < 18:
                page = await tails.pull(ns, FP, cursor, max_records=5, wait=1.0)
                assert page.records, "the tail stopped short of what the partitions hold"
                got += page.records
                cursor = page.cursor
            assert sorted((r.client_id, r.offset) for r in got) == [(f"c{c}", i) for c in range(6) for i in range(3)]
            await tails.push(ns, "c9", 1, [rec([9], seq=9, group="late")], FP)
            late = await tails.pull(ns, FP, cursor, max_records=5, wait=2.0)
            assert [r.client_id for r in late.records] == ["c9"]
            unread = f"{store.namespace_info(ns).instance}." + "_" * (partitions - 1)  # every partition from its oldest
            mine = await tails.pull(ns, FP, unread, max_records=100, wait=0, groups=["grp2"])
            assert [r.group for r in mine.records] == ["grp2"] * 3
            home = partition_of(rec([0], group="grp2"), partitions)
            moved = [i for i, text in enumerate(parse_cursor(mine.cursor).positions) if text]  # type: ignore[union-attr]
            assert moved == [home]
        finally:
            await tails.close()

    asyncio.run(body())
