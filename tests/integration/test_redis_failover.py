"""Through a Redis failover: the master holding a namespace's keys dies mid-push, its replica is promoted.

Each test runs `ngramcache serve` on loopback over a replicated Redis (a Cluster with a
replica per master, or a primary and a replica under three Sentinels), two clients pushing
batches of counts (every failed push is sent again, same seq, until acknowledged) and one
drafting. The master holding the namespace's keys is SIGKILLed mid-push and left dead.
Afterwards the store is compared with what the clients were acknowledged, key by key:
over-counted must be 0; acknowledged but missing is 0 with ``--counts-min-replicas 1`` and
printed without it. Generation numbers and fencing tokens committed before the failover
are never handed out again after it, and pushes are acknowledged again soon after the
promotion. The last test stops the replica (SIGSTOP) to show what the setting changes
deterministically: without it a push is acknowledged while no replica holds it; with it the
push fails (retriable) until the replica holds it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.redis_servers import RedisClusterProcesses, RedisSentinelGroup, RedisServer
from helpers.service import start_serve, stop_serve

from ngramcache.cache_service.counts import open_counts_store
from ngramcache.cache_service.counts.schema import meta_key
from ngramcache.client._proto.codec import delta_rows_to_bytes
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc, drafting_pb2, drafting_pb2_grpc
from ngramcache.client.errors import BackendUnavailableError

pytestmark = pytest.mark.integration

NS = "failover"
FP = bytes(range(32))
VOCAB = 256
CLIENTS = 2
ROWS = 64  # rows a batch
NODE_TIMEOUT_MS = 1000
STORE = {"socket_timeout": 5, "retries": 1}


def batch(rng: np.random.Generator) -> np.ndarray:
    """ROWS delta rows of 2-grams (n=1): random context token and follower, count 1..3."""
    rows = np.full((ROWS, 7), -1, dtype=np.int32)
    rows[:, 0] = 1
    rows[:, 1] = rng.integers(0, VOCAB, ROWS)
    rows[:, 5] = rng.integers(0, VOCAB, ROWS)
    rows[:, 6] = rng.integers(1, 4, ROWS)
    return rows


def keyed(rows: np.ndarray) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for r in rows.tolist():
        out[tuple(r[:6])] += int(r[6])
    return out


class Load:
    """Clients pushing (each batch until acknowledged) and one drafting, against one service, until `stop`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acknowledged: Counter[tuple[int, ...]] = Counter()
        self.in_flight: Counter[tuple[int, ...]] = Counter()  # batches never acknowledged: applied or not
        self.acks: list[float] = []  # time.monotonic() of each acknowledged push
        self.failed_pushes = 0
        self.drafts = 0
        self.failed_drafts: list[str] = []
        self.threads = [threading.Thread(target=self._push, args=(c,), daemon=True) for c in range(CLIENTS)]
        self.threads.append(threading.Thread(target=self._draft, daemon=True))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _push(self, c: int) -> None:
        rng = np.random.default_rng(c)
        with grpc.insecure_channel(self.address) as ch:
            stub = counts_pb2_grpc.CountsStub(ch)
            seq = 0
            while not self.stop.is_set():
                rows = batch(rng)
                request = counts_pb2.PushRequest(namespace=NS, tokenizer_fingerprint=FP, client_id=f"client-{c}",
                                                 seq=seq, rows=delta_rows_to_bytes(rows))
                acknowledged = False
                while not acknowledged:  # what a sender does: the same batch again until acknowledged
                    try:
                        stub.Push(request, timeout=10)
                        acknowledged = True
                    except grpc.RpcError:
                        with self.lock:
                            self.failed_pushes += 1
                        if self.stop.is_set():
                            break
                        time.sleep(0.02)
                if not acknowledged:
                    with self.lock:
                        self.in_flight.update(keyed(rows))
                    return
                with self.lock:
                    self.acknowledged.update(keyed(rows))
                    self.acks.append(time.monotonic())
                seq += 1

    def _draft(self) -> None:
        tokens = np.arange(8, dtype=np.int32).tobytes()
        with grpc.insecure_channel(self.address) as ch:
            stub = drafting_pb2_grpc.DraftingStub(ch)
            while not self.stop.is_set():
                try:
                    stub.Draft(drafting_pb2.DraftRequest(namespace=NS, tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                         tokens=tokens, n_draft=4), timeout=10)
                    self.drafts += 1
                except grpc.RpcError as exc:
                    self.failed_drafts.append(f"{exc.code()}: {exc.details()}")
                time.sleep(0.01)

    def acked_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first push acknowledged after it (None: none yet)."""
        with self.lock:
            later = [a for a in self.acks if a > t]
        return min(later) - t if later else None


def stored(url: str) -> Counter[tuple[int, ...]]:
    store = open_counts_store(url, **STORE)
    try:
        out: Counter[tuple[int, ...]] = Counter()
        for chunk in store.export(NS):
            for r in np.asarray(chunk).tolist():
                out[tuple(r[:6])] += int(r[6])
        return out
    finally:
        store.close()


def compare(acknowledged: Counter[tuple[int, ...]], in_flight: Counter[tuple[int, ...]],
            store: Counter[tuple[int, ...]]) -> tuple[int, int]:
    """(counts over-counted, counts acknowledged but missing), key by key; a batch never acknowledged may be stored."""
    over = sum(max(0, store[k] - acknowledged[k] - in_flight[k]) for k in store)
    missing = sum(max(0, acknowledged[k] - store[k]) for k in acknowledged)
    return over, missing


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """``serve(url, *flags)`` starts `ngramcache serve` on the URL; stopped by PID after the test."""
    started: list[Any] = []

    def start(url: str, *flags: str) -> str:
        p, port = start_serve(tmp_path / f"data{len(started)}", "--counts", url, "--store-probe-interval", "0.2",
                              *flags)
        started.append(p)
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                name=NS, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=30)
        return address

    yield start
    for p in started:
        if p.poll() is None:
            stop_serve(p)


def commit_generations(url: str, holder: str) -> tuple[int, int]:
    """Take the rebuild lease and commit the next generation; (fencing token, generation) committed."""
    store = open_counts_store(url, **STORE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                lease = store.acquire_lease(NS, holder, 5000)
                generation = store.committed_generation(NS).generation + 1
                store.commit_generation(lease, generation, holder)
                store.release_lease(lease)
                return lease.token, generation
            except BackendUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        store.close()


def failover_under_load(address: str, url: str, old: RedisServer, promoted: Any) -> dict[str, Any]:
    """Push for 3 s, commit a generation, SIGKILL the namespace's master ``old``, wait for the promotion, restart
    ``old`` (as an orchestrator would: it comes back as a replica), push until acknowledged again and 2 s more,
    commit again; the figures."""
    before = [commit_generations(url, "before")]
    with Load(address) as load:
        time.sleep(3)
        before.append(commit_generations(url, "before"))
        killed_at = time.monotonic()
        old.kill()
        promoted_at = promoted()
        old.start()
        restarted_at = time.monotonic()
        while load.acked_after(restarted_at) is None and time.monotonic() < restarted_at + 20:
            time.sleep(0.05)  # with min_replicas 1, until the restarted node replicates the new master
        time.sleep(2)
    after = commit_generations(url, "after")
    assert not load.failed_drafts, load.failed_drafts[:3]
    over, missing = compare(load.acknowledged, load.in_flight, stored(url))
    return {"over": over, "missing": missing, "acknowledged": sum(load.acknowledged.values()),
            "promotion_s": promoted_at - killed_at, "back_s": load.acked_after(promoted_at),
            "restart_s": restarted_at - promoted_at,
            "failed_pushes": load.failed_pushes, "drafts": load.drafts, "before": before, "after": after}


def report(name: str, figures: dict[str, Any]) -> None:
    print(f"\n{name}: acknowledged {figures['acknowledged']} counts, over-counted {figures['over']}, acknowledged "
          f"but missing {figures['missing']}; replica promoted {figures['promotion_s']:.2f} s after the kill, old "
          f"master restarted {figures['restart_s']:.2f} s after that, pushes acknowledged again "
          f"{figures['back_s'] if figures['back_s'] is None else round(figures['back_s'], 2)} s after the promotion; "
          f"{figures['failed_pushes']} failed "
          f"push attempts (retried), {figures['drafts']} drafts, 0 failed; (token, generation) before "
          f"{figures['before']}, after {figures['after']}")


def check_numbers(figures: dict[str, Any]) -> None:
    (token0, gen0), (token1, gen1) = figures["before"]
    token2, gen2 = figures["after"]
    assert token0 < token1 < token2 and gen0 < gen1 < gen2, figures


@pytest.mark.parametrize("min_replicas", [0, 1])
def test_cluster_master_killed_mid_push(serve: Any, min_replicas: int) -> None:
    with RedisClusterProcesses(3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS) as cluster:
        address = serve(cluster.url, "--counts-min-replicas", str(min_replicas))
        key = meta_key("ngc", NS)
        master = cluster.master_of(key)
        figures = failover_under_load(address, cluster.url, master, lambda: cluster.wait_promoted(key, master)[1])
        report(f"Cluster, --counts-min-replicas {min_replicas}", figures)
        assert figures["over"] == 0
        if min_replicas:
            assert figures["missing"] == 0
        check_numbers(figures)
        assert figures["back_s"] is not None
        if not min_replicas:  # with it, the new master's replica is the restarted node: its full sync comes first
            assert figures["back_s"] <= NODE_TIMEOUT_MS / 1000 + 2


@pytest.mark.parametrize("min_replicas", [0, 1])
def test_sentinel_master_killed_mid_push(serve: Any, min_replicas: int) -> None:
    with RedisSentinelGroup() as group:
        address = serve(group.url, "--counts-min-replicas", str(min_replicas))
        master = group.master()
        figures = failover_under_load(address, group.url, master, lambda: group.wait_promoted(master)[1])
        report(f"Sentinel, --counts-min-replicas {min_replicas}", figures)
        assert figures["over"] == 0
        if min_replicas:
            assert figures["missing"] == 0
        check_numbers(figures)
        assert figures["back_s"] is not None
        if not min_replicas:
            assert figures["back_s"] <= 2


def lag(master: RedisServer) -> int:
    """Bytes of the master's replication stream its replica has not acknowledged."""
    client = master.client(socket_timeout=2)
    try:
        info = client.info("replication")
        return int(info["master_repl_offset"]) - int(info["slave0"]["offset"])
    finally:
        client.close()


