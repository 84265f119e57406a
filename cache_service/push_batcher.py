"""PushBatcher: group commit of concurrent Push batches, one `CountsStore.apply_group` call for many pushes.

A Push waits in its namespace's queue. When the store is free for that namespace (fewer
than ``groups_in_flight`` of its groups in the store), the queue goes to the store at once
as one group; otherwise the pushes that arrive wait for a group to return and then go
together as the next group. So a lone push goes straight through (no fixed delay), and
under load each store call carries every push that arrived during the previous ones: their
batches are summed (an n-gram pushed by ten clients is one increment in Redis), each
(client_id, seq) still exactly once (see `CountsStore.apply_group`).

Every push is checked on its own (client_id, seq, tokenizer, every row, dedup window): a
bad one gets its own error and nothing of it is written, without failing the others.
A push is answered only after the store call holding its batch returned, so an
acknowledgement means the batch is in the store; if that call fails (the store is
unreachable), every push of the group fails with the same retriable error and none is
acknowledged, and their senders retry the same (client_id, seq, rows).

Under overload the batcher sheds instead of queueing without bound (`PushAdmission`): a
push finding its namespace's queue full, or one that cannot reach the store before its
caller's deadline, is answered `OverloadedError` at once (nothing of it applied, a
retry-after from the store's measured throughput), and a group leaves out the pushes whose
deadline would pass during its store call. So no push is applied long after its caller
gave up, and the queue holds at most ``max_queue_rows`` rows a namespace.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from typing import TYPE_CHECKING

from ngramcache.client.kernel.errors import BackendUnavailableError, OverloadedError

from .counts.values import ApplyResult, GroupItem
from .push_admission import DEADLINE, PushAdmission
from .store_runner import StoreRunner

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = ["PushBatcher"]


@dataclasses.dataclass
class _Waiting:
    """One push waiting for its group's store call."""

    item: GroupItem
    rows: int
    arrived: float  # loop time
    future: asyncio.Future[ApplyResult]
    deadline: float | None = None  # loop time its caller gives up at (None: never)


class _Lane:
    """The pushes of one namespace: those waiting, and how many of its groups are in the store."""

    def __init__(self) -> None:
        self.queue: collections.deque[_Waiting] = collections.deque()
        self.rows = 0  # rows waiting in the queue
        self.in_store = 0  # rows of its groups in the store now
        self.running = 0  # drain tasks (each has at most one group in the store)
        self.full = asyncio.Event()  # set when the waiting rows reach a group's size (ends a window early)


