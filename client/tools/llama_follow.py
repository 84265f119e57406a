"""A llama-server kept on a namespace's newest static generation: its -lcs file rewritten and the server replaced, with no failed request.

llama-server reads its ``-lcs`` file once, when it starts (llama.cpp's
``common_speculative_impl_ngram_cache`` constructor; no signal or route reloads it), and two
servers cannot share a port. So `LlamaFollower` runs llama-server on a loopback port behind
an `HttpProxy` that listens where clients connect. When a generation lands (the
`NgramClient` it owns downloads and verifies it), the follower writes it as the -lcs file
(``export_llama``: a temporary file beside it, then a rename) and replaces the server:

- ``overlap`` (default): a second server starts with the new file on another port; once its
  /health answers 200 the proxy sends new requests to it, the old one finishes the requests
  it holds (up to ``drain_timeout``) and is stopped. Two servers (two copies of the model)
  live for the few seconds of the switch.
- ``restart``: new requests are held by the proxy, the old server finishes its requests and
  stops, the new one starts; the held requests go to it once it is ready (up to
  ``hold_timeout``). One copy of the model at a time; requests wait about one start.

The proxy answers /health with the server's own answer (503 while none is ready), so a
readiness probe on the proxy's port follows the server. A server that exits on its own is
started again (held requests wait for it). The service being unreachable never stops the
server: it serves with the last generation written (or none) while the client retries.

Thread-safety: one `LlamaFollower` runs on one event loop; `status` may be read from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ngramcache.client._core import StaticCache, export_llama
from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError
from ngramcache.client.kernel.retry import Schedule, retry
from ngramcache.client.tools.http_proxy import HttpProxy, Upstream

__all__ = ["GENERATION_HEADER", "SWITCH_MODES", "FollowConfig", "GenerationSource", "LlamaFollower", "check_server_command"]

log = logging.getLogger("ngramcache.client.llama_follow")  # a logger name that log configs can rely on, whatever folder holds the module

SWITCH_MODES = ("overlap", "restart")
# Arguments llama-follow gives llama-server itself: where it listens and which -lcs file it reads.
RESERVED = ("--host", "--port", "-lcs", "--lookup-cache-static", "--reuse-port")
GENERATION_HEADER = "X-Ngramcache-Generation"  # on every answer: the generation of the server that gave it
STOP_SECONDS = 20.0  # SIGTERM, then SIGKILL after this long
RESTART_BACKOFF = Schedule((1.0, 2.0, 5.0, 10.0, 30.0))  # seconds before restarting a server that keeps exiting
STOPPED = "was stopped before it was ready"  # wait_ready's answer when the follower is asked to stop


class _NotReady(Exception):
    """A llama-server that did not become ready; the message says why (exited, timed out, stopped)."""


class GenerationSource(Protocol):
    """Where the follower learns of generations: the newest installed one, and its file."""

    def latest(self) -> int:
        """The newest generation installed on this node (0: none yet)."""
        ...

    def path(self, generation: int) -> Path:
        """The installed file of ``generation``."""
        ...


def check_server_command(command: list[str]) -> None:
    """Refuses a llama-server command line that llama-follow cannot run as it must.

    Raises:
        InvalidArgumentError: no command, an argument llama-follow sets itself (--host, --port,
            -lcs), or no ``--spec-type`` naming ``ngram-cache`` (llama-server reads -lcs only then).
    """
    if not command:
        raise InvalidArgumentError("give the llama-server command after '--': ngramcache llama-follow ... -- "
                                   "llama-server -m MODEL --spec-type ngram-cache")
    for arg in command[1:]:
        name = arg.split("=", 1)[0]
        if name in RESERVED:
            raise InvalidArgumentError(f"llama-server argument {name}: llama-follow sets it (the server listens on a "
                                       "loopback port of its own and reads --lcs); use --listen for the address "
                                       "clients connect to")
    types: list[str] = []
    for i, arg in enumerate(command[1:], start=1):
        if arg == "--spec-type" and i + 1 < len(command):
            types += command[i + 1].split(",")
        elif arg.startswith("--spec-type="):
            types += arg.split("=", 1)[1].split(",")
    if "ngram-cache" not in (t.strip() for t in types):
        raise InvalidArgumentError("llama-server drafts from the -lcs file only with --spec-type ngram-cache: add it "
                                   "to the llama-server arguments")


@dataclasses.dataclass(frozen=True)
class FollowConfig:
    """Settings of a `LlamaFollower`.

    Attributes:
        command: llama-server and its arguments, without --host, --port and -lcs (`check_server_command`).
        lcs: the -lcs file written for every generation (its folder must be writable).
        listen_host, listen_port: where the proxy listens (0: a free port).
        switch: ``overlap`` or ``restart`` (the module docstring says what each costs).
        start_timeout: seconds a server may take to answer /health 200 before it counts as failed.
        drain_timeout: seconds an old server gets to finish its requests before it is stopped.
        hold_timeout: seconds a request waits for a ready server before the proxy answers 503.
        poll_interval: seconds between two looks at the newest generation.
        say: where progress lines go (one line each).
    """

    command: tuple[str, ...]
    lcs: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    switch: str = "overlap"
    start_timeout: float = 600.0
    drain_timeout: float = 600.0
    hold_timeout: float = 120.0
    poll_interval: float = 0.05
    say: Callable[[str], None] = print

    def __post_init__(self) -> None:
        if self.switch not in SWITCH_MODES:
            raise InvalidArgumentError(f"switch must be one of {', '.join(SWITCH_MODES)}, got {self.switch!r}")
        check_server_command(list(self.command))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _health(port: int) -> int:
    """The status of GET /health on 127.0.0.1:port (0: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, asyncio.TimeoutError):
        return 0
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 5)
        parts = line.split()
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    except (OSError, asyncio.TimeoutError):
        return 0
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class ServerProcess:
    """One llama-server child on a loopback port, its -lcs file fixed for its life."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, generation: int) -> None:
        self.proc = proc
        self.port = port
        self.generation = generation
        self.upstream = Upstream("127.0.0.1", port, ((GENERATION_HEADER, str(generation)),))
        self.started = time.monotonic()
        self.ready_seconds = 0.0

    @classmethod
    async def start(cls, command: tuple[str, ...], lcs: Path | None, generation: int) -> ServerProcess:
        port = _free_port()
        args = [*command, "--host", "127.0.0.1", "--port", str(port), *(["-lcs", str(lcs)] if lcs else [])]
        try:
            # Its own session: a Ctrl-C in a terminal reaches the follower, which stops it in order.
            proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                        start_new_session=True)
        except OSError as e:
            raise InvalidArgumentError(f"cannot run {command[0]}: {e.strerror or e} (the command after '--')") from None
        return cls(proc, port, generation)

    async def wait_ready(self, timeout: float, stop: asyncio.Event | None = None) -> str | None:
        """Waits for /health 200; returns None when ready, else why not (exited, timed out, ``stop`` set)."""
        deadline = time.monotonic() + timeout
        while True:
            if stop is not None and stop.is_set():
                return STOPPED
            if self.proc.returncode is not None:
                return f"exited with status {self.proc.returncode} before /health answered 200 (its output is above)"
            if await _health(self.port) == 200:
                self.ready_seconds = time.monotonic() - self.started
                return None
            if time.monotonic() > deadline:
                return f"did not answer /health 200 within {timeout:g} s (--start-timeout)"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 0.02)

    async def stop(self) -> None:
        """SIGTERM by its pid, SIGKILL after STOP_SECONDS."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_SECONDS)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


