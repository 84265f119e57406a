"""Load test of the whole fleet path: a Redis Cluster, service replicas and many clients, ramped to the knee.

Everything runs on this machine over loopback: a Redis Cluster of MASTERS redis-server
processes (AOF on, ``--fsync`` policy, default everysec as the deploy files), REPLICAS
`ngramcache serve` processes over it, and CLIENTS real `NgramClient`s in match mode (pushing
counts, publishing the fleet history and mirroring both, default settings), ``--per-proc``
(16) to a client process. Each client is an engine's sync layer without the engine: it runs
a group of 8 siblings at a time (one prompt of 64-128 tokens, then 200-400 tokens each, the
siblings' tokens mostly alike, `set_group` per group), drafting 8 tokens and accepting 1-8 at
every step; its first group starts part-way (a fleet already running). One driver thread per
client process paces its clients to the offered rate in tokens/s. The client processes run at a
lower CPU priority (``--client-nice``, 10): they stand in for engine hosts, which in a fleet do
not share cores with the service replicas and Redis; here they do, and take what those leave.

A ramp: one step with no load (the fleet's polling and the marker alone), then the offered
load from ``--start`` tokens/s, times ``--factor`` each step, until the knee: the first step
whose accepted rate is below 90% of what was offered (saying whether the client processes
or the store fell behind), or whose push-to-draftable p99 passed ``--max-p99`` seconds. The
knee is the highest accepted rate of the ramp; one more step then runs at 80% of it, once the
clients have pushed what the overloaded step left buffered and a step's time at that rate has
passed unmeasured (else it measures the recovery). Beside
it, the service-level knee: the highest accepted rate of a step whose push-to-draftable p50 and
p99 are within ``--slo-p50`` and ``--slo-p99`` (250 ms and 1 s by default).

Per step: offered, fed (accepted into the drafters) and accepted tokens/s (acknowledged by
the store, counts and history both: the lower of the two), counts rows/s and history
records/s acknowledged, CPU per component (the Redis masters, the replicas, the client
processes: CPU seconds per second from /proc/<pid>/stat, so per-core figures hold on a
shared machine; in brackets the CPUs the machine's other work used meanwhile, from /proc/stat), push-to-draftable p50/p99 (a marker sequence accepted by a client on the
first replica, timed until a client on the last replica drafts it, checked every
millisecond; both sequences share a group, as siblings do; about 200 tokens/s of its own),
the part of it after the store (the reading client's lag from the store's time of its last
1,000 records to its drafter),
pushes shed, rows and history tokens dropped, failed drafts, Redis `used_memory` summed over
the masters, MB/s pushed, history tokens pulled by all the clients (the mirrors' fan-out) and
MB/s pulled per client. After the ramp every client closes (flushing) and the store's total
count is compared with what the clients got acknowledged (``store == acked``).

``--setups`` runs a ramp per MASTERSxREPLICASxCLIENTS (default: the base 3x2x64, one master
more, one replica more, 16 and 192 clients). On a machine with fewer cores than processes the
knee in tokens/s cannot rise with more processes, so the check is per core: per setup,
tokens/s per busy core of each component, how evenly the masters and the replicas share the
load, and the knee each component allows on a core per unit: measured (accepted / the
busiest unit's CPUs) and projected from the costs (the busiest unit's idle CPUs plus its share
of the marginal CPU per accepted token reaching one core). The cost table gives, per setup,
the idle CPUs per client and the marginal microseconds per accepted token of each component.

    nice flock /tmp/ngc-heavy.lock python tests/bench/bench_fleet_load.py             # about 11 min
    python tests/bench/bench_fleet_load.py --setups 3x2x64 --reps 3                   # the base, 3 ramps
    python tests/bench/bench_fleet_load.py --setups 3x2x64 --serve-args='--mirror-interval 1'  # a serve setting
    python tests/bench/bench_fleet_load.py --quick     # checks the script (< 60 s; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the redis and fleet helpers
from helpers.fleet import Replica
from helpers.redis_servers import RedisClusterProcesses

from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows

NS = "fleet"  # helpers.fleet.Replica's namespace
FP = hashlib.sha256(b"bench-fleet-load").digest()
VOCAB = 32_000
SIBLINGS = 8
N_DRAFT = 8
CLIENT_OPTIONS = {"mode": "match", "connect_timeout": 30.0, "ready_timeout": 60.0, "close_timeout": 60.0}
SUMMED = ("acked_rows", "acked_count", "drained_rows", "drained_count", "dropped_rows", "dropped_count", "overloaded",
          "pending_rows", "unconfirmed_rows", "unconfirmed_count", "pulled_bytes", "history_drained_tokens", "history_drained_records",
          "history_stored_records", "history_stored_tokens", "history_skipped_records", "history_skipped_tokens",
          "history_duplicate_records", "history_duplicate_tokens", "history_dropped_records", "history_dropped_tokens",
          "history_unconfirmed_tokens", "history_pending_tokens", "history_pulled_bytes", "history_pulled_tokens",
          "history_group_pulled_bytes")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The process's children, their children, ... (/proc/<pid>/task/*/children; gone ones left out)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and every process under it (a `serve --workers N` replica's workers)."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            total += cpu_seconds(p)
        except OSError:  # exited in between
            pass
    return total


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy so far, all cores (/proc/stat: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summed(stats: list[dict[str, Any]]) -> dict[str, float]:
    return {k: float(sum(s.get(k) or 0 for s in stats)) for k in SUMMED}


# --- the client processes ------------------------------------------------------------------------------------------


class Group:
    """One client's current group: 8 siblings of one prompt, each advancing by 1-8 tokens a step."""

    def __init__(self, rng: np.random.Generator, first_seq: int, name: str) -> None:
        prompt = (rng.zipf(1.3, int(rng.integers(64, 129))) % VOCAB).astype(np.int32)
        base = (rng.zipf(1.3, 400) % VOCAB).astype(np.int32)
        self.name = name
        self.texts = []
        for _ in range(SIBLINGS):  # siblings sampled at a temperature: mostly the same tokens
            own = base.copy()
            change = rng.random(len(own)) < 0.3
            own[change] = (rng.zipf(1.3, int(change.sum())) % VOCAB).astype(np.int32)
            self.texts.append(np.concatenate([prompt, own[:int(rng.integers(200, 401))]]))
        self.prompt = len(prompt)
        self.seqs = [first_seq + i for i in range(SIBLINGS)]
        self.pos = [0] * SIBLINGS  # tokens accepted so far; 0: not started


