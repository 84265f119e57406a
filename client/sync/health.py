"""Failover from an unhealthy replica: the current replica's health checked every second; one that stops answering or says NOT_SERVING for `failover_timeout` seconds is left for the next address.

UNAVAILABLE already moves a call to the next address. A replica that hangs (stopped,
overloaded, partitioned) answers nothing: its calls only time out, and a mirror pull or push
would wait on it forever. The health check bounds that: after `failover_timeout` seconds
without a SERVING answer the client switches, and the calls in flight on the old channel are
cancelled and retried on the new one with the same (client id, seq), so exactly once holds.

A check is skipped while a push was acknowledged on the same channel within the last interval:
the replica then took a new call (a draining one refuses them) and its store answered (a store
it cannot reach is the other reason it says NOT_SERVING), which is what SERVING tells. A busy
client then makes a push's calls and no check; one that stops pushing is checked again within an
interval. Other answers do not count: a draft view Pull or a history page may come from the
replica's memory while its store is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ngramcache.client.sync.state import SyncState

__all__ = ["HealthWatch"]

log = logging.getLogger("ngramcache.client.sync")


class HealthWatch:
    """Checks the current replica's health and switches away from an unhealthy one (a task of the background loop)."""

    def __init__(self, state: SyncState) -> None:
        self.state = state
        self.skipped = 0  # checks skipped for a push acknowledged within the interval

    async def run(self) -> None:
        config = self.state.config
        if len(config.addresses) < 2:
            return  # nowhere to go: the calls' own retries are all there is
        interval = min(1.0, config.failover_timeout / 3)
        unhealthy_since: float | None = None
        epoch = -1
        while True:
            chan = self.state.channels.current()
            if chan.epoch != epoch:  # a new replica: judge it afresh
                epoch, unhealthy_since = chan.epoch, None
            if time.monotonic() - chan.stored_at < interval:
                healthy, why = True, ""  # a push was acknowledged just now: no check needed
                self.skipped += 1
            else:
                healthy, why = await self._check(chan.channel, max(interval, config.failover_timeout / 2))
            now = time.monotonic()
            if healthy:
                unhealthy_since = None
            elif unhealthy_since is None:
                unhealthy_since = now
            elif now - unhealthy_since >= config.failover_timeout:
                log.warning("ngramcache client: %s unhealthy for %.1f s (%s); failing over", chan.address,
                            now - unhealthy_since, why)
                await self.state.channels.switch(chan.epoch)
                continue
            await asyncio.sleep(interval)

    async def _check(self, channel: grpc.aio.Channel, timeout: float) -> tuple[bool, str]:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                    metadata=self.state.metadata)
        except asyncio.CancelledError:
            if self.state.cancelled_by_us():
                raise
            return True, "channel switched"  # another task moved on: the next check sees the new one
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.PERMISSION_DENIED):
                return True, ""  # a server without (or closed) health checks: judge it by its calls alone
            return False, e.code().name
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return True, ""
