"""PushBatcher: pushes that arrive while a group is in the store go together, each with its own result; a failed group acknowledges nothing; overload is shed, never applied late."""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.counts import FP, OTHER_FP, VOCAB, apply, as_counter, batch, exported, random_batch, row

from ngramcache.cache_service.counts import EmbeddedCountsStore
from ngramcache.cache_service.counts.config import CountsStoreConfig
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem, ItemOutcome
from ngramcache.cache_service.push_admission import PushAdmission
from ngramcache.cache_service.push_batcher import PushBatcher
from ngramcache.cache_service.status import status_of
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    BatchTooOldError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    OverloadedError,
    TokenizerMismatchError,
)

NS = "ns"


class GatedStore:
    """Wraps a store's apply_group: records each call's items, can hold a call until released or fail it."""

    def __init__(self, store: EmbeddedCountsStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[GroupItem]] = []
        self.hold = False  # the next calls wait for `release`
        self.entered = threading.Event()
        self.release = threading.Event()
        self.failures: dict[int, BaseException] = {}  # call number (from 0) -> raised before anything is applied
        apply_group = store.apply_group

        def gated(namespace: str, items: Sequence[GroupItem]) -> list[ItemOutcome]:
            number = len(self.calls)
            self.calls.append(list(items))
            self.entered.set()
            if self.hold:
                assert self.release.wait(10)
            if number in self.failures:
                raise self.failures[number]
            return apply_group(namespace, items)

        monkeypatch.setattr(store, "apply_group", gated)

    def clients(self) -> list[list[str]]:
        return [[f"{item.client_id}:{item.seq}" for item in call] for call in self.calls]


@pytest.fixture
def store() -> Iterator[EmbeddedCountsStore]:
    s = EmbeddedCountsStore(CountsStoreConfig(url=None, dedup_window=8, max_batch_rows=1000))
    s.create_namespace(NS, FP, VOCAB)
    yield s
    s.close()


@pytest.fixture
def gate(store: EmbeddedCountsStore, monkeypatch: pytest.MonkeyPatch) -> GatedStore:
    return GatedStore(store, monkeypatch)


def run(store: EmbeddedCountsStore, test: Callable[[PushBatcher], Awaitable[None]], **options: Any) -> PushBatcher:
    """Run ``test(batcher)`` on a fresh event loop with a batcher over ``store``."""
    runner = StoreRunner(store, max_workers=4)
    batcher = PushBatcher(runner, **{"groups_in_flight": 1, **options})

    async def main() -> None:
        await test(batcher)
        await batcher.close()

    try:
        asyncio.run(main())
    finally:
        runner._pool.shutdown(wait=True)  # the store is closed by its fixture
    assert not batcher._lanes, "a namespace's queue outlived its pushes"
    return batcher


async def hold_the_store(batcher: PushBatcher, gate: GatedStore, item: GroupItem) -> asyncio.Task[ApplyResult]:
    """Push ``item`` and wait until its group is inside the (held) store call."""
    gate.hold = True
    task = asyncio.create_task(batcher.push(NS, item))
    while not gate.entered.is_set():
        await asyncio.sleep(0.001)
    return task


async def queue(batcher: PushBatcher, items: list[GroupItem], namespace: str = NS) -> list[asyncio.Task[ApplyResult]]:
    tasks = [asyncio.create_task(batcher.push(namespace, item)) for item in items]
    await asyncio.sleep(0.01)  # they are all waiting now
    return tasks


def batches(seed: int, k: int, m: int = 100) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [random_batch(rng, m, hot=12) for _ in range(k)]


