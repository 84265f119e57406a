"""The fleet history on the client, publishing side: the buffer of accepted records, the live groups, the publisher.

Publisher: every ``history_push_interval`` it drains ``drafter.drain_history()``, tags each
sequence with its group (`NgramClient.set_group`, else a hash of the sequence's first record,
its prompt: siblings sampled from one prompt share it), splits the records to the server's
limits and pushes ONE batch at a time with increasing seqs, retrying the same batch while the
service is unavailable: each batch is stored exactly once. The buffer is bounded
(``history_max_pending_tokens``); what is dropped is counted and logged, never waited for.
The groups it tags records with are this client's live groups (`LiveGroups`), which the mirror
(`ngramcache.client.sync.history_mirror`) pulls first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.kernel.errors import NgramCacheError
from ngramcache.client.kernel.history_buffer import DROP_LOG_INTERVAL, HistoryBuffer, LiveGroups, PendingRecord, validate_group
from ngramcache.client.kernel.history_sources import prompt_group
from ngramcache.client.sync.attempt import Attempts
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import tokens_to_bytes
from ngramcache.client.wire.transport import Channel

__all__ = ["HistoryBuffer", "HistoryPublisher", "HistoryStats", "LiveGroups", "PendingRecord", "prompt_group",
           "validate_group"]

log = logging.getLogger("ngramcache.client.sync")

@dataclasses.dataclass
class HistoryStats:
    """The fleet history's counters in `NgramClient.stats`; read and written under `SyncState.lock`."""

    drained_records: int = 0
    drained_tokens: int = 0
    # pushed_* (acknowledged) = stored_* (kept by the store) + skipped_* (near-duplicate prompts it skipped:
    # a sibling's equal copy is kept) + duplicate_* (batches answered duplicate: stored by an earlier attempt).
    pushed_batches: int = 0
    pushed_records: int = 0
    pushed_tokens: int = 0
    stored_records: int = 0
    stored_tokens: int = 0
    skipped_records: int = 0
    skipped_tokens: int = 0
    duplicate_batches: int = 0
    duplicate_records: int = 0
    duplicate_tokens: int = 0
    dropped_records: int = 0
    dropped_tokens: int = 0
    # Given up after an attempt that may have been stored (a deadline, or a call cancelled in flight):
    # the store holds between pushed and pushed + unconfirmed of them, never twice (exactly once per seq).
    unconfirmed_records: int = 0
    unconfirmed_tokens: int = 0
    # What the namespace's tail brought (pulled_*) and what the group pulls brought (group_pulled_*);
    # of both, tokens appended to the drafter and tokens it already held (a record that came both ways).
    pulled_records: int = 0
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    tail_streams: int = 0  # SubscribeHistory streams the mirror opened (one, plus one after each failure or failover)
    group_pulls: int = 0
    group_pulled_records: int = 0
    group_pulled_tokens: int = 0
    group_pulled_bytes: int = 0
    appended_tokens: int = 0
    repeated_tokens: int = 0
    restored_tokens: int = 0  # of appended_tokens: prompts put back in front of sequences whose copy the store skipped
    gaps: int = 0
    cursor: str = ""
    group_cursor: str = ""


