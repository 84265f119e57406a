"""The fleet history's tail on one replica: per namespace, a ring of the newest records, one poller, long-polling readers.

A namespace's `HistoryTail` is created by the first PushHistory or PullHistory of this replica
that names it. While it was pulled from in the last `idle_after` seconds, ONE task polls the
store (``read_history(after=last)``) every ``poll_interval`` and appends what is new to a
ring bounded in bytes; a push through this replica wakes it at once. Readers whose cursor is
inside the ring are answered from memory, and a reader with nothing new waits on an event
the poller sets: a thousand waiting clients cost one store read per interval, not a thousand.
A cursor outside the ring (older than it, or from before this replica knew the namespace) is
answered by the store directly: a group-first read then reads only its groups' partitions of a
partitioned history. The poller reads every partition (the store merges them oldest first, an
equal share of the page each), so the ring and every cursor in it span all partitions. An idle namespace costs no store call (its ring stays, bounded).

Store calls run on the service's `StoreRunner`, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Collection, Iterable

from ngramcache.client.kernel.errors import NamespaceNotFoundError, NgramCacheError
from ngramcache.client.kernel.retry import Backoff, retry
from ngramcache.client.kernel.tasks import cancel_until_done

from .counts.history import HistoryAppend, HistoryBatch, HistoryPage, HistoryRecord
from .counts.namespace import NamespaceRecord, check_tokenizer
from .metrics import Metrics
from .store_runner import StoreRunner

__all__ = ["DEFAULT_PULL_RECORDS", "HistoryTail", "HistoryTails", "TailOptions", "TailPage"]

log = logging.getLogger("ngramcache.service")

DEFAULT_PULL_RECORDS = 1024
"""Records of a PullHistory answer when the request says 0."""

_POLL_RECORDS = 4096  # records per store read of the poller (a catch-up reads several)
_RECORD_OVERHEAD = 64  # bytes a record costs besides its tokens (ids, group, cursor), for the budgets
_INFO_TTL = 10.0  # seconds a namespace's tokenizer is trusted before it is read again
_GATHER = 64  # most waiting PushHistory batches of one namespace sent in one store call


@dataclasses.dataclass(frozen=True)
class TailOptions:
    """How the tails of one replica run.

    Attributes:
        poll_interval: seconds between two store reads of a pulled namespace's poller.
        ring_bytes: most bytes of records a namespace's ring keeps (tokens plus overhead).
        idle_after: seconds without a pull after which a namespace's poller stops.
        max_wait: longest long poll, in seconds (longer waits are capped).
        max_answer_bytes: most bytes of records in one answer (a page stops before it).
    """

    poll_interval: float = 0.05
    ring_bytes: int = 8 << 20
    idle_after: float = 30.0
    max_wait: float = 5.0
    max_answer_bytes: int = 4 << 20


@dataclasses.dataclass(frozen=True)
class TailPage:
    """The answer to one pull: records (filtered), the cursor to resume after, and whether some were trimmed unseen."""

    records: list[HistoryRecord]
    cursor: str
    gap: bool = False


def record_bytes(record: HistoryRecord) -> int:
    """What a record counts against the ring's and an answer's byte bounds (a partitioned history's cursor, a
    position per partition, counts beyond the 32 bytes of a one-stream cursor that the overhead covers)."""
    return (int(record.tokens.nbytes) + len(record.group) + len(record.client_id) + _RECORD_OVERHEAD
            + max(0, len(record.cursor) - 32))


@dataclasses.dataclass(frozen=True)
class _Filter:
    """What a reader wants of the records it scans: not its own, only its groups."""

    exclude_client_id: str
    groups: frozenset[str]
    max_records: int
    max_bytes: int

    def wants(self, record: HistoryRecord) -> bool:
        if self.exclude_client_id and record.client_id == self.exclude_client_id:
            return False
        return not self.groups or record.group in self.groups

    def page(self, records: Iterable[HistoryRecord], after: str, gap: bool = False) -> TailPage:
        """The records this reader wants among ``records`` (those after ``after``, oldest first), within its bounds;
        the cursor moves past every record scanned, wanted or not."""
        out: list[HistoryRecord] = []
        cursor, size = after, 0
        for record in records:
            if self.wants(record):
                n = record_bytes(record)
                if out and (len(out) >= self.max_records or size + n > self.max_bytes):
                    break
                out.append(record)
                size += n
            cursor = record.cursor
        return TailPage(out, cursor, gap)


class HistoryTail:
    """One namespace's ring of newest records and its poller (see the module docstring).

    Thread-safety: use it only from the server's event loop.
    """

    def __init__(self, runner: StoreRunner, namespace: str, options: TailOptions, metrics: Metrics | None = None) -> None:
        self.runner = runner
        self.namespace = namespace
        self.options = options
        self.metrics = metrics
        self.ring: deque[HistoryRecord] = deque()
        self.ring_bytes = 0
        self.base = 0  # absolute index of ring[0]
        self.index: dict[str, int] = {}  # cursor -> absolute index of the record it names ("" -> base - 1 while whole)
        self.last: str | None = None  # the poller's cursor (None: not started; it reads from the oldest kept)
        self.last_used = 0.0
        self.polls = 0  # store reads the poller made (tests and the bench read it)
        self.info: NamespaceRecord | None = None
        self._info_at = -1e9
        self._news = asyncio.Event()  # replaced after every append: waiters wake on the one they hold
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[list[HistoryRecord]], None]] = []  # polled records go to them too
        self.pinned = False  # poll even when nobody pulls (a listener needs the records)

    # -- the ring -------------------------------------------------------------------------

    def _append(self, page: HistoryPage) -> None:
        if page.gap and self.last is not None:
            # The store trimmed records this ring never saw (or was restarted): the ring is no
            # longer contiguous with what follows, so it starts again from this page.
            self.ring.clear()
            self.index.clear()
            self.ring_bytes = 0
        if self.last is None and not self.ring:
            self.index[""] = self.base - 1  # the ring holds everything from the oldest kept record
        start = self.base + len(self.ring)
        now_ms = time.time() * 1000
        for i, record in enumerate(page.records):
            self.ring.append(record)
            self.index[record.cursor] = start + i
            self.ring_bytes += record_bytes(record)
            if self.metrics is not None and record.time_ms:
                self.metrics.history_tail_lag.observe(max(0.0, now_ms - record.time_ms) / 1000)
        self.last = page.cursor
        while self.ring_bytes > self.options.ring_bytes and len(self.ring) > 1:
            gone = self.ring.popleft()
            self.ring_bytes -= record_bytes(gone)
            self.index.pop(gone.cursor, None)
            self.index.pop("", None)
            self.base += 1
        if page.records:
            news, self._news = self._news, asyncio.Event()
            news.set()

    def from_ring(self, after: str, want: _Filter) -> TailPage | None:
        """The page after ``after`` from the ring, or None when the ring does not reach ``after``."""
        at = self.index.get(after)
        if at is None:
            return None
        first = at + 1 - self.base
        if first >= len(self.ring):
            return TailPage([], after)
        return want.page((self.ring[i] for i in range(first, len(self.ring))), after)

    # -- the poller -----------------------------------------------------------------------

    def touch(self) -> None:
        """A reader used the tail now: keep (or start) the poller."""
        self.last_used = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll(), name=f"history-tail-{self.namespace}")

    def wake(self) -> None:
        """A push through this replica stored records: poll now rather than at the next interval."""
        self._wake.set()

    async def _poll(self) -> None:
        store = self.runner.store
        poll = self.options.poll_interval
        backoff = Backoff(base=2 * poll, cap=min(2.0, 64 * poll), jitter=0.0)  # 2, 4, ... 64 polls, at most 2 s

        def wanted() -> bool:
            return self.pinned or time.monotonic() - self.last_used < self.options.idle_after

        async def read() -> HistoryPage:
            self._wake.clear()
            return await self.runner.call(store.read_history, self.namespace, after=self.last or "", limit=_POLL_RECORDS)

        def failed(e: NgramCacheError, attempt: int) -> float | None:
            if isinstance(e, NamespaceNotFoundError) or not wanted():
                return None
            failures = attempt + 1
            if failures == 1 or failures % 100 == 0:
                log.warning("fleet history of %s: tail poll failed (%d in a row): %s", self.namespace, failures, e)
            return backoff.delay(attempt)

        while wanted():
            try:
                page = await retry(read, failed, errors=NgramCacheError)
            except NamespaceNotFoundError:
                self.forget()
                return
            except NgramCacheError:
                return  # failing when no reader wants the tail any more
            self.polls += 1
            self._append(page)
            for listener in self.listeners:
                if page.records:
                    try:
                        listener(page.records)
                    except Exception:  # a listener's bug must not stop the tail every reader depends on
                        log.exception("fleet history of %s: a tail listener failed", self.namespace)
            if len(page.records) >= _POLL_RECORDS or page.more:
                continue  # catching up: read on at once
            try:
                await asyncio.wait_for(self._wake.wait(), self.options.poll_interval)
            except asyncio.TimeoutError:
                pass

    def forget(self) -> None:
        """Drop the ring (the namespace was dropped, or is unknown)."""
        self.ring.clear()
        self.index.clear()
        self.ring_bytes = 0
        self.last = None
        self.info = None

    def stop(self) -> None:
        """Cancel the poller (it ends at its next await)."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        if self._task is not None:
            await cancel_until_done([self._task])  # a wake at the cancellation's moment can leave it polling
            self._task = None

    # -- readers --------------------------------------------------------------------------

    async def check(self, fingerprint: bytes) -> None:
        """Raise unless the namespace exists with this tokenizer (its record read at most every `_INFO_TTL` s)."""
        now = time.monotonic()
        if self.info is None or now - self._info_at > _INFO_TTL:
            self.info = await self.runner.call(self.runner.store.namespace_info, self.namespace)
            self._info_at = now
        check_tokenizer(self.info, fingerprint)

    async def pull(self, after: str, *, max_records: int, wait: float, exclude_client_id: str = "",
                   groups: Collection[str] = ()) -> TailPage:
        """The records after cursor ``after`` that the reader wants, waiting up to ``wait`` seconds for some.

        Raises:
            InvalidArgumentError (a malformed cursor), NamespaceNotFoundError, BackendUnavailableError.
        """
        want = _Filter(exclude_client_id, frozenset(groups), max_records, self.options.max_answer_bytes)
        deadline = time.monotonic() + min(max(0.0, wait), self.options.max_wait)
        gap = False
        while True:
            self.touch()
            news = self._news
            page = self.from_ring(after, want)
            if page is None:
                # A group-first read asks the store for the groups' partitions alone (a partitioned history).
                hint = {"groups": tuple(want.groups)} if want.groups else {}
                stored = await self.runner.call(self.runner.store.read_history, self.namespace, after=after,
                                                limit=min(max(max_records, 1), 65536), **hint)
                page = want.page(stored.records, after, stored.gap)
            gap = gap or page.gap
            if page.records:
                return dataclasses.replace(page, gap=gap)
            after = page.cursor  # past the records this reader skips
            left = deadline - time.monotonic()
            if left <= 0:
                return TailPage([], after, gap)
            try:
                await asyncio.wait_for(news.wait(), left)
            except asyncio.TimeoutError:
                return TailPage([], after, gap)