def test_a_lone_push_goes_straight_through(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    deltas = batches(1, 1)[0]

    async def test(batcher: PushBatcher) -> None:
        # No window (the default, 0): nothing holds a lone push. A deadline far past a loaded machine's pauses; a push
        # held for company would never end (no other push comes).
        result = await asyncio.wait_for(batcher.push(NS, GroupItem("a", 1, deltas, FP)), 30)
        assert result.applied == result.units == 1

    batcher = run(store, test)
    assert gate.clients() == [["a:1"]] and (batcher.groups, batcher.pushes) == (1, 1)
    assert exported(store, NS) == as_counter(deltas)


def test_pushes_arriving_while_a_group_is_in_the_store_go_together(store: EmbeddedCountsStore,
                                                                   gate: GatedStore) -> None:
    data = batches(2, 5)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0]))
        rest = await queue(batcher, [GroupItem(f"c{i}", 1, data[i], FP) for i in range(1, 5)])
        assert gate.clients() == [["a:1"]]  # the others wait for the store
        gate.hold = False
        gate.release.set()
        results = [await t for t in [first, *rest]]
        for result in results:
            assert result.applied == result.units == 1 and not result.duplicate
        assert [r.entries for r in results] == [len(as_counter(d)) for d in data]

    run(store, test)
    assert gate.clients() == [["a:1"], ["c1:1", "c2:1", "c3:1", "c4:1"]]
    expected: Counter[tuple[int, ...]] = Counter()
    for d in data:
        expected.update(as_counter(d))
    assert exported(store, NS) == expected


def test_each_push_of_a_group_gets_its_own_result(store: EmbeddedCountsStore, monkeypatch: pytest.MonkeyPatch) -> None:
    good = batches(3, 4)
    apply(store, NS, "old", 20, good[0])
    apply(store, NS, "retry", 1, good[1])
    gate = GatedStore(store, monkeypatch)  # from here on: the two batches above are not the gate's calls
    with_bad_row = np.concatenate([good[2], batch([[1, 1, -1, -1, -1, VOCAB, 1]])])

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, good[0]))
        tasks = await queue(batcher, [
            GroupItem("new", 1, good[2], FP),
            GroupItem("retry", 1, good[1], FP),  # applied before: a duplicate
            GroupItem("bad-row", 1, with_bad_row, FP),
            GroupItem("other-tokenizer", 1, good[2], OTHER_FP),
            GroupItem("old", 3, good[0], FP),  # 3 <= 20 - 8: too old
            GroupItem("has space", 1, good[2], FP),
            GroupItem("twice", 4, good[3], FP),
            GroupItem("twice", 4, good[3], FP),  # the same batch sent again before the first was answered
            GroupItem("empty", 1, batch([]), FP),
        ])
        gate.hold = False
        gate.release.set()
        await first
        outcomes: list[object] = []
        for t in tasks:
            try:
                outcomes.append(await t)
            except Exception as exc:
                outcomes.append(exc)
        new, retry, bad, other, old, space, twice, twice_again, empty = outcomes
        assert isinstance(new, ApplyResult) and new.applied == 1
        assert isinstance(retry, ApplyResult) and retry.duplicate
        assert isinstance(bad, InvalidArgumentError) and "row 100" in str(bad)
        assert isinstance(other, TokenizerMismatchError)
        assert isinstance(old, BatchTooOldError)
        assert isinstance(space, InvalidArgumentError)
        assert isinstance(twice, ApplyResult) and twice.applied == 1
        assert isinstance(twice_again, ApplyResult) and twice_again.duplicate
        assert empty == ApplyResult(0, 0, 0, 0)
        assert status_of(bad).code == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(other).code == grpc.StatusCode.FAILED_PRECONDITION

    run(store, test)
    assert len(gate.calls) == 2 and len(gate.calls[1]) == 9  # the bad ones did not break the group
    expected = as_counter(good[0]) + as_counter(good[0]) + as_counter(good[1]) + as_counter(good[2]) + as_counter(good[3])
    assert exported(store, NS) == expected
    assert not apply(store, NS, "bad-row", 1, good[2]).duplicate  # nothing of a refused push was recorded


