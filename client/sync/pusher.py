"""The pusher: the drafter's n-gram deltas drained, buffered (bounded), batched and pushed exactly once per (client id, seq).

What a crash can lose: the deltas accepted since the last drain (at most ``push_interval``)
plus the pending buffer and the unacknowledged batches (at most ``max_pending_rows +
max_unacked * max_batch_rows`` rows); an acknowledged batch is counted exactly once,
whatever retries happen. Whatever is dropped (a full buffer, a refused batch, close running
out of ``close_timeout``) is counted in ``dropped_rows``/``dropped_count`` and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._proto.codec import delta_rows_to_bytes
from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.errors import NgramCacheError
from ngramcache.client.rows import COUNT, DELTA_DTYPE, KEY_WIDTH, ROW_WIDTH
from ngramcache.client.sync.state import SyncState
from ngramcache.client.transport import Channel

__all__ = ["Pusher", "aggregate_rows"]

log = logging.getLogger("ngramcache.client.sync")

_INT32_MAX = 2**31 - 1


def aggregate_rows(rows: NDArray[np.int32]) -> NDArray[np.int32]:
    """Sum the counts of identical (n-gram, follower) rows; counts saturate at 2^31-1."""
    if len(rows) <= 1:
        return rows
    keys, inverse = np.unique(rows[:, :KEY_WIDTH], axis=0, return_inverse=True)
    sums = np.bincount(inverse.reshape(-1), weights=rows[:, COUNT].astype(np.float64), minlength=len(keys))
    out = np.empty((len(keys), ROW_WIDTH), dtype=DELTA_DTYPE)
    out[:, :KEY_WIDTH] = keys
    out[:, COUNT] = np.minimum(sums, _INT32_MAX).astype(np.int64)
    return out


class Pusher:
    """Pushes what the drafter accepts (a task of the background loop; `pending_rows` readable from any thread).

    Args:
        state: the shared sync state.
        max_unacked: most batches in flight (the server's dedup window caps it: `limit`).
        max_batch_rows: most rows a batch (the server's limit caps it: `limit`).
    """

    def __init__(self, state: SyncState) -> None:
        self.state = state
        self.pending: deque[NDArray[np.int32]] = deque()
        self.pending_rows = 0
        self.cancelled_rows = 0  # rows of pushes close() cancelled unacknowledged
        self.in_flight = 0
        self.seq = 0
        self.max_unacked = state.config.max_unacked
        self.max_batch_rows = state.config.max_batch_rows

    def limit(self, dedup_window: int, max_batch_rows: int) -> None:
        """Apply the server's limits (0: none)."""
        if dedup_window:
            self.max_unacked = max(1, min(self.max_unacked, dedup_window))
        if max_batch_rows:
            self.max_batch_rows = max(1, min(self.max_batch_rows, max_batch_rows))

    def drain(self) -> None:
        rows = self.state.drafter.drain_deltas()
        if not len(rows):
            return
        with self.state.lock:
            self.state.stats.drained_rows += len(rows)
            self.state.stats.drained_count += int(rows[:, COUNT].sum(dtype=np.int64))
        self.pending.append(np.ascontiguousarray(rows, dtype=DELTA_DTYPE))
        self.pending_rows += len(rows)
        if self.pending_rows > self.state.config.max_pending_rows:
            self.shrink()

    def shrink(self) -> None:
        """Over the buffer: sum identical rows; if still over, drop the oldest rows (logged, counted)."""
        merged = aggregate_rows(np.concatenate(list(self.pending)))
        limit = self.state.config.max_pending_rows
        dropped = dropped_count = 0
        if len(merged) > limit:
            # Summing sorts the rows (their age is lost), so drop from the oldest arrays first.
            arrays = list(self.pending)
            total = sum(len(a) for a in arrays)
            while total > limit:
                excess = total - limit
                if len(arrays[0]) <= excess:
                    gone = arrays.pop(0)
                    total = sum(len(a) for a in arrays)
                else:
                    gone, arrays[0] = arrays[0][:excess], arrays[0][excess:]
                    total -= excess
                dropped += len(gone)
                dropped_count += int(gone[:, COUNT].sum(dtype=np.int64))
            merged = aggregate_rows(np.concatenate(arrays)) if arrays else np.empty((0, ROW_WIDTH), DELTA_DTYPE)
        self.pending = deque([merged]) if len(merged) else deque()
        self.pending_rows = len(merged)
        if dropped:
            with self.state.lock:
                self.state.stats.dropped_rows += dropped
                self.state.stats.dropped_count += dropped_count
            log.warning("ngramcache client: push buffer full (%d rows); dropped the %d oldest rows", limit, dropped)

    def take_batch(self) -> NDArray[np.int32] | None:
        if not self.pending:
            return None
        rows = aggregate_rows(np.concatenate(list(self.pending)))
        batch, rest = rows[: self.max_batch_rows], rows[self.max_batch_rows:]
        self.pending = deque([rest]) if len(rest) else deque()
        self.pending_rows = len(rest)
        return np.ascontiguousarray(batch)

    async def send(self, seq: int, rows: NDArray[np.int32], until: float | None) -> None:
        """Push one batch, retrying the same (client_id, seq) while the service is unavailable."""
        request = counts_pb2.PushRequest(namespace=self.state.config.namespace, tokenizer_fingerprint=self.state.config.fingerprint,
                                         client_id=self.state.client_id, seq=seq, rows=delta_rows_to_bytes(rows))

        async def call(chan: Channel) -> counts_pb2.PushResponse:
            resp: counts_pb2.PushResponse = await chan.counts.Push(request, timeout=self.state.config.rpc_timeout,
                                                                   metadata=self.state.metadata)
            return resp

        try:
            resp = await self.state.retrying(f"Push seq {seq}", call, until)
        except NgramCacheError as e:
            self.count_dropped(rows)
            log.warning("ngramcache client: push of %d rows (seq %d) dropped: %s", len(rows), seq, e)
            return
        except asyncio.CancelledError:  # close() ran out of close_timeout with this batch unacknowledged
            self.count_dropped(rows)
            self.cancelled_rows += len(rows)
            raise
        finally:
            self.in_flight -= 1
        with self.state.lock:
            self.state.stats.acked_rows += len(rows)
            self.state.stats.acked_count += int(rows[:, COUNT].sum(dtype=np.int64))
            self.state.stats.duplicate_batches += int(resp.duplicate)

    def count_dropped(self, rows: NDArray[np.int32]) -> None:
        with self.state.lock:
            self.state.stats.dropped_rows += len(rows)
            self.state.stats.dropped_count += int(rows[:, COUNT].sum(dtype=np.int64))

    async def run(self) -> None:
        """Drains, batches and sends until the client closes, then flushes within close_timeout."""
        assert self.state.closing is not None
        closing = self.state.closing
        running: set[asyncio.Task[None]] = set()
        until: float | None = None
        while True:
            if closing.is_set() and until is None:
                until = time.monotonic() + self.state.config.close_timeout
            self.drain()
            while self.in_flight < self.max_unacked:
                batch = self.take_batch()
                if batch is None:
                    break
                seq, self.seq = self.seq, self.seq + 1
                self.in_flight += 1
                with self.state.lock:
                    self.state.stats.pushed_rows += len(batch)
                task = asyncio.create_task(self.send(seq, batch, until))
                running.add(task)
                task.add_done_callback(running.discard)
            if until is not None:
                if (not running and not self.pending) or time.monotonic() >= until:
                    break
                await asyncio.sleep(0.01)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closing.wait(), self.state.config.push_interval)
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        unsent = self.pending_rows
        if self.pending:
            self.count_dropped(np.concatenate(list(self.pending)))
            self.pending.clear()
        self.pending_rows = 0
        if unsent or self.cancelled_rows:
            log.warning("ngramcache client: close could not deliver %d rows within close_timeout %g s (%d in flight, "
                        "%d never sent); counted in dropped_rows", unsent + self.cancelled_rows,
                        self.state.config.close_timeout, self.cancelled_rows, unsent)
