"""The fleet history's tail on a replica, over a fake store: ring, filters, long poll, one poller for many readers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from ngramcache import InvalidArgumentError, NamespaceNotFoundError
from ngramcache.cache_service.counts.history import HistoryAppend, HistoryBatch, HistoryPage, HistoryRecord
from ngramcache.cache_service.counts.namespace import NamespaceRecord
from ngramcache.cache_service.history_tail import HistoryTails, TailOptions, record_bytes
from ngramcache.cache_service.metrics import Metrics
from ngramcache.cache_service.store_runner import StoreRunner

FP = b"\x07" * 32


class FakeStore:
    """An in-memory history with cursors "inc.N"; counts its reads."""

    def __init__(self) -> None:
        self.records: list[HistoryRecord] = []
        self.first = 0  # absolute number of records[0] (older ones trimmed)
        self.reads = 0
        self.exists = True
        self.skip: set[str] = set()  # groups whose records append_history skips
        self.read_groups: list[tuple[str, ...]] = []  # the groups hint of each read
        self.page_size: int | None = None  # answer at most this many and say `more` (a partitioned history's cut)
        self.append_delay = 0.0  # seconds an append takes (so pushes pile up behind it)
        self.calls: list[int] = []  # batches per store call of the push path

    def namespace_info(self, namespace: str) -> NamespaceRecord:
        if not self.exists:
            raise NamespaceNotFoundError(namespace)
        return NamespaceRecord(namespace, FP.hex(), 1000, 1, 1, "i")

    def append_history(self, namespace: str, client_id: str, batch_seq: int, records: list[HistoryRecord],
                       *, fingerprint: bytes | None = None) -> HistoryAppend:
        """Stores every record but those in `skip` (as the store skips near-duplicate prompts)."""
        time.sleep(self.append_delay)
        self.calls.append(1)
        return self._append(client_id, records)

    def append_history_many(self, namespace: str, batches: list[HistoryBatch]) -> list[HistoryAppend | Exception]:
        time.sleep(self.append_delay)
        self.calls.append(len(batches))
        return [InvalidArgumentError(f"bad batch of {b.client_id}") if b.client_id == "bad"
                else self._append(b.client_id, b.records) for b in batches]

    def _append(self, client_id: str, records: list[HistoryRecord]) -> HistoryAppend:
        kept = [r for r in records if r.group not in self.skip]
        for r in kept:
            n = self.first + len(self.records)
            self.records.append(HistoryRecord(client_id, r.seq, r.group, r.offset, r.tokens, f"inc.{n}",
                                              int(time.time() * 1000)))
        skipped = [r for r in records if r.group in self.skip]
        return HistoryAppend(True, len(kept), sum(len(r.tokens) for r in kept), len(skipped),
                             sum(len(r.tokens) for r in skipped))

    def trim(self, n: int) -> None:
        self.records = self.records[n:]
        self.first += n

    def read_history(self, namespace: str, after: str = "", limit: int = 1024, *,
                     groups: tuple[str, ...] = ()) -> HistoryPage:
        self.reads += 1
        self.read_groups.append(tuple(groups))
        if not self.exists:
            raise NamespaceNotFoundError(namespace)
        start = 0 if not after else int(after.split(".")[1]) + 1
        gap = start < self.first
        start = max(start, self.first)
        take = min(limit, self.page_size or limit)
        page = self.records[start - self.first:start - self.first + take]
        more = self.page_size is not None and start - self.first + take < len(self.records)
        return HistoryPage(page, page[-1].cursor if page else (after if not gap else f"inc.{self.first - 1}"), gap,
                           more)

    def close(self) -> None:
        pass


def rec(seq: int, *tokens: int, group: str = "") -> HistoryRecord:
    return HistoryRecord("", seq, group, 0, np.array(tokens, dtype=np.int32))


def run(body: Any) -> Any:
    return asyncio.run(body)


def tails(store: FakeStore, **options: Any) -> HistoryTails:
    return HistoryTails(StoreRunner(store), TailOptions(**{"poll_interval": 0.01, **options}))  # type: ignore[arg-type]


def test_pull_reads_the_window_then_answers_from_the_ring() -> None:
    store = FakeStore()
    store.append_history("ns", "a", 0, [rec(1, 1, 2), rec(2, 3)])

    async def body() -> None:
        h = tails(store, poll_interval=10.0)  # only the first poll and wakes read the store
        page = await h.pull("ns", FP, "", max_records=10, wait=0)
        assert [r.seq for r in page.records] == [1, 2] and page.cursor == "inc.1" and not page.gap
        await asyncio.sleep(0.05)  # the poller caught up
        reads = store.reads
        store.append_history("ns", "b", 0, [rec(3, 4)])
        h.tails["ns"].wake()
        await asyncio.sleep(0.05)
        page = await h.pull("ns", FP, "inc.1", max_records=10, wait=0)
        assert [r.seq for r in page.records] == [3] and page.records[0].client_id == "b"
        assert store.reads - reads == 1  # the woken poller's read: the pull was answered from the ring
        await h.close()

    run(body())


def test_filters_skip_records_but_move_the_cursor() -> None:
    store = FakeStore()
    store.append_history("ns", "me", 0, [rec(1, 1, group="g1")])
    store.append_history("ns", "other", 0, [rec(2, 2, group="g2"), rec(3, 3, group="g1")])

    async def body() -> None:
        h = tails(store)
        mine = await h.pull("ns", FP, "", max_records=10, wait=0, exclude_client_id="me")
        assert [r.seq for r in mine.records] == [2, 3]
        g1 = await h.pull("ns", FP, "", max_records=10, wait=0, exclude_client_id="me", groups=["g1"])
        assert [r.seq for r in g1.records] == [3] and g1.cursor == "inc.2"
        none = await h.pull("ns", FP, "", max_records=10, wait=0.05, groups=["nope"])
        assert none.records == [] and none.cursor == "inc.2"
        one = await h.pull("ns", FP, "", max_records=1, wait=0)
        assert [r.seq for r in one.records] == [1] and one.cursor == "inc.0"
        await h.close()

    run(body())


def test_a_waiting_pull_wakes_on_a_push_and_many_waiters_cost_one_poller() -> None:
    store = FakeStore()
    store.append_history("ns", "a", 0, [rec(1, 1)])

    async def body() -> None:
        # The poller's interval is far past the test's deadline: only the push's wake can make it read in time, and
        # no bound on wall-clock time is needed (a loaded machine only makes each step slower).
        h = tails(store, poll_interval=60.0, max_wait=60.0)
        first = await h.pull("ns", FP, "", max_records=10, wait=0)
        tail = h.tails["ns"]
        while tail.polls < 1:  # the poller's first read (at its start), then it waits out its interval
            await asyncio.sleep(0.01)
        reads = store.reads
        waiters = [asyncio.create_task(h.pull("ns", FP, first.cursor, max_records=10, wait=60.0)) for _ in range(500)]
        while not all(len(w.get_stack()) for w in waiters):  # every reader started and is waiting
            await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters)
        await h.push("ns", "b", 0, [rec(2, 2)], FP)
        pages = await asyncio.wait_for(asyncio.gather(*waiters), 30)  # without the wake: the 60 s interval
        assert all([r.seq for r in p.records] == [2] for p in pages)
        # 500 readers were answered by one poller read, not one read each.
        assert store.reads - reads == 1, store.reads - reads
        await h.close()

    run(body())


def test_a_wait_times_out_with_the_cursor_unchanged_and_is_capped() -> None:
    store = FakeStore()

    async def body() -> None:
        h = tails(store, max_wait=0.1)
        # Asked to wait an hour, capped at max_wait: it ends well within the test's deadline (30 s) with nothing.
        page = await asyncio.wait_for(h.pull("ns", FP, "", max_records=10, wait=3600), 30)
        assert page.records == [] and page.cursor == ""
        await h.close()

    run(body())


def test_a_cursor_older_than_the_ring_goes_to_the_store_and_reports_the_gap() -> None:
    store = FakeStore()
    store.append_history("ns", "a", 0, [rec(i, i) for i in range(10)])

    async def body() -> None:
        h = tails(store, ring_bytes=3 * (4 + 1 + 64))  # about 3 records
        await h.pull("ns", FP, "", max_records=100, wait=0)
        await asyncio.sleep(0.05)
        assert 1 <= len(h.tails["ns"].ring) <= 3
        page = await h.pull("ns", FP, "inc.2", max_records=100, wait=0)  # outside the ring: the store answers
        assert [r.seq for r in page.records] == list(range(3, 10)) and not page.gap
        store.trim(5)
        page = await h.pull("ns", FP, "inc.1", max_records=100, wait=0)
        assert page.gap and [r.seq for r in page.records] == list(range(5, 10))
        await h.close()

    run(body())


def test_an_idle_namespace_stops_polling_and_a_dropped_one_is_forgotten() -> None:
    store = FakeStore()

    async def body() -> None:
        h = tails(store, idle_after=0.1)
        await h.pull("ns", FP, "", max_records=10, wait=0)
        await asyncio.sleep(0.3)
        reads = store.reads
        await asyncio.sleep(0.2)
        assert store.reads == reads  # idle: no store call
        store.exists = False
        h.tails["ns"].info = None
        with pytest.raises(NamespaceNotFoundError):
            await h.pull("ns", FP, "", max_records=10, wait=0)
        assert "ns" not in h.tails
        await h.close()

    run(body())


def test_push_metrics_count_what_the_store_stored_and_skipped_apart() -> None:
    """ngramcache_history_pushed_* counts the records the store kept (its help: near-duplicate prompts excluded);
    the near-duplicates it skipped are ngramcache_history_skipped_*: the two add up to what PushHistory took."""
    store = FakeStore()
    store.skip = {"dup"}
    metrics = Metrics()

    async def body() -> None:
        h = HistoryTails(StoreRunner(store), TailOptions(poll_interval=0.01), metrics)  # type: ignore[arg-type]
        done = await h.push("ns", "a", 0, [rec(1, 1, 2, 3), rec(2, 4, 5, group="dup")], FP)
        assert done == HistoryAppend(True, 1, 3, 1, 2)
        await h.close()

    run(body())
    value = metrics.registry.get_sample_value
    assert value("ngramcache_history_pushed_records_total") == 1
    assert value("ngramcache_history_pushed_bytes_total") == 12
    assert value("ngramcache_history_skipped_records_total") == 1
    assert value("ngramcache_history_skipped_bytes_total") == 8
    assert value("ngramcache_history_duplicate_pushes_total") == 0


def test_a_group_pull_outside_the_ring_asks_the_store_for_its_groups_only() -> None:
    """A partitioned store then reads only the groups' partitions; the poller (the ring) always reads them all."""
    store = FakeStore()
    store.append_history("ns", "a", 0, [rec(i, i, group=f"g{i % 3}") for i in range(6)])

    async def body() -> None:
        h = tails(store)
        await h.pull("ns", FP, "", max_records=100, wait=0)
        page = await h.pull("ns", FP, "inc.-1", max_records=100, wait=0, groups=["g1"])  # no record has that cursor
        assert [r.seq for r in page.records] == [1, 4]
        await h.close()

    run(body())
    assert ("g1",) in store.read_groups
    assert all(groups in ((), ("g1",)) for groups in store.read_groups)
    assert store.read_groups.count(("g1",)) == 1