def test_a_store_error_fails_every_push_of_its_group_and_acknowledges_none(store: EmbeddedCountsStore,
                                                                           gate: GatedStore) -> None:
    data = batches(4, 4)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0]))
        items = [GroupItem(f"c{i}", 1, data[i], FP) for i in range(1, 4)]
        tasks = await queue(batcher, items)
        gate.failures[1] = BackendUnavailableError("redis is down")
        gate.hold = False
        gate.release.set()
        await first
        for t in tasks:
            with pytest.raises(BackendUnavailableError) as caught:
                await t
            assert status_of(caught.value).code == grpc.StatusCode.UNAVAILABLE
        assert exported(store, NS) == as_counter(data[0])  # none of them applied
        # What their senders do: push the same batches again; they count once.
        again = await asyncio.gather(*(batcher.push(NS, item) for item in [*items, GroupItem("a", 1, data[0])]))
        assert [r.duplicate for r in again] == [False, False, False, True]

    run(store, test)
    expected: Counter[tuple[int, ...]] = Counter()
    for d in data:
        expected.update(as_counter(d))
    assert exported(store, NS) == expected


def test_a_namespace_error_fails_only_that_namespaces_pushes(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    store.create_namespace("other", FP, VOCAB)
    data = batches(5, 3)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0]))
        missing = await queue(batcher, [GroupItem("m", 1, data[1]), GroupItem("m", 2, data[1])], "missing")
        other = await queue(batcher, [GroupItem("o", 1, data[2])], "other")
        gate.hold = False
        gate.release.set()
        await first
        for t in missing:
            with pytest.raises(NamespaceNotFoundError):
                await t
        assert (await other[0]).applied == 1

    run(store, test)
    assert sorted(len(c) for c in gate.calls) == [1, 1, 2]  # one group per namespace
    assert exported(store, "other") == as_counter(data[2])


def test_a_group_holds_at_most_max_group_rows(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(6, 6)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 0, data[0]))
        tasks = await queue(batcher, [GroupItem("a", i, data[i]) for i in range(1, 6)])
        gate.hold = False
        gate.release.set()
        for t in [first, *tasks]:
            assert (await t).applied == 1

    run(store, test, max_group_rows=250)
    assert gate.clients() == [["a:0"], ["a:1", "a:2"], ["a:3", "a:4"], ["a:5"]]


def test_a_window_gathers_pushes_that_arrive_within_it(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(7, 4)

    async def test(batcher: PushBatcher) -> None:
        first = asyncio.create_task(batcher.push(NS, GroupItem("a", 1, data[0])))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(batcher.push(NS, GroupItem("b", 1, data[1])))
        await asyncio.gather(first, second)

    run(store, test, window=0.3)
    assert gate.clients() == [["a:1", "b:1"]]


def test_a_full_group_does_not_wait_for_its_window(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(8, 2)

    async def test(batcher: PushBatcher) -> None:
        # The window (30 s) would hold the group past this deadline (20 s); the full group goes at once.
        await asyncio.wait_for(asyncio.gather(batcher.push(NS, GroupItem("a", 1, data[0])),
                                              batcher.push(NS, GroupItem("b", 1, data[1]))), 20)

    run(store, test, window=30.0, max_group_rows=200)
    assert gate.clients() == [["a:1", "b:1"]]


def test_a_push_cancelled_before_its_group_formed_is_left_out(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(9, 3)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0]))
        kept, dropped = await queue(batcher, [GroupItem("b", 1, data[1]), GroupItem("c", 1, data[2])])
        dropped.cancel()
        await asyncio.sleep(0.01)
        gate.hold = False
        gate.release.set()
        await first
        assert (await kept).applied == 1
        with pytest.raises(asyncio.CancelledError):
            await dropped

    run(store, test)
    assert gate.clients() == [["a:1"], ["b:1"]]
    assert exported(store, NS) == as_counter(data[0]) + as_counter(data[1])


