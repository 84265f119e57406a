"""Benchmark of the gRPC service (issue 8): session steps against a bare echo server, pushes
against the counts store called directly, and memory per session.

Everything runs on this machine over loopback: the service is a real `ngramcache serve`
process, the baseline a bare grpc.aio bidirectional echo server (tests/bench/echo_server.py
logic, inline below) answering each message with one of the same size as a draft reply.

1. Session step: each of C concurrent sessions (C = 1, 16, 64) sends one new token per step
   and waits for the draft of 8 tokens; p50 / p99 step latency and steps/s over all
   sessions, side by side with the echo server under the same client code.
2. Push: real n-gram deltas (each CPython standard-library file counted as llama.cpp counts
   a sequence, 1..4-grams, in batches of --batch rows) pushed through the service into a
   local redis-server (client id + seq, exactly once, 8 in flight), against the same batches
   applied with `CountsStore.apply` directly from one process.
3. Memory: the service's RSS before and after opening 1000 idle sessions, and after 1000
   sessions of 1k tokens each; per session.

Figures are medians of --reps runs.

    python tests/bench/bench_service.py            # about 3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc import aio

from ngramcache import CountTable
from ngramcache.cache_service.counts import open_counts_store
from ngramcache.client._proto.codec import delta_rows_to_bytes, tokens_to_bytes
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    drafting_pb2,
    drafting_pb2_grpc,
)

FP = bytes(32)
VOCAB = 256
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

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


def stdlib_streams(limit: int) -> list[np.ndarray]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 4000)
    return [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int32) for p in files[:limit]]


def start_process(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", p.stdout.readline())
    if not m:
        p.kill()
        raise SystemExit(f"{args[0]} did not start")
    return p, int(m.group(1))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- session steps


async def session_steps(port: int, sessions: int, steps: int, echo: bool, text: np.ndarray) -> tuple[list[float], float]:
    """Runs `sessions` concurrent sessions of `steps` one-token steps; returns step latencies (s) and wall time."""
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    latencies: list[float] = []

    async def one(k: int) -> None:
        queue: asyncio.Queue[object] = asyncio.Queue()
        start = (k * 997) % (len(text) - steps - 64)
        if echo:
            call = channel.stream_stream("/bench.Echo/Session", request_serializer=None, response_deserializer=None)(
                _queue_iter(queue))
        else:
            call = drafting_pb2_grpc.DraftingStub(channel).Session(_queue_iter(queue))
            await queue.put(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
                namespace="bench", tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=8)))
            await call.read()  # opened
            await queue.put(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(
                tokens=tokens_to_bytes(text[start:start + 64]))))
            await call.read()
        for i in range(steps):
            tok = text[start + 64 + i: start + 65 + i]
            msg: object = (tokens_to_bytes(tok) if echo
                           else drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes(tok))))
            t0 = time.perf_counter()
            await queue.put(msg)
            await call.read()
            latencies.append(time.perf_counter() - t0)
        await queue.put(None)
        await call.read()  # end of stream

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(sessions)))
    wall = time.perf_counter() - t0
    await channel.close()
    return latencies, wall


async def _queue_iter(queue: asyncio.Queue[object]):
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


def bench_sessions(args: argparse.Namespace, service_port: int, echo_port: int, text: np.ndarray) -> None:
    print("\n## Session step: send 1 new token, receive a draft of 8 (echo: the same sizes, no work)")
    print(f"{'sessions':>8} {'server':>10} {'p50 us':>9} {'p99 us':>9} {'steps/s':>10}")
    for c in (1, 16, 64):
        steps = max(50, args.steps // c)
        res: dict[str, tuple[float, float, float]] = {}
        for name, port, echo in (("echo", echo_port, True), ("ngramcache", service_port, False)):
            p50s, p99s, rates = [], [], []
            asyncio.run(session_steps(port, c, 20, echo, text))  # warm-up
            for _ in range(args.reps):
                lat, wall = asyncio.run(session_steps(port, c, steps, echo, text))
                p50s.append(np.percentile(lat, 50) * 1e6)
                p99s.append(np.percentile(lat, 99) * 1e6)
                rates.append(len(lat) / wall)
            res[name] = (statistics.median(p50s), statistics.median(p99s), statistics.median(rates))
            print(f"{c:>8} {name:>10} {res[name][0]:>9.0f} {res[name][1]:>9.0f} {res[name][2]:>10.0f}")
        e, n = res["echo"], res["ngramcache"]
        print(f"{'':>8} {'ratio':>10} {n[0] / e[0]:>8.2f}x {n[1] / e[1]:>8.2f}x {n[2] / e[2]:>9.2f}x   "
              "(targets: p50 <= 1.5x echo, steps/s >= 0.7x echo)")


# ----------------------------------------------------------------------------- pushes


def delta_batches(streams: list[np.ndarray], batch: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    n = 0
    for s in streams:
        t = CountTable()
        t.update(s)
        rows = t.to_rows()
        pending.append(rows)
        n += len(rows)
        while n >= batch:
            allrows = np.concatenate(pending)
            out.append(np.ascontiguousarray(allrows[:batch]))
            pending, n = [allrows[batch:]], len(allrows) - batch
    if n:
        out.append(np.ascontiguousarray(np.concatenate(pending)))
    return out


async def push_all(port: int, namespace: str, batches: list[np.ndarray], in_flight: int) -> float:
    channel = aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = counts_pb2_grpc.CountsStub(channel)
    sem = asyncio.Semaphore(in_flight)

    async def one(seq: int, rows: np.ndarray) -> None:
        async with sem:
            await stub.Push(counts_pb2.PushRequest(namespace=namespace, tokenizer_fingerprint=FP, client_id="bench",
                                                   seq=seq, rows=delta_rows_to_bytes(rows)))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, b) for i, b in enumerate(batches)))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return elapsed


def bench_push(args: argparse.Namespace, service_port: int, redis_url: str, streams: list[np.ndarray]) -> None:
    batches = delta_batches(streams, args.batch)
    n_rows = sum(len(b) for b in batches)
    print(f"\n## Push: {n_rows:,} real n-gram delta rows ({len(streams)} files, 1..4-grams) in batches of "
          f"{args.batch:,}, into one local redis-server")
    admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{service_port}"))
    direct, service = [], []
    store = open_counts_store(redis_url)
    for rep in range(args.reps):
        ns = f"push{rep}"
        store.create_namespace(ns + "d", FP, VOCAB)
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            store.apply(ns + "d", "bench", i, b)
        direct.append(n_rows / (time.perf_counter() - t0))
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=ns + "s", tokenizer_fingerprint=FP, vocab_size=VOCAB))
        service.append(n_rows / asyncio.run(push_all(service_port, ns + "s", batches, 8)))
    store.close()
    d, s = statistics.median(direct), statistics.median(service)
    print(f"direct CountsStore.apply, one process: {d:,.0f} rows/s (runs: {', '.join(f'{x:,.0f}' for x in direct)})")
    print(f"through the service (Push, 8 in flight): {s:,.0f} rows/s (runs: {', '.join(f'{x:,.0f}' for x in service)})")
    print(f"ratio service / direct: {s / d:.2f}x   (target >= 0.8x)")


# ----------------------------------------------------------------------------- memory


async def hold_sessions(port: int, n: int, tokens_each: int, text: np.ndarray, pid: int) -> int:
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    stub = drafting_pb2_grpc.DraftingStub(channel)
    queues: list[asyncio.Queue[object]] = []
    calls = []
    for k in range(n):
        q: asyncio.Queue[object] = asyncio.Queue()
        call = stub.Session(_queue_iter(q))
        await q.put(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace="bench", tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=8)))
        await call.read()
        if tokens_each:
            start = (k * 7919) % (len(text) - tokens_each)
            await q.put(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(
                tokens=tokens_to_bytes(text[start:start + tokens_each]))))
            await call.read()
        queues.append(q)
        calls.append(call)
    await asyncio.sleep(0.5)
    rss = rss_kib(pid)
    for q in queues:
        await q.put(None)
    for call in calls:
        await call.read()
    await channel.close()
    return rss


def bench_memory(service: subprocess.Popen[str], port: int, text: np.ndarray) -> None:
    print("\n## Memory of the service process per session")
    base = rss_kib(service.pid)
    idle = asyncio.run(hold_sessions(port, 1000, 0, text, service.pid))
    time.sleep(0.5)
    base2 = rss_kib(service.pid)
    full = asyncio.run(hold_sessions(port, 1000, 1000, text, service.pid))
    print(f"RSS before: {base / 1024:.1f} MiB; with 1000 idle sessions: {idle / 1024:.1f} MiB "
          f"({(idle - base) / 1000:.1f} KiB a session)")
    print(f"with 1000 sessions of 1k tokens: {full / 1024:.1f} MiB ({(full - base2) / 1000:.1f} KiB a session)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    ap.add_argument("--steps", type=int, default=3000, help="session steps per run, over all sessions (default 3000)")
    ap.add_argument("--batch", type=int, default=10_000, help="rows per pushed batch (default 10000)")
    ap.add_argument("--files", type=int, default=120, help="standard-library files whose deltas are pushed")
    args = ap.parse_args()

    from redis_servers import RedisServer

    streams = stdlib_streams(args.files)
    text = np.concatenate(streams)
    tmp = Path(tempfile.mkdtemp(prefix="ngc-bench-service-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        with RedisServer() as redis_server:
            serve = [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())",
                     "serve", "--port", "0", "--data-dir", str(tmp / "data"), "--counts", redis_server.url,
                     "--max-push-rows", str(max(args.batch, 65536))]
            service, sport = start_process(serve)
            procs.append(service)
            echo, eport = start_process([sys.executable, "-c", ECHO_SERVER, "x", "40"])
            procs.append(echo)
            ch = grpc.insecure_channel(f"127.0.0.1:{sport}")
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="bench", tokenizer_fingerprint=FP, vocab_size=VOCAB))
            for i, rows in enumerate(delta_batches(streams[:40], 50_000)):  # dynamic counts: drafts are real
                counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
                    namespace="bench", tokenizer_fingerprint=FP, client_id="seed", seq=i,
                    rows=delta_rows_to_bytes(rows)))
            time.sleep(2.5)  # a mirror refresh
            print(f"service pid {service.pid} on port {sport}, echo pid {echo.pid} on port {eport}; "
                  f"{os.cpu_count()} CPUs shared by clients and servers")
            bench_sessions(args, sport, eport, text)
            bench_push(args, sport, redis_server.url, streams)
            bench_memory(service, sport, text)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
