"""A small HTTP/1.1 reverse proxy whose upstream can be switched while it serves, so a server can be replaced with no failed request.

`llama-follow` runs llama-server on loopback ports behind it: requests go to the current
upstream; `switch` sends the next ones to another (those in flight finish where they
started, and `Upstream.in_flight` says when the old one is idle); with no upstream (a
server starting) requests wait up to ``hold_timeout`` for one instead of failing. A request
whose upstream fails before the first byte of its answer (refused, reset, closed: a server
stopping or dying) goes to the upstream that replaces it; a second such failure is a 502. Bodies are relayed as they come (streamed completions included), framed by
Content-Length, chunked encoding, or the end of the upstream's answer.

One HTTP/1.1 upstream connection per request (loopback: a connection costs tens of
microseconds), keep-alive towards clients. Not a general-purpose proxy: no HTTP/2, no
``Expect: 100-continue`` handling beyond relaying, no request pipelining (requests of one
client connection are answered in order, one at a time, as HTTP/1.1 clients send them).

Thread-safety: an `HttpProxy` belongs to the event loop that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["HttpProxy", "Upstream"]

log = logging.getLogger("ngramcache.client.http_proxy")  # a logger name that log configs can rely on, whatever folder holds the module

MAX_HEAD_BYTES = 64 * 1024  # a request or response head longer than this is refused (431 / 502)
RELAY_BYTES = 64 * 1024
REPLACE_SECONDS = 2.0  # how long a request its server failed waits for the server's replacement (a restart, a switch)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"})


class _BadMessage(Exception):
    """A malformed request or response head (the message says what)."""


class _NoAnswer(Exception):
    """The upstream failed before the first byte of its answer (the message says how)."""


@dataclass
class Upstream:
    """One server behind the proxy.

    Attributes:
        host, port: where it listens (loopback).
        headers: added to each of its answers (llama-follow's ``X-Ngramcache-Generation``).
        in_flight: requests sent to it and not yet answered whole.
    """

    host: str
    port: int
    headers: tuple[tuple[str, str], ...] = ()
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


@dataclass
class _Head:
    first: str  # the request or status line
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for k, v in self.headers if k.lower() == name for t in v.split(",")}


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """A request or response head, or None at a clean end of stream before its first byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise _BadMessage("the connection closed in the middle of a message head") from None
    except asyncio.LimitOverrunError:
        raise _BadMessage(f"a message head longer than {MAX_HEAD_BYTES} bytes") from None
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise _BadMessage(f"a malformed header line: {line[:80]!r}")
        headers.append((name.strip(), value.strip()))
    return _Head(lines[0], headers)


async def _relay_body(head: _Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      to_eof: bool) -> None:
    """Copies the body ``head`` frames from ``reader`` to ``writer`` as it comes (chunked, Content-Length, or to EOF)."""
    if "chunked" in head.tokens("transfer-encoding"):
        while True:
            size_line = await reader.readuntil(b"\r\n")
            writer.write(size_line)
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadMessage(f"a malformed chunk size {size_line[:40]!r}") from None
            if size == 0:  # the trailers, then an empty line
                while True:
                    line = await reader.readuntil(b"\r\n")
                    writer.write(line)
                    if line == b"\r\n":
                        await writer.drain()
                        return
            writer.write(await reader.readexactly(size + 2))
            await writer.drain()
    length = head.get("content-length")
    if length is not None:
        try:
            left = int(length)
        except ValueError:
            raise _BadMessage(f"Content-Length {length!r} is not a number") from None
        while left > 0:
            block = await reader.read(min(left, RELAY_BYTES))
            if not block:
                raise asyncio.IncompleteReadError(b"", left)
            writer.write(block)
            await writer.drain()
            left -= len(block)
        return
    if to_eof:
        while block := await reader.read(RELAY_BYTES):
            writer.write(block)
            await writer.drain()


def _encode_head(first: str, headers: list[tuple[str, str]]) -> bytes:
    return (first + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


def _forwarded(head: _Head) -> list[tuple[str, str]]:
    """The headers passed on: hop-by-hop ones (and those Connection names) dropped."""
    named = head.tokens("connection")
    return [(k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


class HttpProxy:
    """Serves HTTP on one address and forwards every request to the current `Upstream`.

    Args:
        hold_timeout: seconds a request waits for an upstream while there is none, before a 503.
        status: a callable whose dict the proxy answers itself at ``GET /ngramcache/status`` (JSON).
        health_paths: paths answered 503 at once while there is no upstream (a readiness probe
            must not wait): llama-server's ``/health`` and ``/v1/health``.
    """

    def __init__(self, hold_timeout: float = 120.0, status: Callable[[], dict[str, object]] | None = None,
                 health_paths: tuple[str, ...] = ("/health", "/v1/health")) -> None:
        self.hold_timeout = hold_timeout
        self.status = status
        self.health_paths = health_paths
        self.upstream: Upstream | None = None
        self._ready = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.requests = 0  # answered by an upstream
        self.failed = 0  # answered by the proxy with an error (502, 503), or cut
        self.held_seconds = 0.0  # the longest a request waited for an upstream

    def switch(self, upstream: Upstream | None) -> None:
        """Send the next requests to ``upstream`` (None: hold them until an upstream is set)."""
        self.upstream = upstream
        if upstream is None:
            self._ready.clear()
        else:
            self._ready.set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _acquire(self) -> Upstream | None:
        """The current upstream, counted in flight at once (so a drain sees it); waits while there is none."""
        if self.upstream is None:
            t0 = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready.wait(), self.hold_timeout)
            self.held_seconds = max(self.held_seconds, time.monotonic() - t0)
        up = self.upstream
        if up is not None:
            up.begin()
        return up

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await _read_head(reader)
                except _BadMessage as e:
                    await self._error(writer, 400, f"bad request: {e}")
                    return
                if head is None:
                    return
                keep = await self._one(head, reader, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, head: _Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answers one request; returns whether the client connection stays open."""
        parts = head.first.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._error(writer, 400, f"bad request line {head.first[:80]!r}")
            return False
        method, target, version = parts
        keep = "close" not in head.tokens("connection") and (version == "HTTP/1.1" or
                                                              "keep-alive" in head.tokens("connection"))
        path = target.split("?", 1)[0]
        if path == "/ngramcache/status" and method == "GET" and self.status is not None:
            await self._answer(writer, 200, self.status(), keep)
            return keep
        if path in self.health_paths and self.upstream is None:
            await self._answer(writer, 503, {"error": {"code": 503, "type": "unavailable_error", "message":
                               "no llama-server is ready behind ngramcache llama-follow (starting or restarting)"}},
                               keep)
            return keep
        if "100-continue" in head.tokens("expect"):  # the client (curl, past 1 KB) waits for this before its body
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        try:  # read whole before an upstream is chosen, so a refused connection can be retried with it
            body = await _read_body(head, reader)
        except _BadMessage as e:
            await self._error(writer, 400, f"bad request: {e}")
            return False
        length = [("Content-Length", str(len(body)))] if body or head.get("content-length") is not None else []
        request = _encode_head(head.first, [*((k, v) for k, v in _forwarded(head)
                                              if k.lower() not in ("content-length", "transfer-encoding", "expect")),
                                            *length, ("Connection", "close")]) + body
        deadline = time.monotonic() + self.hold_timeout
        resent = False
        while True:
            up = await self._acquire()
            if up is None:
                self.failed += 1
                await self._answer(writer, 503, {"error": {"code": 503, "type": "unavailable_error", "message":
                                   f"no llama-server became ready within {self.hold_timeout:g} s "
                                   "(ngramcache llama-follow --hold-timeout)"}}, keep)
                return keep
            try:
                try:
                    up_reader, up_writer = await asyncio.open_connection(up.host, up.port, limit=MAX_HEAD_BYTES)
                except OSError as e:
                    # Refused before a byte went out: the server is stopping or died; the supervisor
                    # switches or restarts, and the request goes to whichever upstream is current then.
                    failure = str(e)
                else:
                    try:
                        return await self._exchange(up_reader, up_writer, request, method, writer, keep, up.headers)
                    except _NoAnswer as e:
                        failure = str(e)
                        if resent:
                            deadline = 0.0  # sent twice, unanswered twice: not sent a third time
                        resent = True
            finally:
                up.end()
            # Not a byte of an answer reached the client: the request can go to the server that replaces this one
            # (a request that died with its server is sent once more, to the next one).
            if time.monotonic() < deadline and await self._replaced(up, deadline):
                continue
            self.failed += 1
            await self._error(writer, 502, f"the llama-server behind ngramcache llama-follow failed: {failure}")
            return False

    async def _replaced(self, up: Upstream, deadline: float) -> bool:
        """Waits (at most REPLACE_SECONDS, and not past ``deadline``) for the current upstream to be another than ``up``."""
        until = min(deadline, time.monotonic() + REPLACE_SECONDS)
        while self.upstream is up and time.monotonic() < until:
            await asyncio.sleep(0.02)
        return self.upstream is not up

    async def _exchange(self, up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, request: bytes,
                        method: str, writer: asyncio.StreamWriter, keep: bool,
                        extra: tuple[tuple[str, str], ...]) -> bool:
        sent_head = False
        try:
            up_writer.write(request)
            await up_writer.drain()
            while True:
                resp = await _read_head(up_reader)
                if resp is None:
                    raise _BadMessage("the server closed the connection without an answer")
                status = resp.first.split(" ", 2)
                code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
                if 100 <= code < 200 and code != 101:
                    continue  # an interim answer (100 Continue): the body was sent whole already
                break
            no_body = method == "HEAD" or code in (204, 304)
            framed = no_body or "chunked" in resp.tokens("transfer-encoding") or resp.get("content-length") is not None
            keep = keep and framed
            writer.write(_encode_head(resp.first, [*_forwarded(resp), *extra,
                                                   ("Connection", "keep-alive" if keep else "close")]))
            sent_head = True
            if not no_body:
                await _relay_body(resp, up_reader, writer, to_eof=not framed)
            await writer.drain()
            self.requests += 1
            return keep
        except (_BadMessage, ConnectionError, asyncio.IncompleteReadError) as e:
            if not sent_head:
                raise _NoAnswer(str(e) or type(e).__name__) from None
            self.failed += 1
            return False  # a body cut in the middle: closing is the only way to say so
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()

    async def _answer(self, writer: asyncio.StreamWriter, code: int, payload: dict[str, object], keep: bool) -> None:
        body = json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 502: "Bad Gateway", 503: "Service Unavailable"}.get(code, "")
        writer.write(_encode_head(f"HTTP/1.1 {code} {reason}", [
            ("Content-Type", "application/json; charset=utf-8"), ("Content-Length", str(len(body))),
            ("Connection", "keep-alive" if keep else "close")]) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _error(self, writer: asyncio.StreamWriter, code: int, message: str) -> None:
        await self._answer(writer, code, {"error": {"code": code, "type": "proxy_error", "message": message}}, False)


async def _read_body(head: _Head, reader: asyncio.StreamReader) -> bytes:
    """A request's body read whole (chunked encoding decoded); empty when it has none."""
    if "chunked" in head.tokens("transfer-encoding"):
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadMessage(f"a malformed chunk size {line[:40]!r}") from None
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers: dropped
                return bytes(out)
            out += (await reader.readexactly(size + 2))[:-2]
    length = head.get("content-length")
    try:
        n = int(length or 0)
    except ValueError:
        raise _BadMessage(f"Content-Length {length!r} is not a number") from None
    return await reader.readexactly(n) if n > 0 else b""