def test_the_poller_reads_on_at_once_while_the_store_says_more() -> None:
    """A partitioned store may answer a page short of the limit (each partition's share) with more=True: the poller
    reads on without waiting its interval, so the ring catches up in one go."""
    store = FakeStore()
    store.page_size = 2
    store.append_history("ns", "a", 0, [rec(i, i) for i in range(10)])

    async def body() -> None:
        h = tails(store, poll_interval=60.0)
        await h.pull("ns", FP, "", max_records=100, wait=0)
        tail = h.tails["ns"]
        for _ in range(200):
            if len(tail.ring) == 10:
                break
            await asyncio.sleep(0.01)
        assert [r.seq for r in tail.ring] == list(range(10))  # five pages, no 60 s wait between them
        await h.close()

    run(body())


def test_concurrent_pushes_wait_for_the_call_in_flight_and_go_together() -> None:
    """While one store call is in flight the pushes that arrive gather into the next (one append_history_many: one
    script call per partition on Redis); each push still gets its own answer, a refused batch its own error."""
    store = FakeStore()
    store.append_delay = 0.2

    async def body() -> list[Any]:
        h = tails(store)
        first = asyncio.ensure_future(h.push("ns", "c0", 1, [rec(0, 0)], FP))
        await asyncio.sleep(0.05)  # the first call is in flight
        rest = [h.push("ns", f"c{c}", 1, [rec(c, c, c)], FP) for c in range(1, 10)]
        answers = await asyncio.gather(first, *rest, h.push("ns", "bad", 1, [rec(99, 1)], FP), return_exceptions=True)
        await h.close()
        return answers

    answers = run(body())
    assert answers[:10] == [HistoryAppend(True, 1, 1)] + [HistoryAppend(True, 1, 2)] * 9
    assert isinstance(answers[10], InvalidArgumentError) and "bad batch of bad" in str(answers[10])
    assert store.calls == [1, 10]  # the lone first push at once, the other ten in one call
    assert sorted(r.client_id for r in store.records) == sorted(f"c{c}" for c in range(10))


def test_a_partitioned_historys_long_cursor_counts_against_the_ring() -> None:
    """A cursor with a position per partition (~200 bytes at 12) is memory the ring holds per record."""
    short = HistoryRecord("c", 1, "g", 0, np.zeros(4, dtype=np.int32), "inc.1796427272615-0")
    long = HistoryRecord("c", 1, "g", 0, np.zeros(4, dtype=np.int32), "inc." + "_".join(["1796427272615-0"] * 12))
    assert record_bytes(short) == 16 + 1 + 1 + 64
    assert record_bytes(long) == record_bytes(short) + len(long.cursor) - 32
