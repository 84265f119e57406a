"""bench_fleet_load.py's fleet on this machine: a Redis Cluster, `ngramcache serve` replicas over it, the client
processes and the marker's two clients (`Fleet`), and what one step of offered load measured there (`Point`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from helpers.fleet import Replica
from helpers.redis_servers import RedisClusterProcesses

from bench.lib.fleet_load_clients import CLIENT_OPTIONS, FP, NS, VOCAB, Marker, client_process, summed
from bench.lib.proc_stats import cpu_seconds, machine_busy, tree_cpu_seconds
from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]



@dataclass
class Point:
    """One step of the ramp."""

    offered: float
    seconds: float = 0.0
    fed: float = 0.0  # tokens/s accepted into the drafters
    accepted: float = 0.0  # tokens/s acknowledged by the store (the lower of counts and history)
    counts_rows: float = 0.0  # delta rows/s acknowledged
    history_records: float = 0.0  # records/s acknowledged (stored or skipped as near-duplicates)
    cpu: dict[str, float] = field(default_factory=dict)  # component -> CPUs busy (CPU s per s)
    cpu_units: dict[str, list[float]] = field(default_factory=dict)  # masters / replicas: each one's CPUs
    cpu_others: float = 0.0  # CPUs the machine's other work used meanwhile (busy CPUs less the fleet's)
    lags: list[float] = field(default_factory=list)  # push-to-draftable seconds (inf: not within the timeout)
    store_lag_ms: tuple[float, float] = (float("nan"), float("nan"))  # p50, p99: stored -> in B's drafter (B's records)
    shed: float = 0.0
    dropped_rows: float = 0.0
    dropped_history: float = 0.0
    failures: int = 0
    redis_mb: float = 0.0
    pulled_mb_per_client: float = 0.0  # counts + history pulled per client per second, MB
    pulled_tokens: float = 0.0  # history tokens/s pulled by all the clients together (the mirrors' fan-out)
    pushed_mb: float = 0.0  # counts rows and history tokens acknowledged, MB/s on the wire (28 bytes a row, 4 a token)

    @property
    def p50(self) -> float:
        return quantile(self.lags, 0.5)

    @property
    def p99(self) -> float:
        return quantile(self.lags, 0.99)


class Fleet:
    """The cluster, the replicas, the client processes and the marker's two clients."""

    def __init__(self, tmp: Path, masters: int, replicas: int, clients: int, procs: int, fsync: str,
                 marker_timeout: float, workers: int = 1, marker_pause: float = 0.5, client_nice: int = 0,
                 serve_args: Sequence[str] = ()) -> None:
        self.n_clients = clients
        tmp.mkdir(parents=True, exist_ok=True)
        self.cluster = RedisClusterProcesses(masters=masters, args=["--appendonly", "yes", "--appendfsync", fsync])
        self.cluster.__enter__()
        self.replicas: list[Replica] = []
        self.procs: list[tuple[Any, Connection]] = []
        self.marker_clients: list[NgramClient] = []
        try:
            extra = ("--peer-sync-interval", "1.0", *(("--workers", str(workers)) if workers > 1 else ()), *serve_args)
            self.replicas = [Replica(tmp, i, self.cluster.url, extra) for i in range(replicas)]
            addresses = [r.address for r in self.replicas]
            with grpc.insecure_channel(addresses[0]) as ch:
                admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                    name=NS, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=30)
            ctx = mp.get_context("spawn")
            per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
            for i, n in enumerate(per):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=client_process, args=(child, i, n, addresses, str(tmp / f"node-{i}"), client_nice),
                                daemon=True)
                p.start()
                self.procs.append((p, parent))
            for p, conn in self.procs:
                if not conn.poll(300):
                    raise RuntimeError(f"client process {p.pid} did not start its clients in 300 s")
                conn.recv()
            self.drain(120)  # the first groups' opening parts pushed before anything is measured
            self.marker_clients = [
                NgramClient([addresses[0]], NS, (FP, VOCAB), cache_dir=tmp / "marker-a", **CLIENT_OPTIONS),
                NgramClient([addresses[-1]], NS, (FP, VOCAB), cache_dir=tmp / "marker-b", **CLIENT_OPTIONS)]
            self.marker = Marker(self.marker_clients[0], self.marker_clients[1], marker_timeout, marker_pause)
            self.marker.start()
        except BaseException:
            self.close()
            raise

    def drain(self, timeout: float) -> float:
        """No load until the clients have pushed what they buffered (at most ``timeout`` s); the seconds it took."""
        self.set_rate(0.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            stats = self.client_stats()[0]
            if not stats["pending_rows"] and not stats["history_pending_tokens"] and not stats["unconfirmed_rows"]:
                break
            time.sleep(0.5)
        time.sleep(2.0)  # the mirrors catch up with what was pushed last
        return time.monotonic() - t0

    def pids(self) -> dict[str, list[int]]:
        return {"masters": [n.pid for n in self.cluster.nodes if n.pid],
                "replicas": [r.proc.pid for r in self.replicas],
                "clients": [p.pid for p, _ in self.procs] + [os.getpid()]}

    def cpu(self) -> dict[str, list[float]]:
        return {k: [tree_cpu_seconds(pid) if k == "replicas" else cpu_seconds(pid) for pid in pids]
                for k, pids in self.pids().items()}

    def client_stats(self) -> tuple[dict[str, float], int, int, int]:
        for _, conn in self.procs:
            conn.send(("stats",))
        answers = [conn.recv() for _, conn in self.procs]
        stats = summed([a[0] for a in answers])  # the load's clients only: the marker's are not load
        return stats, sum(a[1] for a in answers), sum(a[2] for a in answers), sum(a[3] for a in answers)

    def set_rate(self, tokens_per_s: float) -> None:
        for _, conn in self.procs:
            conn.send(("rate", tokens_per_s / len(self.procs)))

    def redis_mb(self) -> float:
        total = 0
        for node in self.cluster.nodes:
            client = node.client(socket_timeout=5)
            try:
                total += int(client.info("memory")["used_memory"])
            finally:
                client.close()
        return total / 1e6

    def step(self, offered: float, seconds: float, warmup: float | None = None) -> Point:
        """Offers ``offered`` tokens/s for ``warmup`` seconds not measured (default: a quarter of ``seconds``), then
        for ``seconds`` measured."""
        self.set_rate(offered)
        time.sleep(seconds / 4 if warmup is None else warmup)
        s0, fed0, _, fail0 = self.client_stats()
        cpu0, busy0, t0 = self.cpu(), machine_busy(), time.monotonic()
        time.sleep(seconds)
        s1, fed1, _, fail1 = self.client_stats()
        cpu1, busy1, t1 = self.cpu(), machine_busy(), time.monotonic()
        dt = t1 - t0
        d = {k: s1[k] - s0[k] for k in s1}
        point = Point(offered=offered, seconds=dt)
        point.fed = (fed1 - fed0) / dt
        # Counts per fed token (1..4-grams: about 4), from what the step drained.
        counts_tokens = d["acked_count"] / max(1.0, d["drained_count"] / max(fed1 - fed0, 1)) / dt
        history_tokens = (d["history_stored_tokens"] + d["history_skipped_tokens"] + d["history_duplicate_tokens"]) / dt
        point.accepted = min(counts_tokens, history_tokens)
        point.counts_rows = d["acked_rows"] / dt
        point.history_records = (d["history_stored_records"] + d["history_skipped_records"]
                                 + d["history_duplicate_records"]) / dt
        point.cpu_units = {k: [(b - a) / dt for a, b in zip(cpu0[k], cpu1[k])] for k in cpu0}
        point.cpu = {k: sum(v) for k, v in point.cpu_units.items()}
        point.cpu_others = max(0.0, (busy1 - busy0) / dt - sum(point.cpu.values()))
        point.lags = self.marker.between(t0, t1)
        if offered:  # with no load its last records may be the fleet's first ones, long before the step
            b = self.marker_clients[1].stats()  # its last records' lag from the store's time to its drafter
            p50, p99 = b["history_lag_ms_p50"], b["history_lag_ms_p99"]
            point.store_lag_ms = (float("nan") if p50 is None else p50, float("nan") if p99 is None else p99)
        point.shed, point.dropped_rows, point.dropped_history = d["overloaded"], d["dropped_rows"], d[
            "history_dropped_tokens"]
        point.failures = fail1 - fail0
        point.redis_mb = self.redis_mb()
        point.pulled_mb_per_client = (d["pulled_bytes"] + d["history_pulled_bytes"]) / dt / 1e6 / (
            self.n_clients)
        point.pulled_tokens = d["history_pulled_tokens"] / dt
        point.pushed_mb = (28 * d["acked_rows"] + 4 * d["history_stored_tokens"]) / dt / 1e6
        return point

    def finish(self) -> tuple[int, int, dict[str, float]]:
        """Stops every client (each flushes); (store total, acknowledged total, the final summed stats)."""
        self.marker.stop_event.set()
        self.marker.join(30)
        answers = []
        for _, conn in self.procs:
            conn.send(("stop",))
        for p, conn in self.procs:
            answers.append(conn.recv())
            p.join(30)
        for c in self.marker_clients:
            c.close()
        stats = summed([a[0] for a in answers] + [c.stats() for c in self.marker_clients])
        with grpc.insecure_channel(self.replicas[-1].address) as ch:
            chunks = counts_pb2_grpc.CountsStub(ch).Pull(
                counts_pb2.PullRequest(namespace=NS, tokenizer_fingerprint=FP), timeout=600)
            total = sum(int(bytes_to_count_rows(c.rows)[:, 6].sum()) for c in chunks)
        stats["failures"] = float(sum(a[3] for a in answers))
        return total, int(stats["acked_count"]), stats

    def close(self) -> None:
        if hasattr(self, "marker"):
            self.marker.stop_event.set()
        for c in self.marker_clients:
            c.close()
        for p, _ in self.procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        for r in self.replicas:
            r.stop()
        self.cluster.cleanup()
