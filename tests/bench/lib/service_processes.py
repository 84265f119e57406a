"""bench_service.py's server processes: the bare gRPC echo server (its baseline), `ngramcache serve` with one or more
workers, each started on a free loopback port read from its first line, and stopping them."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

ECHO_SERVER = r'''
import asyncio, sys
import grpc
from grpc import aio

def handler():
    async def session(request_iterator, context):
        async for req in request_iterator:
            yield b"\0" * int(sys.argv[2])
    return grpc.stream_stream_rpc_method_handler(session, request_deserializer=None, response_serializer=None)

async def main():
    server = aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Session": handler()})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
'''


def start_process(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", p.stdout.readline())
    if not m:
        p.kill()
        raise SystemExit(f"{args[0]} did not start")
    return p, int(m.group(1))



def start_workers(serve: list[str], workers: int, data_dir: Path) -> tuple[subprocess.Popen[str], int, list[int]]:
    """`serve --workers N`; returns the process, its port and the pids of the processes serving (the parent
    for N = 1, its workers otherwise)."""
    args = [*serve, "--data-dir", str(data_dir), "--workers", str(workers)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)(?: \((\d+) workers, pids ([\d, ]+)\))?", line)
    if not m:
        p.kill()
        raise SystemExit(f"serve --workers {workers} did not start: {line!r}")
    pids = [int(x) for x in m.group(3).split(",")] if m.group(3) else [p.pid]
    assert len(pids) == workers, line
    return p, int(m.group(1)), pids


def stop_process(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()