@dataclasses.dataclass
class FollowStats:
    """What `LlamaFollower.status` reports (also at GET /ngramcache/status on the proxy)."""

    generation: int = 0  # the generation the current server reads (0: none)
    written: int = 0  # the generation the -lcs file holds (a server started now reads it)
    latest: int = 0  # the newest generation installed on this node
    switches: int = 0  # servers replaced for a new generation
    restarts: int = 0  # servers started again after they exited on their own
    failed_starts: int = 0  # servers that did not become ready
    last_export_seconds: float = 0.0  # the last -lcs file's writing
    last_ready_seconds: float = 0.0  # the last server's exec to /health 200
    last_switch_seconds: float = 0.0  # the last generation's landing (seen here) to the proxy switched
    last_drain_seconds: float = 0.0  # the old server finishing its requests
    lcs_bytes: int = 0


class LlamaFollower:
    """Runs llama-server behind an `HttpProxy` and replaces it when ``source`` installs a newer generation.

    Args:
        config: the settings.
        source: the generations (an `NgramClient`'s, through `ClientGenerations`); None serves
            without one until `attach` gives it (the service was unreachable at start).
    """

    def __init__(self, config: FollowConfig, source: GenerationSource | None) -> None:
        self.config = config
        self.source = source
        self.stats = FollowStats()
        self.proxy = HttpProxy(config.hold_timeout, status=self.status)
        self.server: ServerProcess | None = None
        self.port = 0
        self._skipped = 0  # the newest generation given up (not written, or its server never ready): not retried
        self._draining: dict[asyncio.Task[None], ServerProcess] = {}  # old servers finishing their requests
        self.drain_on_stop = True  # False: stopping does not wait for the requests in flight (Ctrl-C)
        self._stop: asyncio.Event | None = None

    def attach(self, source: GenerationSource) -> None:
        self.source = source

    def status(self) -> dict[str, Any]:
        s = dataclasses.asdict(self.stats)
        s.update(ready=self.proxy.upstream is not None, server_port=self.server.port if self.server else None,
                 proxied_requests=self.proxy.requests, failed_requests=self.proxy.failed,
                 longest_hold_seconds=round(self.proxy.held_seconds, 3), switch=self.config.switch)
        return s

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then stop the server (after its requests, up to drain_timeout).

        Raises:
            NgramCacheError: the first server did not become ready (the message says why);
                the proxy's address cannot be listened on (OSError).
        """
        config = self.config
        self._stop = stop
        self.port = await self.proxy.start(config.listen_host, config.listen_port)
        config.say(f"listening on {config.listen_host}:{self.port}; llama-server runs behind it on a loopback port "
                   f"(switch: {config.switch})")
        try:
            latest = self.source.latest() if self.source else 0
            if latest:
                await self._write_lcs(latest)
            server = await self._start(self.stats.written)
            if server is None and stop.is_set():
                return
            if server is None:
                raise NgramCacheError(f"llama-server {self._why} (the command after '--')")
            self._serve(server)
            await self._follow(stop)
        finally:
            await self._shutdown()

    async def _follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            server = self.server
            assert server is not None
            if server.proc.returncode is not None:
                self.proxy.switch(None)  # requests are held while it starts again
                started = await self._restart(server, stop)
                if started is None:
                    return
                self.stats.restarts += 1
                self._serve(started)
                continue
            latest = self.source.latest() if self.source else 0
            self.stats.latest = max(self.stats.latest, latest)
            if latest > max(self.stats.generation, self._skipped):
                await self._switch(latest)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(server.proc.wait()), self.config.poll_interval)

    async def _restart(self, exited: ServerProcess, stop: asyncio.Event) -> ServerProcess | None:
        """A server started again after ``exited`` exited on its own, each try after the next delay of
        RESTART_BACKOFF; None once ``stop`` is set."""
        def again(delay: float) -> float:
            self.config.say(f"llama-server (generation {exited.generation}) exited with status "
                            f"{exited.proc.returncode}: starting it again in {delay:g} s")
            return delay

        async def start() -> ServerProcess | None:
            started = None if stop.is_set() else await self._start(self.stats.written)
            if started is None and not stop.is_set():
                raise _NotReady(self._why)
            return started

        def failed(e: _NotReady, attempt: int) -> float:
            self.config.say(f"llama-server {e}")
            return again(RESTART_BACKOFF.delay(attempt + 1))

        await self._wait(stop, again(RESTART_BACKOFF.delay(0)))
        return await retry(start, failed, errors=_NotReady, sleep=functools.partial(self._wait, stop))

    async def _wait(self, stop: asyncio.Event, seconds: float) -> bool:
        """Sleep ``seconds`` or until ``stop``; True when stopped."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        return stop.is_set()

    def _serve(self, server: ServerProcess) -> None:
        self.server = server
        self.stats.generation = server.generation
        self.stats.last_ready_seconds = round(server.ready_seconds, 3)
        self.proxy.switch(server.upstream)

    async def _start(self, generation: int) -> ServerProcess | None:
        """A ready server reading the -lcs file (none before the first generation), or None (`_why` says why).

        A server that exits before it is ready is tried once more, on a fresh port: the free port found may be
        taken before the server binds. Not one that timed out (trying again would take as long), nor on a stop.
        """
        lcs = self.config.lcs if generation else None

        async def start() -> ServerProcess:
            server = await ServerProcess.start(self.config.command, lcs, generation)
            why = await server.wait_ready(self.config.start_timeout, self._stop)
            if why is not None:
                await server.stop()
                self.stats.failed_starts += 1
                self._why = why
                raise _NotReady(why)
            return server

        try:
            server = await retry(start, lambda e, attempt: 0.0 if "exited" in str(e) else None, errors=_NotReady,
                                 attempts=2)
        except _NotReady:
            return None
        self.config.say(f"llama-server on 127.0.0.1:{server.port} ready in {server.ready_seconds:.2f} s "
                        f"({f'generation {generation}' if generation else 'no generation yet, no -lcs file'})")
        return server

    async def _write_lcs(self, generation: int) -> bool:
        """Export ``generation`` to the -lcs file (temporary file beside it, then rename); False on failure."""
        assert self.source is not None
        t0 = time.monotonic()
        try:
            def export() -> None:
                export_llama(StaticCache.open(self.source.path(generation)), self.config.lcs)  # type: ignore[union-attr]

            await asyncio.to_thread(export)
        except (NgramCacheError, OSError) as e:
            self.config.say(f"cannot write generation {generation} to {self.config.lcs}: {e}; the server keeps "
                            f"generation {self.stats.generation or 'none'}")
            self._skipped = generation
            return False
        self.stats.last_export_seconds = round(time.monotonic() - t0, 3)
        self.stats.lcs_bytes = os.path.getsize(self.config.lcs)
        self.stats.written = generation
        return True

    async def _switch(self, generation: int) -> None:
        """Replace the server with one reading ``generation`` (the switch mode decides how)."""
        t0 = time.monotonic()
        old = self.server
        assert old is not None
        previous = self.stats.generation
        if not await self._write_lcs(generation):
            return
        if self.config.switch == "overlap":
            new = await self._start(generation)
            if new is None and self._stopping():
                return
            if new is None:
                self._skipped = generation  # the next generation is tried; a restart reads the file meanwhile
                self.config.say(f"llama-server for generation {generation} {self._why}; the server of generation "
                                f"{previous or 'none'} keeps serving")
                return
            self._serve(new)
        else:
            self.proxy.switch(None)  # new requests wait for the new server
            await self._drain(old)
            new = await self._start(generation)
            if new is None and self._stopping():
                return
            if new is None:  # self.server is the stopped one: _follow starts it again, held requests wait
                self.config.say(f"llama-server for generation {generation} {self._why}; starting it again")
                return
            self._serve(new)
        self.stats.switches += 1
        self.stats.last_switch_seconds = round(time.monotonic() - t0, 3)
        self.config.say(f"generation {generation} served {self.stats.last_switch_seconds:.2f} s after it was "
                        f"installed (-lcs {self.stats.lcs_bytes / 1e6:.1f} MB written in "
                        f"{self.stats.last_export_seconds:.2f} s, server ready in {new.ready_seconds:.2f} s)")
        if self.config.switch == "overlap":  # the old server finishes its requests while this one serves
            task = asyncio.create_task(self._drain(old))
            self._draining[task] = old
            task.add_done_callback(lambda t: self._draining.pop(t, None))

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    async def _drain(self, old: ServerProcess, wait: bool = True) -> None:
        """Stop ``old`` once it has answered its requests (up to drain_timeout; at once without ``wait``)."""
        t0 = time.monotonic()
        if wait and old.upstream.in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(old.upstream.idle.wait(), self.config.drain_timeout)
        left = old.upstream.in_flight if wait else 0
        await old.stop()
        self.stats.last_drain_seconds = round(time.monotonic() - t0, 3)
        if left:
            self.config.say(f"the server of generation {old.generation} still had {left} request(s) after "
                            f"{self.config.drain_timeout:g} s (--drain-timeout): stopped with them")

    async def _shutdown(self) -> None:
        await self.proxy.close()
        server, self.server = self.server, None
        if server is not None:
            await self._drain(server, wait=self.drain_on_stop)  # Ctrl-C: stop now, requests or not
        if self._draining and not self.drain_on_stop:
            for task, old in list(self._draining.items()):
                task.cancel()
                await old.stop()
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)

    _why = ""


class ClientGenerations:
    """A `GenerationSource` over an `NgramClient`: the generation it has installed and attached, and its file."""

    def __init__(self, client: Any) -> None:
        from ngramcache.client.kernel.static_files import GenerationFiles

        self.client = client
        self.files = GenerationFiles(client.config.cache_dir, client.config.namespace)

    def latest(self) -> int:
        return int(self.client.stats()["generation"])

    def path(self, generation: int) -> Path:
        return self.files.path(generation)
