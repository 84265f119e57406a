"""Real grpc.aio servers for tests: given servicers behind the service's ErrorInterceptor, on 127.0.0.1 port 0.

No fixtures here: tests build the servicers they need and either await `start_server` in
their own event loop (``asyncio.run``), or use `ServerThread`, which runs the server's loop
in a thread so a test talks to it through ordinary synchronous gRPC channels::

    with ServerThread([(counts_pb2_grpc.add_CountsServicer_to_server, servicer)]) as server:
        stub = counts_pb2_grpc.CountsStub(server.channel())

`ServiceThread` runs the whole service instead (`create_server` with a `ServiceConfig`);
`start_serve` runs `ngramcache serve` as a process, as a user does.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio

from ngramcache.cache_service import service_thread
from ngramcache.cache_service.config import ServiceConfig
from ngramcache.cache_service.interceptors.errors import ErrorInterceptor

__all__ = ["SERVE_CLI", "Registration", "ServerThread", "ServiceThread", "start_serve", "start_server", "stop_serve"]

T = TypeVar("T")

Registration = tuple[Callable[[Any, aio.Server], None], object]
"""(generated ``add_<Service>Servicer_to_server`` function, servicer instance)."""


# `ngramcache serve` as the console script runs it (entry.main: gRPC's C-core log lines off, so a --log-json
# server's stderr holds only JSON lines), with this interpreter.
SERVE_CLI = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]


def start_serve(data_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    """Starts `ngramcache serve --port 0 --data-dir DATA_DIR EXTRA...`; returns the process and its port."""
    p = subprocess.Popen([*SERVE_CLI, "serve", "--port", "0", "--data-dir", str(data_dir), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    assert m, (line, p.stderr.read() if p.poll() is not None and p.stderr else "")
    return p, int(m.group(1))


def stop_serve(p: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Sends `sig` to a `start_serve` process and waits; returns its exit status and stderr."""
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    return p.returncode, err


async def start_server(registrations: Iterable[Registration], *,
                       interceptors: Sequence[aio.ServerInterceptor] = (),
                       options: Sequence[tuple[str, Any]] = ()) -> tuple[aio.Server, int]:
    """Build, bind (127.0.0.1, a free port) and start a grpc.aio server on the running loop.

    Args:
        registrations: the servicers to serve, with their generated add functions.
        interceptors: more interceptors, inside the ErrorInterceptor (which sees every
            exception the handlers and these interceptors raise).
        options: gRPC channel arguments of the server (e.g. message size limits).

    Returns:
        (the started server, its port). Stop it with ``await server.stop(grace)``.
    """
    server = aio.server(interceptors=[ErrorInterceptor(), *interceptors], options=list(options))
    for add, servicer in registrations:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("could not bind a port on 127.0.0.1")
    await server.start()
    return server, port


class ServerThread:
    """A `start_server` server whose event loop runs in a daemon thread; a context manager.

    Servicers are called on that loop, so build them before `start` (nothing in their
    constructors may need a running loop) or inside `run`.

    Args: as `start_server`.
    """

    def __init__(self, registrations: Iterable[Registration], *,
                 interceptors: Sequence[aio.ServerInterceptor] = (),
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self._registrations = list(registrations)
        self._interceptors = interceptors
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-grpc-server", daemon=True)
        self._channels: list[grpc.Channel] = []
        self.server: aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        self.server, self.port = self.run(start_server(self._registrations, interceptors=self._interceptors,
                                                       options=self._options))
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60) -> T:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def channel(self) -> grpc.Channel:
        """A synchronous channel to the server, closed by `stop`."""
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return channel

    def stop(self, grace: float | None = None) -> None:
        """Close the channels, stop the server (in-flight calls get ``grace`` seconds) and its loop."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._thread.is_alive():
            if self.server is not None:
                self.run(self.server.stop(grace))
            self.run(self._loop.shutdown_asyncgens())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceThread(service_thread.ServiceThread):
    """The service's own `ServiceThread` with the tests' defaults: loopback, a free port, ``data_dir``, and any
    other `ServiceConfig` setting as a keyword."""

    def __init__(self, data_dir: str | Path, **settings: Any) -> None:
        super().__init__(ServiceConfig(host="127.0.0.1", port=0, data_dir=str(data_dir), **settings), start_timeout=30)
        self.data_dir = Path(data_dir)


def wait_until(cond: Any, timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``cond()`` every 20 ms until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
