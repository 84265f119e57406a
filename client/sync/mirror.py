"""The mirror: the drafter's dynamic table kept a copy of the service's draft view (or of every count), by pulling what changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import numpy as np
from grpc import aio
from numpy.typing import NDArray

from ngramcache.client._core import CountTable
from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.kernel.errors import BackendUnavailableError, ResyncRequiredError
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import bytes_to_count_rows
from ngramcache.client.wire.transport import Channel

__all__ = ["PULL_WAIT_MS", "Mirror"]

log = logging.getLogger("ngramcache.client.sync")

PULL_WAIT_MS = 2000
"""How long the draft view's follow stream goes without a batch while the view has nothing new (an empty one then;
silence past it plus ``pull_interval`` and ``rpc_timeout`` is a hung replica), and how long a Pull of a service from before ``follow``
waits for the view's next change. (A service from before the wait answers at once; the client then pulls every
``pull_interval``.)"""


class Mirror:
    """Pulls the namespace's counts into `table`, the drafter's dynamic table (a task of the background loop).

    ``mirror="draft"`` follows the service's draft view on one long-lived Pull stream
    (``PullRequest.follow``): the service sends each update of the view as a batch of chunks (a
    reset swaps in a new table), at least ``pull_interval`` after the last one (the changes of
    that time go as one batch), and an empty batch after `PULL_WAIT_MS` without any; silence past
    that plus ``pull_interval`` and ``rpc_timeout`` is taken for a hung replica. A stream that fails is opened again
    from the last version applied, on the channel the retries and failover choose; one that ends
    after an answer (a service from before ``follow``) is followed by another Pull
    ``pull_interval`` later, as each pull was before. ``"full"`` pulls every count of the store
    (a version no longer reachable reloads it whole) every ``pull_interval``.
    """

    def __init__(self, state: SyncState, table: CountTable) -> None:
        self.state = state
        self.table = table
        self.ready = asyncio.Event()  # set after the first complete pull
        self.stream: aio.UnaryStreamCall | None = None  # the draft view's last follow stream

    async def pull(self, table: CountTable, since: int | None) -> int:
        """Apply one Pull of the store's counts (export or changes) to ``table``; return the version to resume from."""
        state, config = self.state, self.state.config

        async def call(chan: Channel) -> int:
            request = counts_pb2.PullRequest(namespace=config.namespace, tokenizer_fingerprint=config.fingerprint)
            if since is not None:
                request.since_version = since
            version: int | None = None
            with state.lock:
                state.stats.mirror_pulls += 1
            async for chunk in chan.counts.Pull(request, timeout=max(30.0, config.rpc_timeout),
                                                metadata=state.metadata):
                rows = bytes_to_count_rows(chunk.rows)
                self.count_pulled(rows, chunk.ByteSize())
                if len(rows):
                    table.assign_rows(rows)
                if chunk.complete:
                    version = chunk.version
            if version is None:
                raise BackendUnavailableError("Pull ended before its last chunk")
            return version

        return await state.retrying("Pull", call)

    async def follow_view(self) -> None:
        """Follow the draft view on one Pull stream from the last version applied (``stats.mirror_version``,
        ``stats.view_id``), applying each complete batch: its changes, or the whole view into a new table swapped
        in (reset). Returns when the service ends the stream after its answers (a service that ignores
        ``follow``); failures reopen it as the retries and failover decide."""
        state, config = self.state, self.state.config
        # The service sends a batch at least every pull_interval + PULL_WAIT_MS: silence past that plus rpc_timeout
        # is a hung replica, failed over as a unary call's deadline would be.
        patience = config.pull_interval + PULL_WAIT_MS / 1000 + config.rpc_timeout

        async def call(chan: Channel) -> None:
            since = state.stats.mirror_version
            request = counts_pb2.PullRequest(namespace=config.namespace, tokenizer_fingerprint=config.fingerprint,
                                             view=counts_pb2.PULL_VIEW_DRAFT, view_id=state.stats.view_id,
                                             wait_ms=PULL_WAIT_MS, follow=True,
                                             min_interval_ms=round(config.pull_interval * 1000))
            if since is not None:
                request.since_version = since
            # No deadline: the stream lasts as long as the client (see patience).
            stream = self.stream = chan.counts.Pull(request, metadata=state.metadata)
            with state.lock:
                state.stats.mirror_pulls += 1
            target: CountTable | None = None
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(stream.read(), patience)
                    except asyncio.TimeoutError:
                        raise aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, aio.Metadata(), aio.Metadata(),
                                              details=f"no Pull message within {patience:g} s") from None
                    if chunk is aio.EOF:
                        if target is not None:
                            raise BackendUnavailableError("Pull ended before its last chunk")
                        return  # ended after a whole answer: a service that does not follow
                    assert isinstance(chunk, counts_pb2.PullResponse)
                    if target is None:
                        target = CountTable() if chunk.reset else self.table
                    rows = bytes_to_count_rows(chunk.rows)
                    self.count_pulled(rows, chunk.ByteSize())
                    if len(rows):
                        target.assign_rows(rows, zero_removes=True)
                    if not chunk.complete:
                        continue
                    if target is not self.table:
                        if state.stats.mirror_version is not None:
                            log.info("ngramcache client: draft view reloaded (view %s)", chunk.view_id[:8])
                            with state.lock:
                                state.stats.resyncs += 1
                        state.drafter.set_dynamic(target)
                        self.table = target
                    target = None
                    with state.lock:
                        state.stats.mirror_version, state.stats.view_id = chunk.version, chunk.view_id
                        state.stats.mirror_last_ok = time.monotonic()
                    self.ready.set()
            finally:
                # A no-op once ended; else (an error, close, a switch) the service stops sending. self.stream stays,
                # for close_view to let grpc end the call.
                stream.cancel()

        await state.retrying("Pull", call)

    async def close_view(self) -> None:
        """Cancel the last follow stream and let grpc end the call on this loop (at most 1 s), not as a task the
        closed loop destroys pending."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(stream.code(), 1.0)

    def count_pulled(self, rows: NDArray[np.int64], size: int) -> None:
        with self.state.lock:
            self.state.stats.pulled_rows += len(rows)
            self.state.stats.pulled_bytes += size

    async def run(self) -> None:
        state, config = self.state, self.state.config

        async def step() -> None:
            version = state.stats.mirror_version
            if config.mirror == "draft":
                await self.follow_view()
                await asyncio.sleep(config.pull_interval)  # the stream ended after one answer: an older service
                return
            try:
                version = await self.pull(self.table, version)
            except ResyncRequiredError:
                log.info("ngramcache client: mirror resync (version %s no longer reachable)", version)
                fresh = CountTable()
                version = await self.pull(fresh, None)
                state.drafter.set_dynamic(fresh)
                self.table = fresh
                with state.lock:
                    state.stats.resyncs += 1
            with state.lock:
                state.stats.mirror_version = version
                state.stats.mirror_last_ok = time.monotonic()
            self.ready.set()
            await asyncio.sleep(config.pull_interval)

        try:
            await state.forever("mirror", step)
        finally:
            await self.close_view()
