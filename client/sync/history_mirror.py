"""The fleet history mirror: what other clients accepted, pulled (this client's live groups first) into the drafter's match history.

Each round reads the namespace's tail: the next message of one long-lived SubscribeHistory
stream opened from the mirror's cursor (at first the namespace's oldest kept record, so a cold
client gets the recent window), ``history_pull_records`` records at most, skipping this
client's own records. A stream that fails is opened again from the last cursor received, on
the channel the retries and failover choose; a service without SubscribeHistory (UNIMPLEMENTED)
is read with a PullHistory long poll a round instead, for as long as the client stays on that
channel. The stream adds no call a round: at 32 clients a replica, the calls a server must
accept are what delays an answer (docs/benchmarks.md, "Second pass"). While the tail
is behind (its last page was full: a backlog of many clients' records) and this client has
live groups (`LiveGroups`: the groups of the sequences it publishes now), the round first
pulls those groups' records alone (PullHistory with ``groups``, at most
``history_groups_per_pull`` of them, the most recently used first), from a cursor of their own
that starts at the tail's position when a group becomes live: a sibling's output is then
draftable after one round, not after the whole backlog. Such a record reaches the mirror a
second time with the tail; `MirroredRuns` appends every token of a sequence once. Both pulls
share the budget ``history_max_bytes_per_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque

import grpc
import numpy as np
from grpc import aio
from numpy.typing import NDArray

from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.kernel.errors import NgramCacheError
from ngramcache.client.kernel.history_sources import HELD_IDLE_SECONDS, MirroredRuns
from ngramcache.client.sync.history import HistoryStats, LiveGroups
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import bytes_to_tokens
from ngramcache.client.wire.transport import Channel

__all__ = ["MIRROR_WAIT_MS", "HistoryMirror", "LagWindow"]

log = logging.getLogger("ngramcache.client.sync")

MIRROR_WAIT_MS = 4000
"""How long the tail waits for new records (the group pull never waits): the longest a SubscribeHistory stream goes
without a message (an empty one then), or one PullHistory long poll. A record wakes it at once, so the wait sets
only what an idle client costs (the service caps it, 5 s by default)."""

_BEHIND_BYTES = 1 << 20  # an answer this large is a catch-up page, whatever its record count


class LagWindow:
    """The lags (ms) of the last ``size`` records, for p50/p99."""

    def __init__(self, size: int = 1000) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def add(self, ms: float) -> None:
        self.values.append(ms)

    def quantile(self, q: float) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class HistoryMirror:
    """Appends the fleet's history to the drafter's match history (a task of the background loop; see the module docstring).

    Args:
        state: the shared sync state.
        stats: the history counters (shared with the publisher).
        live: the publisher's live groups, pulled first (None: the tail alone).
    """

    def __init__(self, state: SyncState, stats: HistoryStats, live: LiveGroups | None = None) -> None:
        self.state = state
        self.stats = stats
        self.live = live
        self.runs = MirroredRuns(prompts=live.prompts if live is not None else None)
        self.lag = LagWindow()
        self.cursor = ""
        self.behind = True  # the tail's last page was full (at first: not known, so assumed)
        self.groups_per_pull = state.config.history_groups_per_pull
        self.group_cursor = ""
        self.groups: frozenset[str] = frozenset()  # the groups the group cursor has followed since it was set
        self.enabled = True
        self.stream: aio.UnaryStreamCall | None = None  # the tail's SubscribeHistory stream, open from self.cursor
        self.stream_channel: Channel | None = None  # the channel it runs on
        self.unary_channel: Channel | None = None  # a channel whose service has no SubscribeHistory: long polls

    def apply(self, records: list[counts_pb2.HistoryRecord]) -> int:
        """Append what the drafter does not hold yet of ``records``, a source's parts in one call; return the tokens
        received (those appended and those held already are counted in the stats)."""
        drafter, now_ms = self.state.drafter, time.time() * 1000
        runs: OrderedDict[int, list[NDArray[np.int32]]] = OrderedDict()
        received = appended = restored = 0
        for r in records:
            tokens = bytes_to_tokens(r.tokens)
            received += len(tokens)
            parts = self.runs.fresh(r.client_id, r.seq, r.offset, tokens, r.group)
            if not parts:
                continue
            n = 0
            for source, part in parts:
                pieces = runs.get(source)
                if pieces is None:
                    runs[source] = [part]
                else:
                    pieces.append(part)
                n += len(part)
            appended += n
            restored += max(0, n - len(tokens))  # a prompt put in front
            time_ms = r.time_ms
            if time_ms:  # the lag to draftable: a record's first arrival only
                self.lag.add(max(0.0, now_ms - time_ms))
        for source, pieces in runs.items():
            drafter.add_history(source, pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
        drafter.flush_history(HELD_IDLE_SECONDS)
        with self.state.lock:
            self.stats.appended_tokens += appended
            self.stats.restored_tokens += restored
            self.stats.repeated_tokens += received + restored - appended
        return received

    async def _pull(self, what: str, request: counts_pb2.PullHistoryRequest) -> counts_pb2.PullHistoryResponse:
        state, config = self.state, self.state.config

        async def call(chan: Channel) -> counts_pb2.PullHistoryResponse:
            resp: counts_pb2.PullHistoryResponse = await chan.counts.PullHistory(
                request, timeout=request.wait_ms / 1000 + config.rpc_timeout, metadata=state.metadata)
            return resp

        return await state.retrying(what, call)

    def _request(self, after: str, wait_ms: int, groups: list[str] | None = None) -> counts_pb2.PullHistoryRequest:
        config = self.state.config
        return counts_pb2.PullHistoryRequest(
            namespace=config.namespace, tokenizer_fingerprint=config.fingerprint, after=after,
            max_records=config.history_pull_records, wait_ms=wait_ms, exclude_client_id=self.state.client_id,
            groups=groups or [])

    async def _spend(self, size: int) -> None:
        rate = self.state.config.history_max_bytes_per_s
        if rate:
            await asyncio.sleep(size / rate)  # the budget: bytes/s on average, both pulls together

    async def pull_groups(self) -> None:
        """The live groups' records after the group cursor, when the tail is behind (else the cursor follows the tail)."""
        live = self.live.recent(self.groups_per_pull) if self.live is not None and self.groups_per_pull else []
        if not live or not self.behind:
            # The tail is at the head (or nothing is live): it brings the groups' records as soon as
            # anything else; a group pull would only fetch them twice.
            self.group_cursor, self.groups = self.cursor, frozenset()
            return
        groups = frozenset(live)
        if groups - self.groups:
            # A group newly live: what it wrote before the tail's position the tail brought already,
            # so its records are read from there on, in order (a sequence's parts then join one
            # text; MirroredRuns would keep records out of order apart, as separate texts).
            self.group_cursor = self.cursor
        self.groups = groups
        try:
            resp = await self._pull("PullHistory (live groups)", self._request(self.group_cursor, 0, live))
        except NgramCacheError as e:
            if e.retriable:
                raise
            # Refused for good (a service that will not take the filter): the tail alone must go on.
            log.warning("ngramcache client: the service refused the fleet history pull of this client's groups (%s); "
                        "pulling by the namespace's tail alone", e)
            self.groups_per_pull = 0
            return
        if any(r.group not in groups for r in resp.records):
            log.info("ngramcache client: the service ignores PullHistory's groups filter (a proxy that drops the "
                     "field, or another implementation): fleet history pulled by the namespace's tail alone")
            self.groups_per_pull = 0
        received = self.apply(list(resp.records))
        size = resp.ByteSize()
        self.group_cursor = resp.cursor
        with self.state.lock:
            self.stats.group_pulls += 1
            self.stats.group_pulled_records += len(resp.records)
            self.stats.group_pulled_tokens += received
            self.stats.group_pulled_bytes += size
            self.stats.group_cursor = self.group_cursor
        await self._spend(size)

    async def _read_tail(self, request: counts_pb2.PullHistoryRequest) -> counts_pb2.PullHistoryResponse:
        """The tail's next page after ``request.after``: the stream's next message (the stream opened if none runs on
        the current channel), or a PullHistory long poll on a channel whose service has no stream."""
        state, config = self.state, self.state.config
        patience = request.wait_ms / 1000 + config.rpc_timeout

        async def call(chan: Channel) -> counts_pb2.PullHistoryResponse:
            if chan is self.unary_channel:
                resp: counts_pb2.PullHistoryResponse = await chan.counts.PullHistory(
                    request, timeout=patience, metadata=state.metadata)
                return resp
            if self.stream is None or self.stream_channel is not chan:
                self.close_stream()
                # After a failure the retry comes here again: the stream reopens from the last cursor received.
                self.stream = chan.counts.SubscribeHistory(request, metadata=state.metadata)
                self.stream_channel = chan
                with state.lock:
                    self.stats.tail_streams += 1
            stream = self.stream
            try:
                # The service sends at least one message per wait_ms: silence past it plus rpc_timeout is a hung
                # replica, failed over as a unary call's deadline would be.
                message = await asyncio.wait_for(stream.read(), patience)
            except asyncio.TimeoutError:
                self.close_stream()
                raise aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, aio.Metadata(), aio.Metadata(),
                                      details=f"no SubscribeHistory message within {patience:g} s") from None
            except grpc.RpcError as e:
                self.close_stream()
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("ngramcache client: the service at %s has no SubscribeHistory (an older version); "
                         "fleet history read by PullHistory long polls", chan.address)
                self.unary_channel = chan
                return await call(chan)
            except BaseException:
                self.close_stream()  # cancelled (close, or a switch that closed the channel): reopened if called again
                raise
            if message is aio.EOF:  # the service ended the stream without an error: open another
                self.close_stream()
                raise aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(),
                                      details="the SubscribeHistory stream ended")
            assert isinstance(message, counts_pb2.PullHistoryResponse)
            return message

        return await state.retrying("SubscribeHistory", call)

    def close_stream(self) -> None:
        """Cancel the tail's stream (the next read opens another from the cursor)."""
        if self.stream is not None:
            self.stream.cancel()
        self.stream = self.stream_channel = None

    async def pull_tail(self) -> None:
        """The namespace's records after the cursor (the stream's next message, or a long poll)."""
        request = self._request(self.cursor, MIRROR_WAIT_MS)
        resp = await self._read_tail(request)
        received = self.apply(list(resp.records))
        size = resp.ByteSize()
        self.cursor = resp.cursor
        self.behind = len(resp.records) >= request.max_records or size >= _BEHIND_BYTES
        if resp.gap and request.after:
            log.info("ngramcache client: fleet history records were trimmed before this client read them (gap)")
        with self.state.lock:
            self.stats.pulled_records += len(resp.records)
            self.stats.pulled_tokens += received
            self.stats.pulled_bytes += size
            self.stats.gaps += int(resp.gap and bool(request.after))
            self.stats.cursor = self.cursor
        await self._spend(size)

    async def pull(self) -> None:
        """One round: the live groups first (while the tail is behind), then the tail."""
        await self.pull_groups()
        await self.pull_tail()

    async def run(self) -> None:
        async def step() -> None:
            await self.pull()

        if self.enabled:
            try:
                await self.state.forever("fleet history mirror", step)
            finally:
                stream = self.stream
                self.close_stream()
                if stream is not None:
                    # Let grpc end the cancelled call on this loop (its status task), not as a task the closed
                    # loop destroys pending.
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(stream.code(), 1.0)
