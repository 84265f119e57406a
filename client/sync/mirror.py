"""The mirror: the drafter's dynamic table kept a copy of the service's draft view (or of every count), by pulling what changed."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import CountTable
from ngramcache.client._proto.codec import bytes_to_count_rows
from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.errors import BackendUnavailableError, ResyncRequiredError
from ngramcache.client.sync.state import SyncState
from ngramcache.client.transport import Channel

__all__ = ["PULL_WAIT_MS", "Mirror"]

log = logging.getLogger("ngramcache.client.sync")

PULL_WAIT_MS = 2000
"""How long a Pull of the draft view with nothing new waits on the service for the view's next change: an idle
client makes one call per wait instead of one per ``pull_interval``, and a change reaches it as soon as the
view takes it. (A service from before the wait answers at once; the client then pulls every ``pull_interval``.)"""


class Mirror:
    """Pulls the namespace's counts into `table`, the drafter's dynamic table (a task of the background loop).

    ``mirror="draft"`` pulls the service's draft view (a reset swaps in a new table), each pull
    ``pull_interval`` after the last answer, waiting up to `PULL_WAIT_MS` on the service while the
    view has nothing new; ``"full"`` every count of the store (a version no longer reachable
    reloads it whole), every ``pull_interval``.
    """

    def __init__(self, state: SyncState, table: CountTable) -> None:
        self.state = state
        self.table = table
        self.ready = asyncio.Event()  # set after the first complete pull

    async def pull(self, table: CountTable, since: int | None) -> int:
        """Apply one Pull of the store's counts (export or changes) to ``table``; return the version to resume from."""
        state, config = self.state, self.state.config

        async def call(chan: Channel) -> int:
            request = counts_pb2.PullRequest(namespace=config.namespace, tokenizer_fingerprint=config.fingerprint)
            if since is not None:
                request.since_version = since
            version: int | None = None
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

    async def pull_view(self, since: int | None, view_id: str) -> tuple[int, str]:
        """Apply one Pull of the draft view: its changes, or the whole view into a new table swapped in
        (reset); return the (version, view_id) to resume from."""
        state, config = self.state, self.state.config

        async def call(chan: Channel) -> tuple[int, str]:
            request = counts_pb2.PullRequest(namespace=config.namespace, tokenizer_fingerprint=config.fingerprint,
                                             view=counts_pb2.PULL_VIEW_DRAFT, view_id=view_id)
            if since is not None:
                request.since_version = since
                request.wait_ms = PULL_WAIT_MS
            target: CountTable | None = None
            async for chunk in chan.counts.Pull(request, timeout=max(30.0, config.rpc_timeout),
                                                metadata=state.metadata):
                if target is None:
                    target = CountTable() if chunk.reset else self.table
                rows = bytes_to_count_rows(chunk.rows)
                self.count_pulled(rows, chunk.ByteSize())
                if len(rows):
                    target.assign_rows(rows, zero_removes=True)
                if chunk.complete:
                    if target is not self.table:
                        if since is not None:
                            log.info("ngramcache client: draft view reloaded (view %s)", chunk.view_id[:8])
                            with state.lock:
                                state.stats.resyncs += 1
                        state.drafter.set_dynamic(target)
                        self.table = target
                    return chunk.version, chunk.view_id
            raise BackendUnavailableError("Pull ended before its last chunk")

        return await state.retrying("Pull", call)

    def count_pulled(self, rows: NDArray[np.int64], size: int) -> None:
        with self.state.lock:
            self.state.stats.pulled_rows += len(rows)
            self.state.stats.pulled_bytes += size

    async def run(self) -> None:
        state, config = self.state, self.state.config

        async def step() -> None:
            version = state.stats.mirror_version
            if config.mirror == "draft":
                version, view_id = await self.pull_view(version, state.stats.view_id)
                with state.lock:
                    state.stats.mirror_version, state.stats.view_id = version, view_id
                    state.stats.mirror_last_ok = time.monotonic()
                self.ready.set()
                await asyncio.sleep(config.pull_interval)
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

        await state.forever("mirror", step)
