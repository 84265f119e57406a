"""What the sync tasks share: the config, the drafter, the failover channel, the counters under one lock, and how a task is retried."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ngramcache.client._core import Drafter
from ngramcache.client.kernel.errors import NgramCacheError, OverloadedError
from ngramcache.client.kernel.retry import retry
from ngramcache.client.sync.config import ClientConfig
from ngramcache.client.wire.transport import Channel, FailoverChannel, auth_metadata, channel_credentials

__all__ = ["SyncState", "SyncStats"]

log = logging.getLogger("ngramcache.client.sync")

T = TypeVar("T")


@dataclasses.dataclass
class SyncStats:
    """The counters `NgramClient.stats` reports; read and written under `SyncState.lock`."""

    generation: int = 0
    mirror_version: int | None = None
    view_id: str = ""
    mirror_last_ok: float = 0.0
    mirror_pulls: int = 0  # Pull calls of the mirror (mirror="draft": one follow stream, again after a failure)
    pulled_rows: int = 0
    pulled_bytes: int = 0
    resyncs: int = 0
    drained_rows: int = 0
    drained_count: int = 0
    pushed_rows: int = 0
    acked_rows: int = 0
    acked_count: int = 0
    duplicate_batches: int = 0
    dropped_rows: int = 0
    dropped_count: int = 0  # the n-gram occurrences in dropped_rows (never applied)
    # Given up after an attempt that may have been applied (a deadline, or close cancelling a call in
    # flight): drained_count = acked_count + dropped_count + unconfirmed_count + pending, and the store
    # holds between acked_count and acked_count + unconfirmed_count of them.
    unconfirmed_rows: int = 0
    unconfirmed_count: int = 0
    overloaded: int = 0  # pushes the service shed (OVERLOADED, nothing applied; each sent again)
    overload_waits: int = 0  # times the pusher halved its rate for it (once per burst of sheds)
    retry_wait_seconds: float = 0.0  # seconds shed pushes waited before being sent again (summed over batches)
    reconnects: int = 0
    downloads: int = 0
    downloaded_bytes: int = 0
    address: str = ""


class SyncState:
    """The state the static sync, the mirror and the pusher share, on the client's background loop.

    Thread-safety: touch it only from the background loop, except `stats`, which any thread
    may read under `lock`.
    """

    def __init__(self, config: ClientConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.stats = SyncStats()
        self.client_id = f"ngc-{uuid.uuid4().hex}"  # pushes are exactly once per (client_id, seq)
        self.lock = threading.Lock()  # guards stats (and the pusher's buffer size) for readers
        self.metadata = auth_metadata(config.token)
        self.channels = FailoverChannel(config.addresses, channel_credentials(config.tls_ca, config.tls_cert, config.tls_key),
                                        config.backoff, self._switched)
        self.closing: asyncio.Event | None = None  # set (on the loop) when the client closes

    def _switched(self, address: str, reconnect: bool) -> None:
        with self.lock:
            self.stats.address = address
            self.stats.reconnects += int(reconnect)

    def cancelled_by_us(self) -> bool:
        """Whether a CancelledError is this task's own cancellation (closing), not a call that grpc
        cancelled because its channel was closed by a switch to another address."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+
        if cancelling is not None and cancelling() > 0:
            return True
        return self.closing is not None and self.closing.is_set() and cancelling is None

    async def retrying(self, what: str, call: Callable[[Channel], Awaitable[T]], until: float | None = None,
                       overloaded: Callable[[OverloadedError], float | None] | None = None) -> T:
        """`FailoverChannel.retrying` with this client's notion of its own cancellation."""
        return await self.channels.retrying(what, call, until, self.cancelled_by_us, overloaded)

    async def once(self, what: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` until it completes once; every failure is logged and retried after a backoff (never fatal)."""
        await retry(body, functools.partial(self._failed, what), errors=(Exception, asyncio.CancelledError))

    async def forever(self, what: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` again and again, each time as `once` does (the backoff starts again after a success)."""
        while True:
            await self.once(what, body)

    def _failed(self, what: str, e: BaseException, attempt: int) -> float | None:
        """The wait after ``body`` failed: a longer one for an error retrying cannot cure, None for our own cancellation."""
        if isinstance(e, asyncio.CancelledError):
            if self.cancelled_by_us():
                return None
            log.debug("ngramcache client: %s cancelled by a channel switch; again", what)  # not fatal
            return 0.05
        if isinstance(e, NgramCacheError):
            log.warning("ngramcache client: %s failed: %s", what, e)
            return self.config.backoff.delay(attempt + 1) + (0.0 if e.retriable else 1.0)
        log.error("ngramcache client: %s failed", what, exc_info=e)  # e.g. OSError: the node's cache folder is full
        return 1.0 + self.config.backoff.delay(attempt + 1)
