"""The service's own match drafters in the fleet history: fed from the replica's tail, their sessions' accepts published."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from ngramcache.client._core import Drafter
from ngramcache.client.kernel.errors import NgramCacheError
from ngramcache.client.kernel.history_buffer import HistoryBuffer
from ngramcache.client.kernel.history_sources import HELD_IDLE_SECONDS, SourceIds
from ngramcache.client.kernel.retry import Backoff, retry

from .counts.history import HistoryRecord
from .history_tail import HistoryTails

__all__ = ["ReplicaHistory"]

log = logging.getLogger("ngramcache.service")

_PUSH_BACKOFF = Backoff(base=0.1, cap=0.8, jitter=0.0)  # 0.1, 0.2, 0.4, 0.8 s between the 5 tries of a batch


def _retriable(e: NgramCacheError, attempt: int) -> float | None:
    """The wait before a batch's next try: a retriable failure backs off, any other drops the batch."""
    return _PUSH_BACKOFF.delay(attempt) if e.retriable else None


class ReplicaHistory:
    """Connects each namespace's match drafter (RemoteDrafter sessions in the match mode) to the fleet history.

    The drafter appends what the replica's tail of the namespace reads (the tail keeps polling
    while the drafter lives: it reads the store, not the network), skipping this replica's own
    records; what its sessions accept is drained every ``interval`` and appended to the store
    under the client id ``replica:<replica_id>``, one batch at a time, exactly once.

    Thread-safety: use it only from the server's event loop.
    """

    def __init__(self, tails: HistoryTails, replica_id: str, *, interval: float = 0.05,
                 max_pending_tokens: int = 1 << 18) -> None:
        self.tails = tails
        self.client_id = f"replica:{replica_id}"
        self.interval = interval
        self.max_pending_tokens = max_pending_tokens
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.dropped_tokens = 0

    def attach(self, namespace: str, drafter: Drafter) -> None:
        """Feed and publish ``drafter``, the match drafter of ``namespace`` (`NamespaceRegistry.on_match_drafter`)."""
        self.detach(namespace)
        tail = self.tails.tail(namespace)
        sources = SourceIds()

        def feed(records: list[HistoryRecord]) -> None:
            for r in records:
                if r.client_id == self.client_id:
                    sources.prompts.learn(r.group, r.offset, r.tokens)  # a sibling's sequence may start with it
                    continue
                offset, tokens = sources.whole(r.client_id, r.seq, r.group, r.offset, r.tokens)
                drafter.add_history(sources.of(r.client_id, r.seq, offset, len(tokens)), tokens)

        tail.listeners = [feed]
        tail.pinned = True
        if tail.ring:  # what the tail already holds: the drafter's cold start
            feed(list(tail.ring))
        tail.touch()
        self._tasks[namespace] = asyncio.get_running_loop().create_task(
            self._publish(namespace, drafter), name=f"history-publish-{namespace}")

    def detach(self, namespace: str) -> None:
        task = self._tasks.pop(namespace, None)
        if task is not None:
            task.cancel()
        tail = self.tails.tails.get(namespace)
        if tail is not None:
            tail.listeners = []
            tail.pinned = False

    async def _publish(self, namespace: str, drafter: Drafter) -> None:
        buffer = HistoryBuffer(self.max_pending_tokens)
        fingerprint = drafter.fingerprint
        seq = 0
        while True:
            await asyncio.sleep(self.interval)
            drafter.flush_history(HELD_IDLE_SECONDS)  # a finished session's last tokens join the history
            _, dropped = buffer.add(drafter.drain_history())
            self.dropped_tokens += dropped
            while buffer.pending:
                batch = buffer.take()
                records = [HistoryRecord(self.client_id, r.seq, r.group, r.offset, r.tokens) for r in batch]
                try:  # the same seq: stored once, whatever is retried
                    await retry(functools.partial(self.tails.push, namespace, self.client_id, seq, records, fingerprint),
                                _retriable, errors=NgramCacheError, attempts=5)
                except NgramCacheError as e:
                    self.dropped_tokens += sum(len(r.tokens) for r in records)
                    log.warning("fleet history of %s: a batch of this replica's sessions was dropped: %s", namespace, e)
                seq += 1

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for namespace in list(self._tasks):
            self.detach(namespace)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
