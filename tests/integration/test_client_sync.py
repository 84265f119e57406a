"""NgramClient against the real service on loopback: generations fetched, shared and swapped; counts shared; restarts survived."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB
from helpers.corpus import motif_corpus as corpus
from helpers.service import ServiceThread, wait_until

from ngramcache import (
    CountTable,
    Drafter,
    NamespaceNotFoundError,
    NgramClient,
    StaticCache,
    TokenizerMismatchError,
    build_static_from_tokens,
)
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.kernel.rows import COUNT
from ngramcache.client.wire.codec import bytes_to_count_rows

pytestmark = pytest.mark.integration



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Fleet:
    """A running service, its stubs, and helpers to create namespaces and publish generations."""

    tmp: Path
    svc: ServiceThread
    channel: grpc.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.svc.port}"

    def namespace(self) -> str:
        name = "c-" + uuid.uuid4().hex[:8]
        admin_pb2_grpc.AdminStub(self.channel).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        return name

    def build(self, generation: int, seed: int) -> Path:
        path = self.tmp / f"build-{uuid.uuid4().hex}.ngc"
        build_static_from_tokens([corpus(seed + i) for i in range(3)], str(path), vocab_size=VOCAB, ngram_size=2,
                                 fingerprint=FP, generation=generation)
        return path

    def publish(self, namespace: str, generation: int, seed: int) -> Path:
        path = self.build(generation, seed)
        data = path.read_bytes()

        def requests() -> Iterator[static_files_pb2.PublishRequest]:
            yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace=namespace, generation=generation, size=len(data), sha256=hashlib.sha256(data).digest()))
            for off in range(0, len(data), 8192):
                yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=off,
                                                                                      data=data[off:off + 8192]))

        static_files_pb2_grpc.StaticFilesStub(self.channel).Publish(requests(), timeout=30)
        return path

    def store_total(self, namespace: str) -> int:
        stub = counts_pb2_grpc.CountsStub(self.channel)
        chunks = stub.Pull(counts_pb2.PullRequest(namespace=namespace, tokenizer_fingerprint=FP), timeout=30)
        return sum(int(bytes_to_count_rows(c.rows)[:, COUNT].sum()) for c in chunks)


def counts_url(tmp: Path) -> str:
    return f"embedded://{tmp / 'counts.snapshot'}?epoch_seconds=0"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with ServiceThread(tmp_path / "data", counts=counts_url(tmp_path), mirror_interval=0.05) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        yield Fleet(tmp_path, svc, ch)
        ch.close()


def test_fetches_maps_and_drafts_like_a_local_drafter(fleet: Fleet) -> None:
    ns = fleet.namespace()
    built = fleet.publish(ns, 1, seed=1)
    cache_dir = fleet.tmp / "cache"
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST) as nc:
        stats = nc.stats()
        assert stats["generation"] == 1 and stats["downloads"] == 1
        installed = cache_dir / ns / "1.ngc"
        assert installed.read_bytes() == built.read_bytes()
        local = Drafter(static=StaticCache.open(built), dynamic=CountTable())
        drafter = nc.drafter()
        assert drafter.static is not None and drafter.static.generation == 1
        text = corpus(1, 600)  # the motifs of the published corpus
        drafted = 0
        for i in range(10, len(text), 37):
            prefix = text[:i]
            mine = drafter.draft(1, prefix, 8)
            theirs = local.draft(1, prefix, 8)
            assert mine.tolist() == theirs.tolist()
            drafted += len(mine)
        assert drafted > 0


def test_counts_of_one_client_reach_another(fleet: Fleet) -> None:
    ns = fleet.namespace()
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=fleet.tmp / "a", **FAST) as a, \
            NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=fleet.tmp / "b", **FAST) as b:
        text = np.array([5, 6, 7, 8, 9, 10, 11, 12] * 4, dtype=np.int32)
        probe = np.array([1, 5, 6, 7], dtype=np.int32)
        assert b.drafter().draft(2, probe, 4).size == 0
        t0 = time.monotonic()
        a.drafter().accept(1, text)
        wait_until(lambda: b.drafter().draft(2, probe, 4).size > 0, 5.0, "B to draft A's counts")
        assert b.drafter().draft(2, probe, 4).tolist()[0] == 8
        assert time.monotonic() - t0 < 5.0
        wait_until(lambda: a.stats()["acked_rows"] > 0, 5.0, "A's push to be acknowledged")
        assert b.stats()["mirror_rows"] > 0


def test_new_generation_is_swapped_in_while_drafting(fleet: Fleet) -> None:
    ns = fleet.namespace()
    fleet.publish(ns, 1, seed=1)
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=fleet.tmp / "cache", **FAST) as nc:
        drafter = nc.drafter()
        text = corpus(7, 400)
        stop = threading.Event()
        failures: list[BaseException] = []
        drafts = [0]

        def loop() -> None:
            while not stop.is_set():
                try:
                    for i in range(8, len(text), 13):
                        drafter.draft(3, text[:i], 8)
                        drafts[0] += 1
                except BaseException as e:
                    failures.append(e)
                    return

        worker = threading.Thread(target=loop)
        worker.start()
        try:
            for gen in (2, 3, 4):
                fleet.publish(ns, gen, seed=gen * 10)
                wait_until(lambda g=gen: nc.stats()["generation"] == g, 10.0, f"generation {gen}")  # type: ignore[misc]
        finally:
            stop.set()
            worker.join()
        assert not failures and drafts[0] > 0
        assert drafter.static is not None and drafter.static.generation == 4
        # the current one and the K=2 newest are kept; older files removed
        assert sorted(p.name for p in (fleet.tmp / "cache" / ns).glob("*.ngc")) == ["3.ngc", "4.ngc"]


def test_clients_sharing_a_cache_dir_download_once(fleet: Fleet) -> None:
    ns = fleet.namespace()
    fleet.publish(ns, 1, seed=3)
    cache_dir = fleet.tmp / "shared"
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST) as first:
        path = cache_dir / ns / "1.ngc"
        before = path.stat()
        with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST) as second:
            assert first.stats()["downloads"] == 1
            assert second.stats()["downloads"] == 0 and second.stats()["downloaded_bytes"] == 0
            assert second.stats()["generation"] == 1
            after = path.stat()
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_clients_starting_together_download_once(fleet: Fleet) -> None:
    ns = fleet.namespace()
    fleet.publish(ns, 1, seed=6)
    cache_dir = fleet.tmp / "shared"
    clients: list[NgramClient] = []
    lock = threading.Lock()

    def start() -> None:
        nc = NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST)
        with lock:
            clients.append(nc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(clients) == 3
        assert sum(nc.stats()["downloads"] for nc in clients) == 1
        assert all(nc.stats()["generation"] == 1 for nc in clients)
    finally:
        for nc in clients:
            nc.close()


def test_download_resumes_from_a_truncated_part_file(fleet: Fleet) -> None:
    ns = fleet.namespace()
    built = fleet.publish(ns, 1, seed=4)
    data = built.read_bytes()
    cache_dir = fleet.tmp / "cache"
    (cache_dir / ns).mkdir(parents=True)
    half = len(data) // 2
    (cache_dir / ns / "1.ngc.part").write_bytes(data[:half])
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST) as nc:
        assert nc.stats()["generation"] == 1
        assert nc.stats()["downloaded_bytes"] == len(data) - half
        assert (cache_dir / ns / "1.ngc").read_bytes() == data
        assert not (cache_dir / ns / "1.ngc.part").exists()


def test_corrupt_part_file_is_fetched_again(fleet: Fleet) -> None:
    ns = fleet.namespace()
    built = fleet.publish(ns, 1, seed=5)
    data = built.read_bytes()
    cache_dir = fleet.tmp / "cache"
    (cache_dir / ns).mkdir(parents=True)
    (cache_dir / ns / "1.ngc.part").write_bytes(b"\xff" * (len(data) // 2))
    with NgramClient(fleet.address, ns, (FP, VOCAB), cache_dir=cache_dir, **FAST) as nc:
        assert nc.stats()["generation"] == 1
        assert (cache_dir / ns / "1.ngc").read_bytes() == data


def test_service_restart_loses_and_doubles_nothing(tmp_path: Path) -> None:
    port = free_port()

    def service() -> ServiceThread:
        svc = ServiceThread(tmp_path / "data", counts=counts_url(tmp_path), mirror_interval=0.05)
        svc.config = dataclasses.replace(svc.config, port=port)
        return svc

    address = f"127.0.0.1:{port}"
    text = corpus(11, 3000)
    with service():
        ch = grpc.insecure_channel(address)
        ns = "restart"
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=ns, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        ch.close()
        nc = NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST)
        drafter = nc.drafter()
        for i in range(50, 1000, 50):
            drafter.accept(1, text[:i])
        wait_until(lambda: nc.stats()["acked_rows"] > 0, 10.0, "a first push")
    try:
        # no service: drafting goes on, pushes wait
        for i in range(1000, 2000, 50):
            drafter.accept(1, text[:i])
            drafter.draft(1, text[:i], 8)
        time.sleep(0.5)
        offline = nc.stats()
        assert offline["acked_count"] < offline["drained_count"]  # these pushes wait for a service
        with service() as svc:
            for i in range(2000, 3000, 50):
                drafter.accept(1, text[:i])
            wait_until(lambda: nc.stats()["pending_rows"] == 0 and nc.stats()["acked_count"]
                       == nc.stats()["drained_count"] and nc.stats()["drained_count"] > 0, 20.0, "pushes to resume")
            stats = nc.stats()
            assert stats["dropped_rows"] == 0 and stats["reconnects"] >= 1
            fleet = Fleet(tmp_path, svc, grpc.insecure_channel(address))
            total = fleet.store_total(ns)
            fleet.channel.close()
            assert total == stats["acked_count"] == stats["drained_count"]
    finally:
        nc.close()


def test_wrong_tokenizer_is_refused(fleet: Fleet) -> None:
    ns = fleet.namespace()
    with pytest.raises(TokenizerMismatchError):
        NgramClient(fleet.address, ns, (b"\x01" * 32, VOCAB), cache_dir=fleet.tmp / "c", **FAST)
    with pytest.raises(TokenizerMismatchError):
        NgramClient(fleet.address, ns, (FP, VOCAB + 1), cache_dir=fleet.tmp / "c", **FAST)
    with pytest.raises(NamespaceNotFoundError):
        NgramClient(fleet.address, "no-such-ns", (FP, VOCAB), cache_dir=fleet.tmp / "c", **FAST)


def test_failover_to_the_next_address(fleet: Fleet) -> None:
    ns = fleet.namespace()
    dead = f"127.0.0.1:{free_port()}"
    with NgramClient([dead, fleet.address], ns, (FP, VOCAB), cache_dir=fleet.tmp / "c", **FAST) as nc:
        nc.drafter().accept(1, corpus(2, 200))
        wait_until(lambda: nc.stats()["acked_rows"] > 0, 10.0, "a push through the second address")
        assert nc.stats()["address"] == fleet.address and nc.stats()["reconnects"] >= 1


def test_a_service_that_is_down_is_reported_within_connect_timeout(tmp_path):
    import socket
    import time as _time

    from ngramcache import NgramClient
    from ngramcache.client.kernel.errors import BackendUnavailableError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = _time.monotonic()
    with pytest.raises(BackendUnavailableError, match=r"no ngramcache service answered at 127\.0\.0\.1:\d+ within 1 s"):
        NgramClient(f"127.0.0.1:{port}", "ns", (bytes(32), 10), cache_dir=str(tmp_path), connect_timeout=1.0)
    assert _time.monotonic() - t0 < 10


def test_close_counts_what_it_could_not_deliver(tmp_path: Path) -> None:
    """A replica that stops answering (SIGSTOP) while close() flushes: every n-gram occurrence the client
    drained is acknowledged, dropped (never applied) or unconfirmed (sent, no answer), pending_rows is 0
    afterwards, one log line says so, and once the replica runs again the store holds between the
    acknowledged and the acknowledged + unconfirmed occurrences."""
    import logging
    import signal

    from helpers.service import start_serve, stop_serve

    p, port = start_serve(tmp_path / "data")
    stopped = False
    try:
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="ns", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        client = NgramClient(address, "ns", (FP, VOCAB), cache_dir=tmp_path / "cache",
                             **{**FAST, "close_timeout": 3.0, "rpc_timeout": 30.0})
        client.drafter().accept(1, corpus(1))
        wait_until(lambda: client.stats()["acked_count"] == client.stats()["drained_count"] > 0, what="first pushes")
        os.kill(p.pid, signal.SIGSTOP)
        stopped = True
        client.drafter().accept(2, corpus(2))
        wait_until(lambda: client.stats()["pushed_rows"] > client.stats()["acked_rows"], what="a push in flight")
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("ngramcache").addHandler(handler)
        try:
            started = time.monotonic()
            client.close()
            took = time.monotonic() - started
        finally:
            logging.getLogger("ngramcache").removeHandler(handler)
        s = client.stats()
        assert took < 3.0 + 5.0, took
        assert s["pending_rows"] == 0, s
        assert s["unconfirmed_count"] > 0 and s["unconfirmed_rows"] > 0, s  # the push in flight
        assert s["drained_count"] == s["acked_count"] + s["dropped_count"] + s["unconfirmed_count"], s
        lines = [r.getMessage() for r in records if "could not deliver" in r.getMessage()]
        assert len(lines) == 1 and "dropped_rows" in lines[0] and "unconfirmed_rows" in lines[0], \
            [r.getMessage() for r in records]
        os.kill(p.pid, signal.SIGCONT)
        stopped = False

        def stored() -> int:
            with grpc.insecure_channel(address) as ch:
                chunks = counts_pb2_grpc.CountsStub(ch).Pull(
                    counts_pb2.PullRequest(namespace="ns", tokenizer_fingerprint=FP), timeout=30)
                return sum(int(bytes_to_count_rows(c.rows)[:, COUNT].sum()) for c in chunks)

        time.sleep(1.0)  # the replica finishes what it had taken before it stopped
        assert s["acked_count"] <= stored() <= s["acked_count"] + s["unconfirmed_count"], (stored(), s)
    finally:
        if stopped:
            os.kill(p.pid, signal.SIGCONT)
        stop_serve(p)


def test_a_hung_replica_is_left_within_failover_timeout(tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """Two replicas on one redis-server; the client's replica is stopped (SIGSTOP: it answers nothing,
    no UNAVAILABLE ever comes): the client moves to the other within failover_timeout and its pushes
    go on there, each counted once."""
    import signal

    from helpers.service import start_serve, stop_serve

    url = redis_standalone.url
    ns = "hung-" + uuid.uuid4().hex[:8]
    first, port1 = start_serve(tmp_path / "one", "--counts", url)
    second, port2 = start_serve(tmp_path / "two", "--counts", url)
    stopped = False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port1}") as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name=ns, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        addresses = [f"127.0.0.1:{port1}", f"127.0.0.1:{port2}"]
        with NgramClient(addresses, ns, (FP, VOCAB), cache_dir=tmp_path / "cache",
                         **{**FAST, "failover_timeout": 2.0}) as client:
            client.drafter().accept(1, corpus(1))
            wait_until(lambda: client.stats()["acked_count"] == client.stats()["drained_count"] > 0, what="pushes")
            assert client.stats()["address"] == addresses[0]
            os.kill(first.pid, signal.SIGSTOP)
            stopped = True
            started = time.monotonic()
            client.drafter().accept(2, corpus(2))
            wait_until(lambda: client.stats()["address"] == addresses[1], 15.0, "the client to leave the hung replica")
            took = time.monotonic() - started
            wait_until(lambda: client.stats()["acked_count"] == client.stats()["drained_count"], 20.0,
                       what="the pushes to be acknowledged by the second replica")
            s = client.stats()
            assert s["reconnects"] >= 1 and s["dropped_rows"] == 0, s
            assert took < 2.0 + 6.0, took
            wait_until(lambda: client.stats()["mirror_lag_seconds"] is not None
                       and client.stats()["mirror_lag_seconds"] < 2.0, 10.0, "the mirror to be fresh again")
        # Exactly once: the store holds every occurrence the client drained, no more.
        with grpc.insecure_channel(f"127.0.0.1:{port2}") as ch:
            chunks = counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=FP),
                                                         timeout=30)
            stored = sum(int(bytes_to_count_rows(c.rows)[:, COUNT].sum()) for c in chunks)
        assert stored == s["drained_count"], (stored, s)
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
        stop_serve(first)
        stop_serve(second)