class HistoryPublisher:
    """Pushes the drafter's accepted tokens to the fleet history (a task of the background loop).

    Args:
        state: the shared sync state.
        stats: the history counters (shared with the mirror).
    """

    def __init__(self, state: SyncState, stats: HistoryStats) -> None:
        self.state = state
        self.stats = stats
        self.buffer = HistoryBuffer(state.config.history_max_pending_tokens)
        self.seq = 0
        self.enabled = True
        self._unlogged = 0
        self._logged_at = time.monotonic() - DROP_LOG_INTERVAL

    def drain(self) -> None:
        drained = self.state.drafter.drain_history()
        if not drained:
            return
        dropped = self.buffer.add(drained)
        with self.state.lock:
            self.stats.drained_records += len(drained)
            self.stats.drained_tokens += sum(len(t) for _, _, t in drained)
        self.dropped(*dropped)

    def dropped(self, records: int, tokens: int) -> None:
        if not tokens:
            return
        with self.state.lock:
            self.stats.dropped_records += records
            self.stats.dropped_tokens += tokens
        self._unlogged += tokens
        self.log_drops()

    def given_up(self, records: int, tokens: int, uncertain: bool) -> None:
        """A batch given up: dropped (never stored), or unconfirmed (an attempt may have been stored)."""
        if not uncertain:
            self.dropped(records, tokens)
            return
        with self.state.lock:
            self.stats.unconfirmed_records += records
            self.stats.unconfirmed_tokens += tokens

    def log_drops(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._unlogged or (not force and now - self._logged_at < DROP_LOG_INTERVAL):
            return
        with self.state.lock:
            total = self.stats.dropped_tokens
        log.warning("ngramcache client: fleet history buffer full (history_max_pending_tokens %d) or unsendable: "
                    "dropped %d tokens since the last report, the oldest first; %d in all (stats "
                    "history_dropped_tokens)", self.buffer.max_pending_tokens, self._unlogged, total)
        self._unlogged = 0
        self._logged_at = now

    async def send(self, batch: list[PendingRecord], until: float | None) -> None:
        """Push one batch under the next seq, retrying the same (client_id, seq) while the service is unavailable."""
        state, config = self.state, self.state.config
        seq, self.seq = self.seq, self.seq + 1
        request = counts_pb2.PushHistoryRequest(
            namespace=config.namespace, tokenizer_fingerprint=config.fingerprint, client_id=state.client_id, seq=seq,
            records=[counts_pb2.HistoryRecord(seq=r.seq, group=r.group, offset=r.offset, tokens=tokens_to_bytes(r.tokens))
                     for r in batch])

        attempts = Attempts()

        async def call(chan: Channel) -> counts_pb2.PushHistoryResponse:
            resp: counts_pb2.PushHistoryResponse = await attempts.call(lambda: chan.counts.PushHistory(
                request, timeout=config.rpc_timeout, metadata=state.metadata))
            chan.stored()
            return resp

        tokens = sum(len(r.tokens) for r in batch)
        try:
            resp = await state.retrying(f"PushHistory seq {seq}", call, until)
        except NgramCacheError as e:
            self.given_up(len(batch), tokens, attempts.given_up())
            log.warning("ngramcache client: fleet history batch of %d records (seq %d) %s: %s", len(batch), seq,
                        attempts.outcome("stored"), e)
            return
        except asyncio.CancelledError:  # close() ran out of close_timeout with this batch unacknowledged
            self.given_up(len(batch), tokens, attempts.given_up(cancelled=True))
            raise
        with state.lock:
            self.stats.pushed_batches += 1
            self.stats.pushed_records += len(batch)
            self.stats.pushed_tokens += tokens
            if resp.duplicate:
                self.stats.duplicate_batches += 1
                self.stats.duplicate_records += len(batch)
                self.stats.duplicate_tokens += tokens
            else:
                # A server from before tokens_stored answers 0 there and stores every record.
                stored_tokens = resp.tokens_stored if resp.tokens_stored or not resp.records_stored else tokens
                self.stats.stored_records += resp.records_stored
                self.stats.stored_tokens += stored_tokens
                self.stats.skipped_records += resp.records_skipped
                self.stats.skipped_tokens += resp.tokens_skipped

    async def run(self) -> None:
        """Drain and push until the client closes, then flush within close_timeout.

        One batch is in flight at a time (the store's exactly-once rule); draining goes on
        meanwhile, so a service that does not answer fills the bounded buffer, not the drafter.
        """
        assert self.state.closing is not None
        closing, config = self.state.closing, self.state.config
        until: float | None = None
        sending: asyncio.Task[None] | None = None
        closed = asyncio.create_task(closing.wait())
        try:
            while self.enabled:
                if closing.is_set() and until is None:
                    until = time.monotonic() + config.close_timeout
                self.drain()
                self.log_drops()
                idle = sending is None or sending.done()
                if idle and self.buffer.pending:
                    sending = asyncio.create_task(self.send(self.buffer.take(), until))
                    idle = False
                if until is not None:
                    if (idle and not self.buffer.pending) or time.monotonic() >= until:
                        break
                    await asyncio.sleep(0.005)
                    continue
                # Wake at the next interval, at close, or as soon as the batch in flight is answered.
                waits: set[asyncio.Task[Any]] = {closed}
                if sending is not None and not sending.done():
                    waits.add(sending)
                await asyncio.wait(waits, timeout=config.history_push_interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if sending is not None and not sending.done():
                sending.cancel()  # counted by send: dropped, or unconfirmed if it may have been stored
                await asyncio.gather(sending, return_exceptions=True)
        unsent = self.buffer.pending_tokens
        if unsent:
            self.dropped(len(self.buffer.pending), unsent)
            self.buffer.pending.clear()
            self.buffer.pending_tokens = 0
        self.log_drops(force=True)
