"""The client's health checks against real services on loopback: a busy client lets its acknowledged pushes stand for
the check, an idle one checks every interval, and a busy client still leaves a replica that drains."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.redis_servers import free_port
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration

FP = b"\x09" * 32
VOCAB = 1000
FAST = {"pull_interval": 0.05, "push_interval": 0.05, "connect_timeout": 5.0, "ready_timeout": 20.0,
        "close_timeout": 5.0, "failover_timeout": 3.0}  # checks every second
CHECK = "/grpc.health.v1.Health/Check"


def checks(svc: ServiceThread) -> float:
    """Health Check calls the service ended so far."""
    assert svc.service is not None and svc.service.metrics is not None
    value = svc.service.metrics.registry.get_sample_value("ngramcache_rpc_total", {"method": CHECK, "code": "OK"})
    return value or 0.0


def create(address: str) -> str:
    name = "health-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
            name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


class Busy(threading.Thread):
    """Accepts a few new tokens every 20 ms, as an engine does (so the client pushes every push_interval)."""

    def __init__(self, client: NgramClient) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.stop_event = threading.Event()

    def run(self) -> None:
        rng = np.random.default_rng(3)
        drafter = self.client.drafter()
        seq, text = 0, rng.integers(0, VOCAB, 8, dtype=np.int32)
        while not self.stop_event.wait(0.02):
            if len(text) > 400:
                seq, text = seq + 1, text[:0]
            text = np.concatenate([text, rng.integers(0, VOCAB, 4, dtype=np.int32)])
            drafter.accept(seq, text)


def test_a_busy_client_makes_fewer_health_checks_and_an_idle_one_checks_every_second(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0") as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        spare = f"127.0.0.1:{free_port()}"  # a second address, so the client watches its replica's health
        with NgramClient([address, spare], ns, (FP, VOCAB), cache_dir=tmp_path / "c", **FAST) as client:
            time.sleep(1.5)
            before = checks(svc)
            time.sleep(4.0)
            idle = checks(svc) - before
            busy = Busy(client)
            busy.start()
            try:
                wait_until(lambda: client.stats()["acked_rows"] > 0, 10.0, "the first push")
                time.sleep(0.5)
                before, acked = checks(svc), client.stats()["acked_count"]
                time.sleep(4.0)
                during = checks(svc) - before
                assert client.stats()["acked_count"] > acked  # it was pushing all along
            finally:
                busy.stop_event.set()
                busy.join(5)
            assert client.stats()["address"] == address
        # Idle: a check a second (4 in 4 s, give or take the edges); busy: the pushes answer for the replica.
        assert 3 <= idle <= 5 and during <= 1, (idle, during)


def test_a_busy_client_leaves_a_draining_replica(tmp_path: Path, redis_standalone: object) -> None:
    url = redis_standalone.url  # type: ignore[attr-defined]
    with ServiceThread(tmp_path / "one", counts=url) as first, ServiceThread(tmp_path / "two", counts=url) as second:
        addresses = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
        ns = create(addresses[0])
        with NgramClient(addresses, ns, (FP, VOCAB), cache_dir=tmp_path / "c", **FAST) as client:
            busy = Busy(client)
            busy.start()
            try:
                wait_until(lambda: client.stats()["acked_rows"] > 0, 10.0, "the first push")
                assert client.stats()["address"] == addresses[0]
                # A drain: NOT_SERVING, new calls refused, the calls in flight (the history stream) held for the grace.
                stopping = threading.Thread(target=first.stop, args=(10.0,))
                started = time.monotonic()
                stopping.start()
                wait_until(lambda: client.stats()["address"] == addresses[1], 10.0, "the client to leave the replica")
                took = time.monotonic() - started
                wait_until(lambda: client.stats()["acked_count"] > 0 and client.stats()["pending_rows"] < 10_000, 10.0,
                           "pushes on the second replica")
            finally:
                busy.stop_event.set()
                busy.join(5)
            stopping.join(20)
            s = client.stats()
            assert took < FAST["failover_timeout"] + 1.5 and s["dropped_rows"] == 0, (took, s)
