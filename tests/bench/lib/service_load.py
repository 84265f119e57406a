"""bench_service.py's load generators over gRPC: concurrent drafting sessions stepped one token at a time, pushes of
delta batches with a bound on those in flight, sessions held open for their memory, and Draft requests spread over
connections."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from grpc import aio

from bench.lib.proc_stats import rss_kib
from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc, drafting_pb2, drafting_pb2_grpc
from ngramcache.client.wire.codec import delta_rows_to_bytes, tokens_to_bytes

FP = bytes(32)
VOCAB = 256  # the "bench" namespace's: bytes as tokens


async def session_steps(port: int, sessions: int, steps: int, echo: bool, text: np.ndarray,
                        channels: int = 1) -> tuple[list[float], float]:
    """Runs `sessions` concurrent sessions of `steps` one-token steps; returns step latencies (s) and wall time.

    With `channels` > 1 the sessions are spread over that many separate connections (a local
    subchannel pool each), so that SO_REUSEPORT can spread them over a service's workers."""
    options = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else []
    pool = [aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(channels)]
    latencies: list[float] = []

    async def one(k: int) -> None:
        channel = pool[k % channels]
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
    for channel in pool:
        await channel.close()
    return latencies, wall


async def _queue_iter(queue: asyncio.Queue[object]):
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


def push_requests(namespace: str, client_id: str, batches: list[np.ndarray]) -> list[counts_pb2.PushRequest]:
    """The Push requests of one client (built before the clock starts: the client's encoding is not the service's cost)."""
    return [counts_pb2.PushRequest(namespace=namespace, tokenizer_fingerprint=FP, client_id=client_id, seq=seq,
                                   rows=delta_rows_to_bytes(rows)) for seq, rows in enumerate(batches)]


async def push_clients(port: int, clients: list[list[counts_pb2.PushRequest]], in_flight: int) -> float:
    """Each client pushes its requests with ``in_flight`` unanswered at most; returns the wall time."""
    channel = aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = counts_pb2_grpc.CountsStub(channel)

    async def client(requests: list[counts_pb2.PushRequest]) -> None:
        sem = asyncio.Semaphore(in_flight)

        async def one(request: counts_pb2.PushRequest) -> None:
            async with sem:
                reply = await stub.Push(request)
                assert not reply.duplicate

        await asyncio.gather(*(one(r) for r in requests))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(requests) for requests in clients))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return elapsed


async def hold_sessions(port: int, n: int, tokens_each: int, text: np.ndarray, pid: int) -> int:
    """Opens `n` sessions on the "bench" namespace (each stepped once with `tokens_each` tokens of `text` unless 0)
    and holds them; returns the RSS (KiB) of process `pid` while they are open."""
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


async def draft_many(port: int, contexts: list[np.ndarray], channels: int, namespace: str, vocab: int,
                     in_flight: int = 32) -> int:
    """Draft requests over `channels` separate connections, round robin; returns the drafted tokens."""
    pool = [aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(channels)]
    stubs = [drafting_pb2_grpc.DraftingStub(ch) for ch in pool]
    sem = asyncio.Semaphore(in_flight)
    drafted = 0

    async def one(i: int, ctx: np.ndarray) -> None:
        nonlocal drafted
        async with sem:
            reply = await stubs[i % channels].Draft(drafting_pb2.DraftRequest(
                namespace=namespace, tokenizer_fingerprint=FP, vocab_size=vocab, tokens=tokens_to_bytes(ctx),
                n_draft=8))
            drafted += len(reply.tokens) // 4

    await asyncio.gather(*(one(i, ctx) for i, ctx in enumerate(contexts)))
    for ch in pool:
        await ch.close()
    return drafted