def test_two_groups_in_flight_and_the_rest_waits(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(10, 4)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0]))
        second = asyncio.create_task(batcher.push(NS, GroupItem("b", 1, data[1])))  # the second slot
        while len(gate.calls) < 2:
            await asyncio.sleep(0.001)
        rest = await queue(batcher, [GroupItem("c", 1, data[2]), GroupItem("d", 1, data[3])])
        assert len(gate.calls) == 2  # both slots busy: they wait
        gate.hold = False
        gate.release.set()
        for t in [first, second, *rest]:
            assert (await t).applied == 1

    run(store, test, groups_in_flight=2)
    assert sorted(gate.clients()) == [["a:1"], ["b:1"], ["c:1", "d:1"]]


def test_bad_settings_are_refused(store: EmbeddedCountsStore) -> None:
    runner = StoreRunner(store, max_workers=1)
    for options in ({"window": -1.0}, {"window": float("nan")}, {"max_group_rows": 0}, {"groups_in_flight": 0}):
        with pytest.raises(ValueError):
            PushBatcher(runner, **options)
    runner._pool.shutdown()


def test_a_pushed_batch_is_visible_to_lookups(store: EmbeddedCountsStore) -> None:
    """A push through the batcher is what `apply` does: lookups see it."""
    async def test(batcher: PushBatcher) -> None:
        await batcher.push(NS, GroupItem("a", 1, batch([row([5, 6], 7, 3)]), FP))

    run(store, test)
    assert store.lookup(NS, [5, 6]) == {7: 3}


def test_a_push_reads_no_version(store: EmbeddedCountsStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """PushResponse.version is deprecated (always 0): a group is one store call, `apply_group`, and nothing else."""
    def no_version(namespace: str) -> int:
        raise AssertionError("a push read the namespace's version")

    monkeypatch.setattr(store, "version", no_version)
    answers: list[ApplyResult] = []

    async def test(batcher: PushBatcher) -> None:
        for seq, deltas in enumerate(batches(5, 3)):
            answers.append(await batcher.push(NS, GroupItem("a", seq, deltas, FP)))

    assert run(store, test).groups == 3 and all(r.applied == 1 for r in answers)


# Shedding: a bounded queue per namespace, and no push applied after its caller's deadline.


def test_a_full_queue_sheds_the_push_at_once_with_a_retry_after(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(11, 4)

    async def test(batcher: PushBatcher) -> None:
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0], FP))
        kept = await queue(batcher, [GroupItem("b", 1, data[1], FP), GroupItem("c", 1, data[2], FP)])
        with pytest.raises(OverloadedError) as shed:  # 200 rows wait; 100 more is over 250
            await batcher.push(NS, GroupItem("d", 1, data[3], FP))
        assert shed.value.retriable and shed.value.retry_after is not None and shed.value.retry_after > 0
        status = status_of(shed.value)
        assert (status.code, status.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
        assert dict(status.trailing_metadata())["ngc-retry-after-ms"] == str(math.ceil(shed.value.retry_after * 1000))
        assert "overloaded" in str(shed.value) and "nothing was applied" in str(shed.value)
        gate.hold = False
        gate.release.set()
        for t in [first, *kept]:
            assert (await t).applied == 1
        # Its sender sends the same batch again once the queue has room: it counts once.
        assert (await batcher.push(NS, GroupItem("d", 1, data[3], FP))).applied == 1

    batcher = run(store, test, max_queue_rows=250)
    assert batcher.shed == {"queue_full": 1}
    assert gate.clients() == [["a:1"], ["b:1", "c:1"], ["d:1"]]  # the shed push was never in a group
    assert exported(store, NS) == sum((as_counter(d) for d in data), Counter())


def test_a_push_into_an_empty_queue_is_never_shed_however_big(store: EmbeddedCountsStore, gate: GatedStore) -> None:
    deltas = batches(12, 1, m=500)[0]

    async def test(batcher: PushBatcher) -> None:
        assert (await batcher.push(NS, GroupItem("a", 1, deltas, FP), timeout=30.0)).applied == 1

    assert run(store, test, max_queue_rows=10).shed == {}


def test_a_push_that_cannot_reach_the_store_before_its_deadline_is_shed_on_arrival(
        store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(13, 3)

    async def test(batcher: PushBatcher) -> None:
        batcher.admission.throughput.observe(1000, 1.0)  # the store takes 1000 rows/s
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0], FP))
        with pytest.raises(OverloadedError) as shed:  # 200 rows ahead of its end: 0.2 s > 0.05 s
            await batcher.push(NS, GroupItem("b", 1, data[1], FP), timeout=0.05)
        assert 0.1 <= shed.value.retry_after <= 0.2  # the 100 rows in the store, at 1000 rows/s (some learnt)
        with pytest.raises(OverloadedError):  # a deadline already past
            await batcher.push(NS, GroupItem("c", 1, data[2], FP), timeout=0.0)
        late = asyncio.create_task(batcher.push(NS, GroupItem("c", 1, data[2], FP), timeout=5.0))  # time enough
        await asyncio.sleep(0.01)
        gate.hold = False
        gate.release.set()
        await first
        assert (await late).applied == 1

    batcher = run(store, test)
    assert batcher.shed == {"deadline": 2}
    assert gate.clients() == [["a:1"], ["c:1"]]
    assert exported(store, NS) == as_counter(data[0]) + as_counter(data[2])