class HistoryTails:
    """The tails of every namespace this replica served the fleet history of.

    Thread-safety: use it only from the server's event loop.

    Args:
        runner: the executor that owns the counts store.
        options: how the tails run.
        metrics: where to count records pushed and served, and the tail's lag (None: nowhere).
    """

    def __init__(self, runner: StoreRunner, options: TailOptions | None = None, metrics: Metrics | None = None) -> None:
        self.runner = runner
        self.options = options or TailOptions()
        self.metrics = metrics
        self.tails: dict[str, HistoryTail] = {}
        self._pushes: dict[str, list[tuple[HistoryBatch, asyncio.Future[HistoryAppend]]]] = {}  # waiting, per namespace
        self._flushing: set[str] = set()  # namespaces whose flusher runs

    def tail(self, namespace: str) -> HistoryTail:
        tail = self.tails.get(namespace)
        if tail is None:
            tail = self.tails[namespace] = HistoryTail(self.runner, namespace, self.options, self.metrics)
        return tail

    async def push(self, namespace: str, client_id: str, seq: int, records: list[HistoryRecord],
                   fingerprint: bytes) -> HistoryAppend:
        """Store one batch exactly once; return what the store did (stored and skipped). Wakes the namespace's poller.

        Concurrent pushes to one namespace are gathered: while one store call is in flight, the
        batches that arrive wait and go together in the next (`CountsStore.append_history_many`:
        on a partitioned history one script call per partition for all of them, so a busy fleet's
        appends cost Redis no more per token than one sender's whole batch in one stream). A lone
        push goes at once.
        """
        future: asyncio.Future[HistoryAppend] = asyncio.get_running_loop().create_future()
        self._pushes.setdefault(namespace, []).append((HistoryBatch(client_id, seq, records, fingerprint), future))
        if namespace not in self._flushing:
            self._flushing.add(namespace)
            asyncio.get_running_loop().create_task(self._flush(namespace), name=f"history-push-{namespace}")
        return await future

    async def _flush(self, namespace: str) -> None:
        """Send the namespace's waiting batches, at most `_GATHER` a store call, until none waits."""
        store = self.runner.store
        try:
            while self._pushes.get(namespace):
                waiting = self._pushes[namespace]
                items, self._pushes[namespace] = waiting[:_GATHER], waiting[_GATHER:]
                results: list[HistoryAppend | BaseException]
                try:
                    if len(items) == 1:
                        b = items[0][0]
                        results = [await self.runner.call(store.append_history, namespace, b.client_id, b.batch_seq,
                                                          b.records, fingerprint=b.fingerprint)]
                    else:
                        results = list(await self.runner.call(store.append_history_many, namespace,
                                                              [b for b, _ in items]))
                except Exception as exc:  # every batch of the call failed alike (each sender retries its own)
                    results = [exc] * len(items)
                for (_, future), result in zip(items, results):
                    if future.done():  # its caller went away; the batch is stored or not, a retry will tell
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                        if self.metrics is not None:
                            self.metrics.history_pushed(result)
                tail = self.tails.get(namespace)
                if tail is not None:
                    tail.wake()
        finally:
            self._flushing.discard(namespace)
            if not self._pushes.get(namespace):
                self._pushes.pop(namespace, None)

    async def pull(self, namespace: str, fingerprint: bytes, after: str, *, max_records: int, wait: float,
                   exclude_client_id: str = "", groups: Collection[str] = ()) -> TailPage:
        """`HistoryTail.pull` of the namespace, once its tokenizer is checked."""
        tail = self.tail(namespace)
        try:
            await tail.check(fingerprint)
        except NamespaceNotFoundError:
            self.drop(namespace)
            raise
        page = await tail.pull(after, max_records=max_records or DEFAULT_PULL_RECORDS, wait=wait,
                               exclude_client_id=exclude_client_id, groups=groups)
        if self.metrics is not None:
            self.metrics.history_served(len(page.records), sum(int(r.tokens.nbytes) for r in page.records))
        return page

    async def subscribe(self, namespace: str, fingerprint: bytes, after: str, *, max_records: int, wait: float,
                        exclude_client_id: str = "", groups: Collection[str] = ()) -> AsyncGenerator[TailPage, None]:
        """The pages `pull` would answer from ``after``, each from the cursor of the one before, forever: a page as
        soon as records arrive, an empty one after ``wait`` seconds (0: the longest long poll) without any.

        The caller takes one page at a time (the next is read only when it asks), so a slow reader holds one page.
        """
        wait = min(wait, self.options.max_wait) if wait > 0 else self.options.max_wait
        while True:
            page = await self.pull(namespace, fingerprint, after, max_records=max_records, wait=wait,
                                   exclude_client_id=exclude_client_id, groups=groups)
            yield page
            after = page.cursor

    def drop(self, namespace: str) -> None:
        """Forget a namespace's tail (it was dropped)."""
        tail = self.tails.pop(namespace, None)
        if tail is not None:
            tail.forget()
            tail.stop()

    async def close(self) -> None:
        await asyncio.gather(*(tail.close() for tail in self.tails.values()))
        self.tails.clear()
