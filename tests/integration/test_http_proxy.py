"""HttpProxy on loopback against a small upstream: framing (Content-Length, chunked both ways, to EOF), keep-alive,
Expect: 100-continue, held requests, /health with no upstream, a switch between upstreams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from ngramcache.client.tools.http_proxy import HttpProxy, Upstream


async def upstream_server(name: str) -> tuple[asyncio.Server, int, list[bytes]]:
    """An HTTP/1.1 server answering every request with JSON naming itself and echoing the body it got.

    ``POST /stream`` answers chunked; ``POST /eof`` answers with no length, closing at the end."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        path = head.split(b" ")[1]
        payload = json.dumps({"server": name, "body": body.decode()}).encode()
        if path == b"/stream":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Trailer-Test: 1\r\n\r\n")
            for part in (payload[:5], payload[5:]):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        elif path == b"/eof":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    code = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return code, headers, body
            body += (await reader.readexactly(size + 2))[:-2]
    if "content-length" in headers:
        return code, headers, await reader.readexactly(int(headers["content-length"]))
    return code, headers, await reader.read()


def run(test: Callable[[HttpProxy, int, list[int], list[list[bytes]]], Awaitable[None]], hold: float = 5.0) -> None:
    async def main() -> None:
        ups = [await upstream_server(n) for n in ("a", "b")]
        proxy = HttpProxy(hold_timeout=hold, status=lambda: {"ok": True})
        port = await proxy.start("127.0.0.1", 0)
        try:
            await test(proxy, port, [u[1] for u in ups], [u[2] for u in ups])
        finally:
            await proxy.close()
            for server, _, _ in ups:
                server.close()

    asyncio.run(main())


def test_framings_and_keep_alive_on_one_connection():
    async def test(proxy: HttpProxy, port: int, ups: list[int], seen: list[list[bytes]]) -> None:
        proxy.switch(Upstream("127.0.0.1", ups[0], (("X-Ngramcache-Generation", "7"),)))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /plain HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        code, headers, body = await read_response(reader)
        assert code == 200 and json.loads(body) == {"server": "a", "body": "hello"}
        assert headers["x-ngramcache-generation"] == "7" and headers["connection"] == "keep-alive"
        # A chunked request body reaches the server with a Content-Length; a chunked answer comes back chunked.
        writer.write(b"POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        code, headers, body = await read_response(reader)
        assert code == 200 and json.loads(body) == {"server": "a", "body": "abcde"}
        assert b"content-length: 5" in seen[0][-1].lower() and b"transfer-encoding" not in seen[0][-1].lower()
        # An answer framed by the end of the connection closes the client's connection too.
        writer.write(b"GET /eof HTTP/1.1\r\nHost: x\r\n\r\n")
        code, headers, body = await read_response(reader)
        assert code == 200 and json.loads(body)["server"] == "a" and headers["connection"] == "close"
        writer.close()

    run(test)


def test_expect_100_continue_is_answered_before_the_body_is_sent():
    """curl sends `Expect: 100-continue` with a body over 1 KB and waits (1 s) for the 100 before sending it."""
    async def test(proxy: HttpProxy, port: int, ups: list[int], seen: list[list[bytes]]) -> None:
        proxy.switch(Upstream("127.0.0.1", ups[0]))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b"x" * 2000
        writer.write(b"POST /plain HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        code, _, answer = await read_response(reader)
        assert code == 200 and json.loads(answer)["body"] == body.decode()
        assert b"expect" not in seen[0][-1].lower()  # the server gets the body with the head: no 100 to wait for
        writer.close()

    run(test)


def test_requests_wait_for_an_upstream_then_follow_the_switch():
    async def test(proxy: HttpProxy, port: int, ups: list[int], seen: list[list[bytes]]) -> None:
        async def get(path: str) -> tuple[int, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            code, _, body = await read_response(reader)
            writer.close()
            return code, body

        code, body = await get("/health")  # no upstream: the readiness probe gets 503 at once, not a wait
        assert code == 503 and b"no llama-server is ready" in body
        assert await get("/ngramcache/status") == (200, b'{"ok": true}')
        held = asyncio.create_task(get("/plain"))
        await asyncio.sleep(0.2)
        assert not held.done()  # held while there is no upstream
        proxy.switch(Upstream("127.0.0.1", ups[0]))
        code, body = await held
        assert code == 200 and json.loads(body)["server"] == "a"
        proxy.switch(Upstream("127.0.0.1", ups[1]))
        code, body = await get("/plain")
        assert json.loads(body)["server"] == "b"

    run(test)


def test_a_request_held_past_the_hold_timeout_gets_503():
    async def test(proxy: HttpProxy, port: int, ups: list[int], seen: list[list[bytes]]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
        code, _, body = await read_response(reader)
        assert code == 503 and b"no llama-server became ready within 0.2 s" in body
        assert proxy.failed == 1
        writer.close()

    run(test, hold=0.2)