def client_process(conn: Connection, index: int, n_clients: int, addresses: list[str], cache_dir: str,
                   niceness: int = 0) -> None:
    """Runs ``n_clients`` NgramClients and one driver paced by ("rate", tokens/s) messages; answers ("stats",) and
    ("stop",) with the clients' summed stats (stop closes them first). ``niceness`` is added to the process's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops this process
    if niceness:
        os.nice(niceness)
    clients = []
    for i in range(n_clients):
        k = index * n_clients + i
        order = [addresses[(k + j) % len(addresses)] for j in range(len(addresses))]
        clients.append(NgramClient(order, NS, (FP, VOCAB), cache_dir=cache_dir, **CLIENT_OPTIONS))
    drafters = [c.drafter() for c in clients]
    rng = np.random.default_rng(1000 + index)
    next_seq = [1] * n_clients
    groups: list[Group | None] = [None] * n_clients
    fed = drafts = failures = 0
    busy = 0.0  # seconds the driver spent in draft and accept calls
    rate, t_base, fed_base = 0.0, time.monotonic(), 0
    # A fleet already running: each client's first group starts part-way through its outputs (not counted as fed),
    # so the steps measure the steady mix of prompts and steps, not every sequence's prompt at once.
    for c in range(n_clients):
        group = groups[c] = Group(rng, next_seq[c], f"p{index}c{c}g{next_seq[c]}")
        next_seq[c] += SIBLINGS
        phase = group.prompt + int(rng.integers(0, 200))
        for s, seq in enumerate(group.seqs):
            clients[c].set_group(seq, group.name)
            drafters[c].accept(seq, group.texts[s][:phase])
            group.pos[s] = phase
    conn.send(("ready", os.getpid()))
    cursor = 0
    while True:
        if conn.poll(0 if rate else 0.05):
            msg = conn.recv()
            if msg[0] == "rate":
                rate, t_base, fed_base = float(msg[1]), time.monotonic(), fed
            elif msg[0] == "stats":
                conn.send((summed([c.stats() for c in clients]), fed, drafts, failures, busy))
            elif msg[0] == "stop":
                for c in clients:
                    c.close()
                conn.send((summed([c.stats() for c in clients]), fed, drafts, failures, busy))
                return
            continue
        if not rate:
            continue
        ahead = t_base + (fed - fed_base) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(min(ahead, 0.05))
            continue
        if ahead < -1.0:  # behind by more than a second: what was not fed is not offered again
            t_base, fed_base = time.monotonic(), fed
        c = cursor % n_clients
        cursor += 1
        current = groups[c]
        if current is None or all(p >= len(t) for p, t in zip(current.pos, current.texts)):
            if current is not None:
                for seq in current.seqs:
                    drafters[c].reset(seq)
            current = groups[c] = Group(rng, next_seq[c], f"p{index}c{c}g{next_seq[c]}")
            next_seq[c] += SIBLINGS
        group = current
        t_step = time.perf_counter()
        for s, seq in enumerate(group.seqs):  # one step of every live sibling
            text, pos = group.texts[s], group.pos[s]
            if pos >= len(text):
                continue
            try:
                if pos == 0:
                    clients[c].set_group(seq, group.name)
                    drafters[c].accept(seq, text[:group.prompt])
                    group.pos[s] = pos = group.prompt
                    fed += pos
                drafters[c].draft(seq, text[:pos], N_DRAFT)
                drafts += 1
                end = min(len(text), pos + int(rng.integers(1, 9)))
                drafters[c].accept(seq, text[:end])
                fed += end - pos
                group.pos[s] = end
            except Exception:  # a failed draft or accept is what this benchmark counts
                failures += 1
                group.pos[s] = len(text)
        busy += time.perf_counter() - t_step


# --- the marker: push-to-draftable on another client ---------------------------------------------------------------


class Marker(threading.Thread):
    """A marker sequence accepted by client A, timed until client B drafts its continuation, over and over."""

    def __init__(self, a: NgramClient, b: NgramClient, timeout: float, pause: float = 0.5) -> None:
        super().__init__(name="marker", daemon=True)
        self.a, self.b, self.timeout, self.pause = a, b, timeout, pause
        self.samples: list[tuple[float, float]] = []  # (monotonic time of the accept, seconds to draftable or inf)
        self.stop_event = threading.Event()

    def run(self) -> None:
        da, db = self.a.drafter(), self.b.drafter()
        rng = np.random.default_rng(7)
        trial = 0
        while not self.stop_event.is_set():
            trial += 1
            text = rng.integers(0, VOCAB, 64, dtype=np.int32)  # random: only A's sequence can draft it
            want = text[40:48].tolist()
            group = f"marker{trial}"
            self.a.set_group(2 * trial, group)
            self.b.set_group(2 * trial + 1, group)
            db.accept(2 * trial + 1, text[:40])
            started = time.monotonic()
            da.accept(2 * trial, text[:16])
            da.accept(2 * trial, text)
            took = float("inf")
            while time.monotonic() - started < self.timeout and not self.stop_event.is_set():
                if db.draft(2 * trial + 1, text[:40], N_DRAFT).tolist() == want:
                    took = time.monotonic() - started
                    break
                time.sleep(0.001)
            da.reset(2 * trial)
            db.reset(2 * trial + 1)
            if not self.stop_event.is_set():
                self.samples.append((started, took))
            self.stop_event.wait(self.pause)  # a light load of its own (about 100 tokens a trial), not counted

    def between(self, t0: float, t1: float) -> list[float]:
        return [took for started, took in self.samples if t0 <= started < t1]


# --- the fleet -----------------------------------------------------------------------------------------------------


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


def knee_reached(points: list[Point], max_p99: float) -> str | None:
    p = points[-1]
    if p.accepted < 0.9 * p.offered:
        where = ("the client processes fell behind: fed " + f"{p.fed:,.0f}" if p.fed < 0.9 * p.offered
                 else "the store fell behind the fed tokens")
        return f"accepted {p.accepted:,.0f} < 90% of offered {p.offered:,.0f}; {where}"
    if len(points) > 1 and p.accepted < 0.95 * p.offered and p.accepted < 1.05 * points[-2].accepted:
        return f"accepted rose {100 * (p.accepted / points[-2].accepted - 1):.1f}% (< 5%) and fell behind the offer"
    if p.p99 > max_p99:
        return f"push-to-draftable p99 {p.p99:.2f} s > {max_p99:g} s"
    return None


def slo_knee(points: list[Point], p50: float, p99: float) -> Point | None:
    """The service-level knee: of the steps whose push-to-draftable p50 and p99 are within ``p50`` and ``p99``
    seconds, the one with the highest accepted rate (None: no step met both)."""
    met = [p for p in points if p.lags and p.p50 <= p50 and p.p99 <= p99]
    return max(met, key=lambda p: p.accepted) if met else None


def fmt_point(p: Point) -> str:
    cpu = " ".join(f"{p.cpu[k]:.2f}" for k in ("masters", "replicas", "clients")) + f" ({p.cpu_others:.2f})"
    store_lag = " / ".join("-" if x != x else f"{x:.0f}" for x in p.store_lag_ms)  # nan: not read (no load)
    return (f"| {p.offered:,.0f} | {p.fed:,.0f} | {p.accepted:,.0f} | {p.counts_rows:,.0f} | {p.history_records:,.0f} | "
            f"{cpu} | {1e3 * p.p50:.0f} / {1e3 * p.p99:.0f} ({len(p.lags)}) | {store_lag} | {p.shed:.0f} / "
            f"{p.dropped_rows:.0f} / "
            f"{p.dropped_history:.0f} | {p.failures} | {p.redis_mb:.1f} | {p.pushed_mb:.2f} | {p.pulled_tokens:,.0f} | "
            f"{p.pulled_mb_per_client:.2f} |")


HEADER = ("| offered tok/s | fed tok/s | accepted tok/s | counts rows/s | history rec/s | CPUs masters replicas clients "
          "(other work) | "
          "push->draftable p50 / p99 ms (n) | of which store->B p50 / p99 ms | shed / dropped rows / dropped hist tok | failed drafts | Redis MB | "
          "MB/s pushed | history tok/s pulled (all clients) | MB/s pulled per client |\n|" + "---:|" * 14)


@dataclass
class Ramp:
    setup: str
    masters: int
    replicas: int
    clients: int
    idle: Point  # no load offered: the clients' polling and the marker alone
    points: list[Point]  # the ramp's steps, up to the knee
    knee: Point
    at80: Point
    store_total: int
    acked_total: int
    final: dict[str, float]
    why: str


def ramp(tmp: Path, masters: int, replicas: int, clients: int, args: argparse.Namespace) -> Ramp:
    setup = f"{masters}x{replicas}x{clients}"
    procs = -(-clients // args.per_proc)
    t = time.monotonic()
    fleet = Fleet(tmp, masters, replicas, clients, procs, args.fsync, args.marker_timeout, args.workers,
                  args.marker_pause, args.client_nice, shlex.split(args.serve_args))
    try:
        print(f"\nsetup {setup}: {masters} masters, {replicas} replicas, {clients} clients in {procs} processes; "
              f"started in {time.monotonic() - t:.0f} s{'; replicas: serve ' + args.serve_args if args.serve_args else ''}",
              flush=True)
        print(HEADER, flush=True)
        idle = fleet.step(0.0, args.step_seconds)
        print(fmt_point(idle), flush=True)
        points: list[Point] = []
        rate, why = args.start, "not reached"
        for _ in range(args.max_steps):
            points.append(fleet.step(rate, args.step_seconds))
            print(fmt_point(points[-1]), flush=True)
            reason = knee_reached(points, args.max_p99)
            if reason:
                why = reason
                break
            rate *= args.factor
        knee = max(points, key=lambda p: p.accepted)
        # The step past the knee left a backlog (buffered pushes, a tail behind): drained first, then a whole step's
        # time at the new rate unmeasured, so the 80% step measures 80% of the knee, not the recovery from the overload.
        drained = fleet.drain(60)
        at80 = fleet.step(0.8 * knee.accepted, args.step_seconds, warmup=args.step_seconds)
        print(f"knee ({why}): {knee.accepted:,.0f} tokens/s accepted at {knee.offered:,.0f} offered; at 80% of it "
              f"(after {drained:.0f} s without load, the backlog drained, and {args.step_seconds:g} s at that rate "
              f"before it is measured):", flush=True)
        print(fmt_point(at80), flush=True)
        total, acked, final = fleet.finish()
    finally:
        fleet.close()
    print(f"  store {total:,}, acked {acked:,}, unconfirmed {final['unconfirmed_count']:,.0f} (counts): nothing "
          f"acknowledged lost: {held(total, acked, final)}; shed {final['overloaded']:.0f}, dropped rows "
          f"{final['dropped_rows']:.0f}, dropped history tokens {final['history_dropped_tokens']:.0f}, unconfirmed rows "
          f"{final['unconfirmed_rows']:.0f}, failed drafts {final['failures']:.0f}", flush=True)
    return Ramp(setup, masters, replicas, clients, idle, points, knee, at80, total, acked, final, why)


COMPONENTS = ("masters", "replicas", "clients")


def held(total: int, acked: int, final: dict[str, float]) -> bool:
    """The store holds every acknowledged count, and no more than the pushes whose answer never came (unconfirmed:
    applied or not) add; exactly the acknowledged ones when none is unconfirmed."""
    return acked <= total <= acked + final["unconfirmed_count"]


def top(r: Ramp) -> list[Point]:
    """The knee and the two steps before it: where per-core figures are read (fixed costs matter least)."""
    i = r.points.index(r.knee)
    return r.points[max(0, i - 2):i + 1]


def spread(values: list[float]) -> float:
    """Largest distance from the mean, as a fraction of the mean."""
    mean = statistics.mean(values)
    return max(abs(v - mean) for v in values) / max(mean, 1e-9)


def marginal(r: Ramp) -> dict[str, float]:
    """Per component, CPU microseconds per accepted token above the idle fleet's: the median over the knee and the two
    steps before it of (CPUs - CPUs idle) / accepted tokens/s."""
    return {k: 1e6 * statistics.median((p.cpu[k] - r.idle.cpu[k]) / max(p.accepted, 1.0) for p in top(r))
            for k in COMPONENTS}


def projected(r: Ramp, k: str) -> float:
    """Tokens/s at which the busiest unit of component ``k`` (masters, replicas), a core each, reaches one core: its idle
    CPUs plus its share (as measured near the knee) of the marginal cost per token."""
    units = r.idle.cpu_units[k]
    share = statistics.median(max(p.cpu_units[k]) / max(sum(p.cpu_units[k]), 1e-9) for p in top(r))
    cost = max(marginal(r)[k], 0.01) / 1e6  # CPU s per token, all units
    return (1.0 - max(units)) / (cost * share)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="3x2x16,3x2x64,4x2x64,3x3x64,3x2x192",
                    help="MASTERSxREPLICASxCLIENTS,... (default 3x2x16,3x2x64,4x2x64,3x3x64,3x2x192)")
    ap.add_argument("--per-proc", type=int, default=16, help="clients a client process runs (default 16)")
    ap.add_argument("--start", type=float, default=2000, help="first offered load, tokens/s (default 2000)")
    ap.add_argument("--factor", type=float, default=1.4, help="the load grows by this each step (default 1.4)")
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--step-seconds", type=float, default=10.0, help="measured seconds a step (plus a quarter warm-up)")
    ap.add_argument("--max-p99", type=float, default=5.0, help="push-to-draftable p99 past this (s) is the knee")
    ap.add_argument("--slo-p50", type=float, default=0.25, help="the service-level knee's push-to-draftable p50 (s)")
    ap.add_argument("--slo-p99", type=float, default=1.0, help="the service-level knee's push-to-draftable p99 (s)")
    ap.add_argument("--marker-timeout", type=float, default=10.0, help="a marker not draftable by then counts as inf")
    ap.add_argument("--marker-pause", type=float, default=0.5,
                    help="seconds between two marker trials (default 0.5: 9-13 markers a 10 s step; less times more "
                         "of them, each about 100 tokens the load does not count)")
    ap.add_argument("--fsync", choices=("always", "everysec", "no"), default="everysec")
    ap.add_argument("--workers", type=int, default=1,
                    help="server processes per replica (serve --workers N; their CPU counts as the replica's; default 1)")
    ap.add_argument("--client-nice", type=int, default=10,
                    help="niceness added to the client processes (default 10; 0: none). The clients stand in for "
                         "engine hosts, which do not share cores with the service and Redis; on one machine they "
                         "would, so they get the CPU the service leaves. The marker's two clients are not niced")
    ap.add_argument("--serve-args", default="",
                    help="more `ngramcache serve` options for every replica, one string with '=' (such as "
                         "--serve-args='--mirror-interval 1'): compares a replica setting against the default")
    ap.add_argument("--reps", type=int, default=1, help="ramps per setup; knees and per-core figures are medians")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in < 60 s: setup 3x2x16, 2 steps of 2 s (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.setups, args.max_steps, args.step_seconds, args.reps = "3x2x16", 2, 2.0, 1
    try:
        setups = [tuple(int(x) for x in s.split("x")) for s in args.setups.split(",")]
        assert all(len(s) == 3 and min(s) >= 1 for s in setups)
    except (ValueError, AssertionError):
        ap.error(f"--setups takes MASTERSxREPLICASxCLIENTS,... (such as 3x2x64), got {args.setups!r}")
    if not 0 <= args.client_nice <= 19:
        ap.error(f"--client-nice takes 0..19 (10 by default), got {args.client_nice}")
    try:
        shlex.split(args.serve_args)
    except ValueError as e:
        ap.error(f"--serve-args: {e} in {args.serve_args!r}")
    if not 0.01 <= args.marker_pause <= 60:
        ap.error(f"--marker-pause takes seconds in 0.01..60 (0.5 by default), got {args.marker_pause}")
    cores = os.cpu_count() or 1
    results: dict[str, list[Ramp]] = {}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ngc-bench-fleet-load-") as tmp:
        for rep in range(args.reps):
            for masters, replicas, clients in setups:
                try:
                    r = ramp(Path(tmp) / f"{masters}x{replicas}x{clients}-{rep}", masters, replicas, clients, args)
                except RuntimeError as e:  # a replica that did not start (such as a bad --serve-args): its log
                    print(f"bench_fleet_load.py: error: {e}", file=sys.stderr)
                    return 1
                except KeyboardInterrupt:  # Ctrl-C: ramp's finally stopped the fleet; the folder goes with tmp
                    print("bench_fleet_load.py: interrupted; the Redis Cluster, replicas and clients it started are "
                          "stopped", file=sys.stderr)
                    return 130
                results.setdefault(r.setup, []).append(r)

    print(f"\n## Knees and per-core figures (medians of {args.reps} ramp(s); per-core figures over the knee and the two "
          f"steps before it; {cores} CPUs on this machine; fsync {args.fsync})\n")
    print("| setup (masters x replicas x clients) | knee tok/s accepted | CPUs at the knee: masters / replicas / clients | "
          "tok/s per busy core: masters / replicas / clients | spread of masters / replicas | "
          "knee on a core each, measured (busiest unit at one core): by masters / by replicas | "
          "projected from idle + marginal costs: by masters / by replicas |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for setup, rs in results.items():
        knee = statistics.median(r.knee.accepted for r in rs)
        cpus = {k: statistics.median(r.knee.cpu[k] for r in rs) for k in COMPONENTS}
        core = {k: statistics.median(statistics.median(p.accepted / max(p.cpu[k], 1e-3) for p in top(r)) for r in rs)
                for k in COMPONENTS}
        m_spread = statistics.median(spread(p.cpu_units["masters"]) for r in rs for p in top(r))
        r_spread = statistics.median(spread(p.cpu_units["replicas"]) for r in rs for p in top(r))
        # With a core each, a component tops out when its busiest unit reaches one core. Measured: accepted / (the
        # busiest unit's CPUs), fixed costs included. Projected: the busiest unit's idle CPUs plus its share of the
        # marginal cost reach one core, (1 - idle of the busiest unit) / (marginal CPU s a token x its share).
        by = {k: statistics.median(statistics.median(p.accepted / max(max(p.cpu_units[k]), 1e-3) for p in top(r))
                                   for r in rs) for k in ("masters", "replicas")}
        proj = {k: statistics.median(projected(r, k) for r in rs) for k in ("masters", "replicas")}
        print(f"| {setup} | {knee:,.0f} | {cpus['masters']:.2f} / {cpus['replicas']:.2f} / {cpus['clients']:.2f} | "
              f"{core['masters']:,.0f} / {core['replicas']:,.0f} / {core['clients']:,.0f} | "
              f"±{100 * m_spread:.0f}% / ±{100 * r_spread:.0f}% | {by['masters']:,.0f} / {by['replicas']:,.0f} | "
              f"{proj['masters']:,.0f} / {proj['replicas']:,.0f} |")
    print()
    for setup, rs in results.items():
        for r in rs:
            at = r.at80
            print(f"{setup} at 80% of the knee ({at.offered:,.0f} tok/s): push->draftable p50 {1e3 * at.p50:.0f} ms, "
                  f"p99 {1e3 * at.p99:.0f} ms ({len(at.lags)} markers), failed drafts {at.failures}, shed {at.shed:.0f}, "
                  f"dropped rows {at.dropped_rows:.0f}; nothing acknowledged lost: {held(r.store_total, r.acked_total, r.final)}")
            ok = ok and held(r.store_total, r.acked_total, r.final)
    print(f"\nService-level knee: the highest accepted rate of a step (the 80% step included) whose push->draftable "
          f"p50 <= {1e3 * args.slo_p50:.0f} ms and p99 <= {1e3 * args.slo_p99:.0f} ms (the throughput knee above is "
          f"where the accepted rate falls behind the offer or p99 passes {args.max_p99:g} s):")
    for setup, rs in results.items():
        for r in rs:
            slo = slo_knee([*r.points, r.at80], args.slo_p50, args.slo_p99)
            if slo is None:
                print(f"{setup}: no step met both (knee {r.knee.accepted:,.0f} tok/s)")
            else:
                print(f"{setup}: {slo.accepted:,.0f} tok/s accepted at {slo.offered:,.0f} offered, push->draftable p50 "
                      f"{1e3 * slo.p50:.0f} ms, p99 {1e3 * slo.p99:.0f} ms ({100 * slo.accepted / r.knee.accepted:.0f}% of "
                      f"the knee, {r.knee.accepted:,.0f} tok/s)")
    print("\nCPU cost model (medians over the ramps of a setup): idle, the fleet's polling with no load (% of a core per "
          "client); marginal, CPU per accepted token above idle, over the knee and the two steps before it (us); the "
          "history tokens the clients pulled per accepted token (the mirrors' fan-out):")
    print("| setup | idle % of a core per client: masters / replicas / clients | marginal us per accepted token: masters / "
          "replicas / clients | pulled per accepted token |")
    print("|---|---:|---:|---:|")
    for setup, rs in results.items():
        idle = {k: statistics.median(100 * r.idle.cpu[k] / r.clients for r in rs) for k in COMPONENTS}
        cost = {k: statistics.median(marginal(r)[k] for r in rs) for k in COMPONENTS}
        fan = statistics.median(statistics.median(p.pulled_tokens / max(p.accepted, 1.0) for p in top(r)) for r in rs)
        print(f"| {setup} | {idle['masters']:.3f} / {idle['replicas']:.3f} / {idle['clients']:.3f} | "
              f"{cost['masters']:.1f} / {cost['replicas']:.1f} / {cost['clients']:.1f} | {fan:.1f} |")
    print(f"\nchecksum: nothing acknowledged lost (acked <= store <= acked + unconfirmed) in "
          f"{sum(held(r.store_total, r.acked_total, r.final) for rs in results.values() for r in rs)}/"
          f"{sum(len(rs) for rs in results.values())} ramps; total {time.monotonic() - t_all:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
