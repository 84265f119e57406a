"""The pusher: the drafter's n-gram deltas drained, buffered (bounded), batched and pushed exactly once per (client id, seq).

What a crash can lose: the deltas accepted since the last drain (at most ``push_interval``)
plus the pending buffer and the unacknowledged batches (at most ``max_pending_rows +
max_unacked * max_batch_rows`` rows); an acknowledged batch is counted exactly once,
whatever retries happen. Whatever is dropped (a full buffer, a refused batch, close running
out of ``close_timeout``) is counted in ``dropped_rows``/``dropped_count`` and logged (once
per `DROP_LOG_INTERVAL` with the numbers, however often it happens).

Backpressure: a service that sheds a push (`OverloadedError`, nothing applied) is waited for
the time it hints, and the same batch (same seq, same rows) is sent again; meanwhile the
pusher sends less, AIMD-style: the batches in flight and the rows of new batches halve on
overload and grow back slowly with each acknowledgement. Rows wait in the pending buffer
while it has room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.kernel.errors import NgramCacheError, OverloadedError
from ngramcache.client.kernel.rows import COUNT, DELTA_DTYPE, KEY_WIDTH, ROW_WIDTH
from ngramcache.client.sync.attempt import Attempts
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import delta_rows_to_bytes
from ngramcache.client.wire.transport import Channel

__all__ = ["DROP_LOG_INTERVAL", "PushRate", "Pusher", "aggregate_rows"]

log = logging.getLogger("ngramcache.client.sync")

_INT32_MAX = 2**31 - 1

DROP_LOG_INTERVAL = 10.0
"""Seconds between two log lines about dropped rows (each gives the numbers since the last)."""


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


class PushRate:
    """AIMD on what the pusher sends: batches in flight (``window``) and rows of a new batch (``batch_rows``).

    Halved on overload (at most once per ``hold`` seconds, so the sheds of one burst count once),
    grown back additively on every acknowledged batch: the window by 1/window (about one batch
    per round trip), the rows by 1/16 of their ceiling.

    Args:
        max_window, max_rows: the ceilings (the client's settings, capped by the server's limits).
        min_rows: the floor of ``batch_rows``.
    """

    def __init__(self, max_window: int, max_rows: int, min_rows: int = 256) -> None:
        self.max_window = max(1, max_window)
        self.max_rows = max(1, max_rows)
        self.min_rows = max(1, min(min_rows, self.max_rows))
        self.window = float(self.max_window)
        self.batch_rows = self.max_rows
        self._last_decrease = -1e9

    def limit(self, max_window: int, max_rows: int) -> None:
        """Lower the ceilings (the server's limits)."""
        self.max_window, self.max_rows = max(1, max_window), max(1, max_rows)
        self.min_rows = min(self.min_rows, self.max_rows)
        self.window = min(self.window, float(self.max_window))
        self.batch_rows = min(self.batch_rows, self.max_rows)

    @property
    def in_flight(self) -> int:
        """Batches that may be in flight now."""
        return max(1, int(self.window))

    def overloaded(self, now: float, hold: float) -> bool:
        """Multiplicative decrease; False when one happened less than ``hold`` seconds ago (same burst)."""
        if now - self._last_decrease < hold:
            return False
        self._last_decrease = now
        self.window = max(1.0, self.window / 2)
        self.batch_rows = max(self.min_rows, self.batch_rows // 2)
        return True

    def acknowledged(self) -> None:
        """Additive increase."""
        self.window = min(float(self.max_window), self.window + 1.0 / self.window)
        self.batch_rows = min(self.max_rows, self.batch_rows + max(1, self.max_rows // 16))


class Pusher:
    """Pushes what the drafter accepts (a task of the background loop; `pending_rows` readable from any thread).

    Args:
        state: the shared sync state; its config's ``max_unacked`` (most batches in flight) and
            ``max_batch_rows`` (most rows a batch) are the ceilings, which the server's limits may
            lower (`limit`).
    """

    def __init__(self, state: SyncState) -> None:
        self.state = state
        self.pending: deque[NDArray[np.int32]] = deque()
        self.pending_rows = 0
        self.cancelled_rows = 0  # rows of pushes close() cancelled before any attempt reached the service
        self.unconfirmed_at_close = 0  # rows of pushes close() cancelled with an attempt that may have been applied
        self.in_flight = 0
        self.seq = 0
        self.max_unacked = state.config.max_unacked
        self.max_batch_rows = state.config.max_batch_rows
        self.rate = PushRate(self.max_unacked, self.max_batch_rows)
        self._unlogged_rows = self._unlogged_count = 0  # dropped since the last log line
        self._logged_at = time.monotonic() - DROP_LOG_INTERVAL  # the first drop is reported at once

    def limit(self, dedup_window: int, max_batch_rows: int) -> None:
        """Apply the server's limits (0: none)."""
        if dedup_window:
            self.max_unacked = max(1, min(self.max_unacked, dedup_window))
        if max_batch_rows:
            self.max_batch_rows = max(1, min(self.max_batch_rows, max_batch_rows))
        self.rate.limit(self.max_unacked, self.max_batch_rows)

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
        """Over the buffer: sum identical rows; if still over, drop the oldest rows (logged, counted).

        Drops go down to 7/8 of the buffer, not just under it: summing sorts the whole buffer, and
        a buffer left full would be summed again at every drain while the overload lasts.
        """
        merged = aggregate_rows(np.concatenate(list(self.pending)))
        limit = self.state.config.max_pending_rows
        target = limit - limit // 8
        dropped = dropped_count = 0
        if len(merged) > target:
            # Summing sorts the rows (their age is lost), so drop from the oldest arrays first.
            arrays = list(self.pending)
            total = sum(len(a) for a in arrays)
            while total > target:
                excess = total - target
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
            self._unlogged_rows += dropped
            self._unlogged_count += dropped_count
            self.log_drops()

    def log_drops(self, force: bool = False) -> None:
        """One warning with the rows dropped since the last one, at most every DROP_LOG_INTERVAL seconds."""
        now = time.monotonic()
        if not self._unlogged_rows or (not force and now - self._logged_at < DROP_LOG_INTERVAL):
            return
        with self.state.lock:
            total = self.state.stats.dropped_rows
        log.warning("ngramcache client: push buffer full (max_pending_rows %d): dropped %d rows (%d n-gram occurrences) "
                    "since the last report, the oldest first; %d in all (stats dropped_rows)", self.state.config.max_pending_rows,
                    self._unlogged_rows, self._unlogged_count, total)
        self._unlogged_rows = self._unlogged_count = 0
        self._logged_at = now

    def take_batch(self) -> NDArray[np.int32] | None:
        """The next batch: the oldest pending rows, up to the rate's batch size, identical rows summed.

        Only what the batch takes is summed (the cost of a batch is its own size, whatever the
        buffer holds); rows equal to ones of a later batch are sent again there, which the
        store adds up the same.
        """
        if not self.pending:
            return None
        size = self.rate.batch_rows
        taken: list[NDArray[np.int32]] = []
        rows = 0
        while self.pending and rows < size:
            head = self.pending[0]
            if rows + len(head) <= size:
                taken.append(self.pending.popleft())
            else:
                taken.append(head[:size - rows])
                self.pending[0] = head[size - rows:]
            rows += len(taken[-1])
        self.pending_rows -= rows
        return np.ascontiguousarray(aggregate_rows(np.concatenate(taken)))

    async def send(self, seq: int, rows: NDArray[np.int32], until: float | None) -> None:
        """Push one batch, retrying the same (client_id, seq) while the service is unavailable or overloaded."""
        request = counts_pb2.PushRequest(namespace=self.state.config.namespace, tokenizer_fingerprint=self.state.config.fingerprint,
                                         client_id=self.state.client_id, seq=seq, rows=delta_rows_to_bytes(rows))

        attempts = Attempts()

        async def call(chan: Channel) -> counts_pb2.PushResponse:
            resp: counts_pb2.PushResponse = await attempts.call(lambda: chan.counts.Push(
                request, timeout=self.state.config.rpc_timeout, metadata=self.state.metadata))
            chan.stored()
            return resp

        def shed(e: OverloadedError) -> float | None:
            wait = self.overloaded(e)
            return None if until is not None and time.monotonic() + wait >= until else wait

        try:
            resp = await self.state.retrying(f"Push seq {seq}", call, until, overloaded=shed)
        except NgramCacheError as e:
            self.count_given_up(rows, attempts.given_up())
            log.warning("ngramcache client: push of %d rows (seq %d) %s: %s", len(rows), seq, attempts.outcome("applied"), e)
            return
        except asyncio.CancelledError:  # close() ran out of close_timeout with this batch unacknowledged
            uncertain = attempts.given_up(cancelled=True)
            self.count_given_up(rows, uncertain)
            if uncertain:
                self.unconfirmed_at_close += len(rows)
            else:
                self.cancelled_rows += len(rows)
            raise
        finally:
            self.in_flight -= 1
        self.rate.acknowledged()
        with self.state.lock:
            self.state.stats.acked_rows += len(rows)
            self.state.stats.acked_count += int(rows[:, COUNT].sum(dtype=np.int64))
            self.state.stats.duplicate_batches += int(resp.duplicate)

    def overloaded(self, e: OverloadedError) -> float:
        """Slow down after a shed push; return how long to wait before sending it again (the hint, jittered).

        The retry of `send` (`SyncState.retrying`) calls it for each shed attempt: the same batch
        is then sent again on the same channel, with no other backoff.
        """
        hint = e.retry_after if e.retry_after is not None else self.state.config.backoff.delay(4)
        wait = hint * random.uniform(1.0, 1.5)  # jitter: the clients shed together do not come back together
        decreased = self.rate.overloaded(time.monotonic(), max(0.05, hint))
        with self.state.lock:
            self.state.stats.overloaded += 1
            self.state.stats.overload_waits += int(decreased)
            self.state.stats.retry_wait_seconds += wait
        log.debug("ngramcache client: push shed by the service (%s); retrying in %.0f ms, window %.1f batches of %d rows",
                  e, wait * 1000, self.rate.window, self.rate.batch_rows)
        return wait

    def count_given_up(self, rows: NDArray[np.int32], uncertain: bool) -> None:
        """A batch given up: dropped (never applied), or unconfirmed (an attempt may have been applied)."""
        if not uncertain:
            self.count_dropped(rows)
            return
        with self.state.lock:
            self.state.stats.unconfirmed_rows += len(rows)
            self.state.stats.unconfirmed_count += int(rows[:, COUNT].sum(dtype=np.int64))

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
            self.log_drops()
            while self.in_flight < self.rate.in_flight:
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
        self.log_drops(force=True)
        if unsent or self.cancelled_rows or self.unconfirmed_at_close:
            log.warning("ngramcache client: close could not deliver %d rows within close_timeout %g s: %d never sent "
                        "and %d in flight unsent, counted in dropped_rows; %d sent without an answer (the service may "
                        "have applied them), counted in unconfirmed_rows",
                        unsent + self.cancelled_rows + self.unconfirmed_at_close, self.state.config.close_timeout,
                        unsent, self.cancelled_rows, self.unconfirmed_at_close)