def test_a_stopped_replica_turns_acknowledged_but_not_replicated_into_a_retriable_error() -> None:
    rng = np.random.default_rng(7)
    with RedisSentinelGroup() as group:
        loose = open_counts_store(group.url, **STORE)
        strict = open_counts_store(group.url, min_replicas=1, replica_timeout=0.3, **STORE)
        try:
            loose.create_namespace(NS, FP, VOCAB)
            master, replica = group.master(), group.replica
            os.kill(replica.pid or 0, signal.SIGSTOP)
            try:
                acknowledged = 0
                for seq in range(20):
                    loose.apply(NS, "loose", seq, batch(rng))
                    acknowledged += 1
                unreplicated = lag(master)
                with pytest.raises(BackendUnavailableError, match="reached 0 of 1 replicas"):
                    strict.apply(NS, "strict", 0, batch(rng))
                with pytest.raises(BackendUnavailableError, match="replicas"):
                    strict.acquire_lease(NS, "builder", 5000)  # leases always wait for the connected replica
            finally:
                os.kill(replica.pid or 0, signal.SIGCONT)
            print(f"\nreplica stopped: without the setting {acknowledged} of 20 pushes acknowledged while the replica "
                  f"lacked {unreplicated} bytes of them; with --counts-min-replicas 1: 0 acknowledged, each one a "
                  "retriable error")
            assert unreplicated > 0
            retried = strict.apply(NS, "strict", 0, batch(rng))  # acknowledged once the replica holds it
            assert retried.duplicates == 1  # the failed try was applied on the master: exactly once
        finally:
            loose.close()
            strict.close()
