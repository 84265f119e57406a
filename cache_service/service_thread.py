"""ServiceThread: the service inside this process, on an asyncio loop of its own thread (for the demo, tests and programs that embed it)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any

from ngramcache.client.kernel.errors import NgramCacheError
from ngramcache.client.kernel.tasks import cancel_until_done

from .config import ServiceConfig
from .server import Service, create_server

__all__ = ["ServiceThread"]


class ServiceThread:
    """Runs `create_server(config)` on a new event loop in a daemon thread; a context manager.

    The calling thread stays free (to wait on workers, to drive clients). `port` is the bound
    port once started, `service` the running `Service`: touch it only through `run`/`call`,
    which execute on the service's loop.

    Thread-safety: `start` and `stop` from one thread; `run` and `call` from any thread except
    the service's own.

    Args:
        config: the service's settings (port 0 binds a free port).
        start_timeout: seconds the service may take to start.
    """

    def __init__(self, config: ServiceConfig, *, start_timeout: float = 60.0) -> None:
        self.config = config
        self.port = 0
        self.service: Service | None = None
        self._start_timeout = start_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ngramcache-service", daemon=True)
        self._starting: concurrent.futures.Future[tuple[Service, int]] | None = None

    def start(self) -> ServiceThread:
        """Starts the loop's thread and the service; returns self.

        Raises:
            NgramCacheError: the service did not start within ``start_timeout``.
            Exception: whatever `create_server` raised (nothing is left running then).
        """
        self._thread.start()
        self._starting = asyncio.run_coroutine_threadsafe(create_server(self.config), self._loop)
        try:
            self.service, self.port = self._starting.result(self._start_timeout)
        except BaseException as e:  # cannot listen, interrupted, ...: no thread or loop outlives the error
            self.stop()
            if isinstance(e, concurrent.futures.TimeoutError):
                raise NgramCacheError(f"the service did not start within {self._start_timeout:g} s") from None
            raise
        return self

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Runs ``coro`` on the service's loop; returns its result.

        Raises:
            NgramCacheError: it took longer than ``timeout`` seconds (it is cancelled).
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise NgramCacheError(f"the service's step took longer than {timeout:g} s") from None

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Runs ``await fn(*args)`` on the service's loop and returns its result (30 s at most)."""
        async def call() -> Any:
            return await fn(*args)

        return self.run(call())

    def stop(self, grace: float = 1.0) -> None:
        """Stops the service (in-flight calls get ``grace`` seconds; the embedded store writes its snapshot), then
        the loop and its thread. Safe to call twice, and while `start` is still waiting."""
        starting = self._starting
        if self.service is None and starting is not None and starting.done() and not starting.cancelled() \
                and starting.exception() is None:
            self.service = starting.result()[0]  # started while the caller was being interrupted
        elif starting is not None and not starting.done():
            starting.cancel()
        if not self._thread.is_alive():
            if not self._loop.is_closed() and not self._loop.is_running():
                self._loop.close()
            return
        if self.service is not None:
            with contextlib.suppress(Exception):
                self.run(self.service.stop(grace=grace), grace + 15)
            self.service = None

        async def cancel_rest() -> None:
            await cancel_until_done([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])
            await self._loop.shutdown_asyncgens()
            await self._loop.shutdown_default_executor()

        with contextlib.suppress(Exception):
            self.run(cancel_rest(), 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ServiceThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
