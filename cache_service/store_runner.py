"""StoreRunner: the one executor through which the async service calls the synchronous counts store."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .counts import CountsStore
from .metrics import Metrics

T = TypeVar("T")


class StoreRunner:
    """Runs `CountsStore` calls on a bounded thread pool, so no RPC blocks the event loop.

    Thread-safety: `call` may be awaited from any task of the server's loop; the store
    itself is thread-safe (both backends).

    Args:
        store: the counts store the service uses (embedded or Redis).
        max_workers: threads calling the store at once (Redis round trips overlap).
        metrics: where to count store latency and errors per call (None: nowhere).
    """

    def __init__(self, store: CountsStore, max_workers: int = 8, metrics: Metrics | None = None) -> None:
        self.store = store
        self._metrics = metrics
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ngc-store")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Awaits ``fn(*args, **kwargs)`` run on the store's pool (fn is usually a store method)."""
        loop = asyncio.get_running_loop()
        if self._metrics is None:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        with self._metrics.time_store(fn):  # store latency and errors per op
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Waits for running calls, then closes the store."""
        self._pool.shutdown(wait=True)
        self.store.close()
