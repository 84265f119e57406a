"""The pusher under overload: a shed batch is sent again unchanged after the hinted wait, the rate halves and grows back, drops are counted and logged once per interval."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from helpers.service import ServerThread

from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.errors import OverloadedError
from ngramcache.client.sync import ClientConfig
from ngramcache.client.sync.pusher import Pusher, PushRate
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.transport import error_from_rpc

FP = b"\x07" * 32


def rows(*entries: tuple[int, int, int]) -> np.ndarray:
    out = np.full((len(entries), 7), -1, dtype=np.int32)
    for i, (t0, follower, count) in enumerate(entries):
        out[i, 0], out[i, 1], out[i, 5], out[i, 6] = 1, t0, follower, count
    return out


class SheddingCounts(counts_pb2_grpc.CountsServicer):
    """Sheds the first ``shed`` pushes (OVERLOADED, retry-after ``hint``), then acknowledges; records every request."""

    def __init__(self, shed: int, hint: float = 0.05) -> None:
        self.shed, self.hint = shed, hint
        self.requests: list[counts_pb2.PushRequest] = []

    async def Push(self, request: counts_pb2.PushRequest, context: aio.ServicerContext) -> counts_pb2.PushResponse:
        self.requests.append(request)
        if len(self.requests) <= self.shed:
            raise OverloadedError("busy", retry_after=self.hint)
        return counts_pb2.PushResponse(units=1, applied_units=1, entries=1, version=1)


class FakeDrafter:
    def drain_deltas(self) -> np.ndarray:
        return np.empty((0, 7), np.int32)


def pusher(address: str, tmp_path: Path, **options: object) -> Pusher:
    config = ClientConfig(addresses=(address,), namespace="n", fingerprint=FP, vocab_size=10, cache_dir=str(tmp_path),
                          rpc_timeout=5.0, **options)  # type: ignore[arg-type]
    return Pusher(SyncState(config, FakeDrafter()))  # type: ignore[arg-type]


async def send(p: Pusher, seq: int, batch: np.ndarray, until: float | None = None) -> None:
    p.in_flight += 1
    try:
        await p.send(seq, batch, until)
    finally:
        await p.state.channels.close()


def test_the_wire_carries_the_reason_and_the_hint(tmp_path: Path) -> None:
    servicer = SheddingCounts(shed=1, hint=0.25)
    with ServerThread([(counts_pb2_grpc.add_CountsServicer_to_server, servicer)]) as server:
        stub = counts_pb2_grpc.CountsStub(server.channel())
        with pytest.raises(grpc.RpcError) as caught:
            stub.Push(counts_pb2.PushRequest(namespace="n"), timeout=5)
    err = error_from_rpc(caught.value)
    assert type(err) is OverloadedError and err.retriable
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(caught.value.trailing_metadata())["ngc-retry-after-ms"] == "250"


def test_a_shed_batch_is_sent_again_unchanged_after_the_hint_and_the_rate_halves(tmp_path: Path) -> None:
    servicer = SheddingCounts(shed=3, hint=0.05)
    batch = rows((1, 2, 3), (4, 5, 1))
    with ServerThread([(counts_pb2_grpc.add_CountsServicer_to_server, servicer)]) as server:
        p = pusher(server.address, tmp_path, max_unacked=8, max_batch_rows=4096)
        loop = asyncio.new_event_loop()
        try:
            started = loop.time()
            loop.run_until_complete(send(p, 7, batch))
            took = loop.time() - started
        finally:
            loop.close()
    assert len(servicer.requests) == 4
    assert {(r.client_id, r.seq, r.rows) for r in servicer.requests} == {(p.state.client_id, 7, servicer.requests[0].rows)}
    s = p.state.stats
    assert (s.overloaded, s.acked_rows, s.acked_count, s.dropped_rows) == (3, 2, 4, 0)
    assert took >= 3 * 0.05 and s.retry_wait_seconds >= 3 * 0.05  # it waited the hint each time
    # Three sheds within one hint of each other are one burst: one halving, then one ack's growth.
    assert s.overload_waits >= 1
    assert p.rate.window < 8 and p.rate.batch_rows < 4096


def test_a_batch_still_shed_when_close_runs_out_of_time_is_dropped_and_counted(tmp_path: Path) -> None:
    servicer = SheddingCounts(shed=10**6, hint=0.05)
    with ServerThread([(counts_pb2_grpc.add_CountsServicer_to_server, servicer)]) as server:
        p = pusher(server.address, tmp_path)
        loop = asyncio.new_event_loop()
        try:
            until = loop.time() + 0.3  # the pusher's clock is time.monotonic, as the loop's
            loop.run_until_complete(send(p, 0, rows((1, 2, 3)), until))
        finally:
            loop.close()
    s = p.state.stats
    assert s.acked_rows == 0 and (s.dropped_rows, s.dropped_count) == (1, 3) and s.overloaded >= 2
    assert len({r.seq for r in servicer.requests}) == 1


def test_aimd_halves_once_per_burst_and_grows_back_slowly() -> None:
    rate = PushRate(max_window=8, max_rows=65536, min_rows=256)
    assert (rate.in_flight, rate.batch_rows) == (8, 65536)
    assert rate.overloaded(now=10.0, hold=0.1)
    assert not rate.overloaded(now=10.05, hold=0.1)  # the same burst
    assert (rate.in_flight, rate.batch_rows) == (4, 32768)
    for t in (11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0):
        rate.overloaded(now=t, hold=0.1)
    assert (rate.in_flight, rate.batch_rows) == (1, 256)  # floors
    rate.acknowledged()
    assert rate.window == 2.0 and rate.batch_rows == 256 + 4096
    for _ in range(200):
        rate.acknowledged()
    assert (rate.in_flight, rate.batch_rows) == (8, 65536)  # ceilings
    rate.limit(4, 1000)
    assert (rate.in_flight, rate.batch_rows) == (4, 1000)


def test_take_batch_follows_the_rate(tmp_path: Path) -> None:
    p = pusher("127.0.0.1:1", tmp_path, max_batch_rows=1024)
    p.pending.append(rows(*[(i, i, 1) for i in range(1000)]))
    p.pending_rows = 1000
    p.rate.overloaded(now=1.0, hold=0.1)
    p.rate.min_rows = 1
    p.rate.overloaded(now=2.0, hold=0.1)
    batch = p.take_batch()
    assert batch is not None and len(batch) == 256 and p.pending_rows == 744


def test_drops_are_logged_once_per_interval_with_the_numbers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = pusher("127.0.0.1:1", tmp_path, max_pending_rows=2)
    caplog.set_level(logging.WARNING, "ngramcache.client.sync")
    for k in range(5):
        p.pending.append(rows((10 * k, 1, 1), (10 * k + 1, 1, 2), (10 * k + 2, 1, 3)))
        p.pending_rows += 3
        p.shrink()
    lines = [r.getMessage() for r in caplog.records if "push buffer full" in r.getMessage()]
    assert len(lines) == 1 and "dropped 1 rows (1 n-gram occurrences)" in lines[0]  # the first, at once
    assert p.state.stats.dropped_rows == 1 + 4 * 3
    p.log_drops(force=True)
    lines = [r.getMessage() for r in caplog.records if "push buffer full" in r.getMessage()]
    assert len(lines) == 2 and "dropped 12 rows" in lines[1] and "13 in all" in lines[1]