def test_a_group_leaves_out_the_pushes_whose_deadline_its_store_call_would_pass(
        store: EmbeddedCountsStore, gate: GatedStore) -> None:
    data = batches(14, 3)

    async def test(batcher: PushBatcher) -> None:
        batcher.admission.throughput.observe(1000, 1.0)
        first = await hold_the_store(batcher, gate, GroupItem("a", 1, data[0], FP))
        oldest, = await queue(batcher, [GroupItem("b", 1, data[1], FP)])
        # A deadline it can meet on arrival (300 rows ahead of its end: 0.3 s < 0.6 s)...
        hurried = asyncio.create_task(batcher.push(NS, GroupItem("c", 1, data[2], FP), timeout=0.6))
        await asyncio.sleep(0.5)  # ...but the store took its time: 0.1 s left, the group needs ~0.3 s
        gate.hold = False
        gate.release.set()
        await first
        assert (await oldest).applied == 1  # the oldest of a group always goes (the estimate keeps learning)
        with pytest.raises(OverloadedError):
            await hurried

    batcher = run(store, test)
    assert batcher.shed == {"deadline": 1}
    assert gate.clients() == [["a:1"], ["b:1"]]  # c never reached the store
    assert exported(store, NS) == as_counter(data[0]) + as_counter(data[1])


def test_store_throughput_and_retry_after() -> None:
    admission = PushAdmission(100, min_retry_after=0.02, max_retry_after=5.0)
    assert admission.throughput.rows_per_second is None and admission.retry_after(10**9) == 0.1
    admission.throughput.observe(10_000, 1.0)
    admission.throughput.observe(0, 5.0)  # says nothing
    assert admission.throughput.rows_per_second == pytest.approx(10_000)
    assert admission.retry_after(5_000) == pytest.approx(0.5)
    assert admission.retry_after(1) == 0.02 and admission.retry_after(10**9) == 5.0
    assert admission.refuse_on_arrival(10**6, 0, 0, 0.001) is None  # nothing ahead: it goes
    assert admission.refuse_on_arrival(50, 60, 0, None) == "queue_full"
    assert admission.refuse_on_arrival(40, 60, 0, None) is None
    assert admission.refuse_on_arrival(40, 60, 5_000, 0.4) == "deadline"
    assert not admission.too_late(10**6, 0.001, first=True) and admission.too_late(10**6, 0.0, first=True)
    assert admission.too_late(10_000, 1.4, first=False) and not admission.too_late(10_000, 1.6, first=False)
    with pytest.raises(ValueError):
        PushAdmission(0)