class PushBatcher:
    """Applies concurrent pushes of a namespace together (group commit) through the service's `StoreRunner`.

    Thread-safety: not thread-safe; call `push` from the server's event loop only. The store
    calls run on the runner's pool.

    Args:
        runner: the executor that owns the counts store.
        window: seconds a group waits, after its first push arrived, for more pushes before it
            goes to the store (0, the default: it goes as soon as the store is free, which
            already groups everything that arrived while the previous group was in the
            store). It ends early when ``max_group_rows`` rows are waiting.
        max_group_rows: most rows in one group (a push bigger than that goes alone). Bounds
            how long one store call (one Lua script per shard, on Redis) runs.
        groups_in_flight: store calls of one namespace at once. 1 is strict group commit (the
            biggest groups); 2, the default, lets the service sum and encode the next group
            while Redis runs the current one, which measured faster on the benchmark
            (docs/counts-store.md).
        max_queue_rows: most rows waiting in one namespace's queue; a push over it is shed
            (`OverloadedError`), unless the queue is empty.
        metrics: where to count shed pushes (None: nowhere).
    """

    def __init__(self, runner: StoreRunner, *, window: float = 0.0, max_group_rows: int = 1 << 16,
                 groups_in_flight: int = 2, max_queue_rows: int = 1 << 18, metrics: Metrics | None = None) -> None:
        if not math.isfinite(window) or window < 0:
            raise ValueError(f"window must be a finite number of seconds >= 0, got {window!r}")
        if max_group_rows < 1 or groups_in_flight < 1:
            raise ValueError("max_group_rows and groups_in_flight must be >= 1")
        self._runner = runner
        self._store = runner.store
        self.window = float(window)
        self.max_group_rows = max_group_rows
        self.groups_in_flight = groups_in_flight
        self.admission = PushAdmission(max_queue_rows)
        self._metrics = metrics
        self._lanes: dict[str, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0  # store calls made so far (tests, benchmarks)
        self.pushes = 0  # pushes those calls carried
        self.shed: dict[str, int] = {}  # pushes shed, by reason (tests, benchmarks)
        self._last_end = 0.0  # loop time the last successful store call ended

    async def push(self, namespace: str, item: GroupItem, timeout: float | None = None) -> ApplyResult:
        """Apply one pushed batch with whatever else is pushed to ``namespace`` meanwhile.

        Args:
            namespace: where it goes.
            item: the batch and its (client_id, seq).
            timeout: seconds until its caller gives up (the call's deadline; None: never).

        Returns:
            its result.

        Raises:
            the item's own error (InvalidArgumentError, TokenizerMismatchError,
            BatchTooOldError: nothing of it written), the group's (NamespaceNotFoundError,
            BackendUnavailableError: retry the same batch), or OverloadedError: shed,
            nothing written, retry the same batch after its ``retry_after``.
        """
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(namespace)
        if lane is None:
            lane = self._lanes[namespace] = _Lane()
        rows = len(item.deltas)
        reason = self.admission.refuse_on_arrival(rows, lane.rows, lane.in_store, timeout)
        if reason is not None:
            if not lane.queue and not lane.running:
                del self._lanes[namespace]
            raise self._shed(reason, rows, lane.rows + lane.in_store, namespace)
        now = loop.time()
        waiting = _Waiting(item, rows, now, loop.create_future(), None if timeout is None else now + timeout)
        lane.queue.append(waiting)
        lane.rows += waiting.rows
        if lane.rows >= self.max_group_rows:
            lane.full.set()
        if lane.running < self.groups_in_flight:
            lane.running += 1
            task = loop.create_task(self._drain(namespace, lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # Cancelled (the caller's deadline): the future is cancelled too, so a group not yet
        # formed leaves it out; one already in the store may apply it (groups leave out the pushes
        # whose deadline their store call would pass, so only a call slower than measured does),
        # and the sender's retry of the same (client_id, seq) is then a duplicate.
        return await waiting.future

    def _shed(self, reason: str, rows: int, ahead: int, namespace: str) -> OverloadedError:
        self.shed[reason] = self.shed.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.push_shed(reason, rows)
        return self.admission.overloaded(reason, ahead, namespace)

    async def close(self) -> None:
        """Wait for the groups in the store (call after the server stopped taking calls)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _drain(self, namespace: str, lane: _Lane) -> None:
        try:
            while lane.queue:
                if self.window > 0:
                    await self._wait_window(lane)
                group = self._take(namespace, lane)
                if group:
                    await self._commit(namespace, lane, group)
        finally:
            lane.running -= 1
            if lane.running == 0:
                if lane.queue:  # this task was cancelled (the loop is closing): answer the rest
                    for waiting in lane.queue:
                        if not waiting.future.done():
                            waiting.future.set_exception(BackendUnavailableError("the service is stopping"))
                    lane.queue.clear()
                if self._lanes.get(namespace) is lane:
                    del self._lanes[namespace]

    async def _wait_window(self, lane: _Lane) -> None:
        remaining = lane.queue[0].arrived + self.window - asyncio.get_running_loop().time()
        if remaining > 0 and lane.rows < self.max_group_rows:
            lane.full.clear()
            try:
                await asyncio.wait_for(lane.full.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def _take(self, namespace: str, lane: _Lane) -> list[_Waiting]:
        """The next group: waiting pushes in arrival order up to max_group_rows rows (at least one),
        less those whose caller would give up before the group's store call ends (shed)."""
        group: list[_Waiting] = []
        rows = 0
        now = asyncio.get_running_loop().time()
        while lane.queue:
            waiting = lane.queue[0]
            if group and rows + waiting.rows > self.max_group_rows:
                break
            lane.queue.popleft()
            lane.rows -= waiting.rows
            if waiting.future.done():  # its caller went away before the group formed
                continue
            remaining = None if waiting.deadline is None else waiting.deadline - now
            if self.admission.too_late(lane.in_store + rows + waiting.rows, remaining, first=not group):
                waiting.future.set_exception(self._shed(DEADLINE, waiting.rows, lane.rows + lane.in_store + rows,
                                                        namespace))
                continue
            group.append(waiting)
            rows += waiting.rows
        return group

    async def _commit(self, namespace: str, lane: _Lane, group: list[_Waiting]) -> None:
        self.groups += 1
        self.pushes += len(group)
        rows = sum(w.rows for w in group)
        lane.in_store += rows
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            outcomes = await self._runner.call(self._store.apply_group, namespace, [w.item for w in group])
            # Groups overlap in the store (groups_in_flight, other namespaces): a call is credited with
            # the time since the previous one ended, not its whole span, so the rate is the store's.
            ended = loop.time()
            self.admission.throughput.observe(rows, ended - max(started, self._last_end))
            self._last_end = ended
        except asyncio.CancelledError:
            for waiting in group:
                waiting.future.cancel()
            raise
        except Exception as exc:  # the whole group failed: nothing acknowledged, every sender retries
            for waiting in group:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
            return
        finally:
            lane.in_store -= rows
        for waiting, outcome in zip(group, outcomes):
            if waiting.future.done():
                continue
            if isinstance(outcome, ApplyResult):
                waiting.future.set_result(outcome)
            else:
                waiting.future.set_exception(outcome)
