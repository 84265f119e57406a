"""Benchmark of Redis failover and WAIT: what ``--counts-min-replicas 1`` costs in ingest, and one
failover under load.

Everything runs on this machine over loopback: a primary and one replica under three Sentinels
(redis-server, AOF fsynced every second: tests/helpers/redis_servers.py's `RedisSentinelGroup`)
and two `ngramcache serve --counts redis+sentinel://...` processes over it, one with
``--counts-min-replicas 0`` (the default: a push is acknowledged once the master holds it) and
one with ``--counts-min-replicas 1`` (once a replica holds it too: WAIT after the writes).

1. WAIT's cost. ``--clients`` closed-loop senders (one asyncio process: each pushes a batch of
   ``--rows`` random delta rows, vocabulary 50k, fixed seed, under its own client id and next
   seq, waits for the answer and pushes the next) against each service in turn, ``--seconds``
   each after ``--warm`` seconds of warm-up, in ``--reps`` interleaved rounds (the order
   alternates). Per setting: pushes/s, rows/s, push latency p50 and p99 (ms), failed pushes;
   then min 1 / min 0 rows/s (target >= 0.70: the setting costs <= 30% of ingest throughput).
2. One failover under load. Both services pushed at once (fresh namespaces, ``--clients``
   senders each, a failed push sent again with the same seq until acknowledged); the master is
   SIGKILLed after ``--failover-warm`` seconds, the sentinels promote the replica, the old
   master comes back as its replica (as an orchestrator would), and the pushes go on for
   ``--failover-after`` seconds more. Per setting: seconds from the kill to the promotion,
   from the promotion to the first push acknowledged and to full ingest (the first 0.5 s
   window at >= 80% of the rate before the kill), counts acknowledged and stored, over-counted
   (must be 0) and acknowledged but missing, key by key. Loopback replicates at once, so
   nothing acknowledged goes missing here; tests/integration/test_redis_failover.py stalls
   the replica to show the window the setting closes.

Result checksum: section 1's namespaces hold exactly the rows acknowledged (each row counts 1),
per setting; section 2's are compared key by key. Figures are medians of the rounds.

    python tests/bench/bench_failover.py              # about 2 minutes
    python tests/bench/bench_failover.py --reps 5 --clients 16
    python tests/bench/bench_failover.py --quick      # checks the script (< 60 s; figures meaningless)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the redis and serve helpers
from helpers.redis_servers import RedisSentinelGroup
from helpers.service import SERVE_CLI

from bench.bench_overload import VOCAB, random_batches
from ngramcache import UNTAGGED
from ngramcache.cache_service.counts import open_counts_store
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.rows import COUNT
from ngramcache.client.wire.codec import bytes_to_delta_rows

SETTINGS = (0, 1)  # --counts-min-replicas of the two services
BATCHES = 128  # distinct random batches, pushed in turn
FULL_RATE = 0.8  # "full ingest": a 0.5 s window at this fraction of the rate before the kill
WINDOW_S = 0.5


@dataclass
class Tally:
    """What one setting's senders saw: answer times, latencies, batches acknowledged and never acknowledged."""

    acked_at: list[float] = field(default_factory=list)  # time.monotonic() of each acknowledged push
    latency_s: list[float] = field(default_factory=list)  # from the first send to the acknowledgement
    acked: list[int] = field(default_factory=list)  # batch index of each acknowledged push
    in_flight: list[int] = field(default_factory=list)  # batches never acknowledged when the senders stopped
    failed: int = 0  # push attempts that failed (each sent again)


async def senders(address: str, namespace: str, tag: str, clients: int, batches: list[bytes], stop: threading.Event,
                  tally: Tally, timeout: float) -> None:
    """``clients`` closed-loop senders until ``stop``: each pushes its next batch, again until acknowledged."""
    async with aio.insecure_channel(address) as ch:
        stub = counts_pb2_grpc.CountsStub(ch)

        async def one(c: int) -> None:
            seq = 0
            while not stop.is_set():
                index = (c * 7 + seq) % len(batches)
                request = counts_pb2.PushRequest(namespace=namespace, tokenizer_fingerprint=UNTAGGED,
                                                 client_id=f"{tag}-{c}", seq=seq, rows=batches[index])
                t0 = time.perf_counter()
                while True:
                    try:
                        await stub.Push(request, timeout=timeout)
                        break
                    except grpc.RpcError:
                        tally.failed += 1
                        if stop.is_set():
                            tally.in_flight.append(index)
                            return
                        await asyncio.sleep(0.02)
                tally.latency_s.append(time.perf_counter() - t0)
                tally.acked_at.append(time.monotonic())
                tally.acked.append(index)
                seq += 1

        await asyncio.gather(*(one(c) for c in range(clients)))


def run_senders(address: str, namespace: str, tag: str, clients: int, batches: list[bytes], seconds: float,
                timeout: float) -> Tally:
    stop = threading.Event()
    tally = Tally()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        asyncio.run(senders(address, namespace, tag, clients, batches, stop, tally, timeout))
    finally:
        timer.cancel()
    return tally


class Service:
    """One `ngramcache serve` over the group, with its --counts-min-replicas (its log in TMP/serve-N.log).

    Started in two steps, so that a Ctrl-C while it starts still finds the process to stop: the
    constructor starts it, `wait_listening` reads its port.
    """

    def __init__(self, tmp: Path, url: str, min_replicas: int) -> None:
        self.min_replicas = min_replicas
        self.log = tmp / f"serve-{min_replicas}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*SERVE_CLI, "serve", "--port", "0", "--data-dir", str(tmp / f"serve-{min_replicas}"),
                                          "--counts", url, "--counts-min-replicas", str(min_replicas),
                                          "--store-probe-interval", "0.2"],
                                         stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
        self.address = ""

    def wait_listening(self) -> None:
        assert self.proc.stdout is not None
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.proc.stdout.readline())
        if not m:
            raise SystemExit(f"ngramcache serve did not start; see {self.log}")
        self.address = f"127.0.0.1:{m.group(1)}"

    def create(self, namespace: str) -> None:
        with grpc.insecure_channel(self.address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                name=namespace, tokenizer_fingerprint=UNTAGGED, vocab_size=VOCAB), timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def stored_rows(url: str, namespace: str) -> np.ndarray:
    store = open_counts_store(url, socket_timeout=30)
    try:
        chunks = [np.asarray(c, dtype=np.int64) for c in store.export(namespace)]
    finally:
        store.close()
    return np.concatenate(chunks) if chunks else np.zeros((0, COUNT + 1), dtype=np.int64)


def compare(rows: list[np.ndarray], tally: Tally, store: np.ndarray) -> tuple[int, int, int, int]:
    """(counts acknowledged, stored, over-counted, acknowledged but missing), key by key (a batch never
    acknowledged may be stored: it counts as neither)."""
    keys = np.concatenate([r[:, :COUNT] for r in rows] + [store[:, :COUNT]]).astype(np.int64)
    _, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    k = int(inverse.max()) + 1 if len(inverse) else 0
    acked, maybe = np.zeros(k), np.zeros(k)
    times_acked = np.bincount(np.asarray(tally.acked, dtype=np.int64), minlength=len(rows))
    times_maybe = np.bincount(np.asarray(tally.in_flight, dtype=np.int64), minlength=len(rows))
    offset = 0
    for b, r in enumerate(rows):
        ids = inverse[offset:offset + len(r)]
        np.add.at(acked, ids, times_acked[b] * r[:, COUNT])
        np.add.at(maybe, ids, times_maybe[b] * r[:, COUNT])
        offset += len(r)
    held = np.bincount(inverse[offset:], weights=store[:, COUNT], minlength=k)
    over = np.maximum(0, held - acked - maybe).sum()
    missing = np.maximum(0, acked - held).sum()
    return int(acked.sum()), int(held.sum()), int(over), int(missing)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000 if values else float("nan")


def wait_cost(args: argparse.Namespace, services: dict[int, Service], url: str, batches: list[bytes],
              rows: list[np.ndarray]) -> bool:
    """Section 1; prints its table; returns whether each namespace holds exactly the rows acknowledged."""
    per_push = len(rows[0])
    print(f"\n## 1. WAIT's cost: {args.clients} closed-loop senders, {per_push} rows a push, {args.seconds:g} s a run "
          f"after {args.warm:g} s of warm-up, {args.reps} interleaved rounds", flush=True)
    figures: dict[int, dict[str, list[float]]] = {m: {"pushes": [], "rows": [], "p50": [], "p99": [], "failed": []}
                                                  for m in SETTINGS}
    acked_rows = dict.fromkeys(SETTINGS, 0)
    for rep in range(args.reps):
        for m in (SETTINGS if rep % 2 == 0 else SETTINGS[::-1]):
            service = services[m]
            tag = f"r{rep}"
            warm = run_senders(service.address, f"wait{m}", f"{tag}-warm", args.clients, batches, args.warm,
                               args.rpc_timeout)
            t = run_senders(service.address, f"wait{m}", tag, args.clients, batches, args.seconds, args.rpc_timeout)
            acked_rows[m] += (len(warm.acked) + len(t.acked)) * per_push
            span = args.seconds
            f = figures[m]
            f["pushes"].append(len(t.acked) / span)
            f["rows"].append(len(t.acked) * per_push / span)
            f["p50"].append(percentile_ms(t.latency_s, 50))
            f["p99"].append(percentile_ms(t.latency_s, 99))
            f["failed"].append(t.failed + warm.failed)
            print(f"  round {rep + 1}, --counts-min-replicas {m}: {f['rows'][-1]:,.0f} rows/s, "
                  f"{f['pushes'][-1]:,.0f} pushes/s, p50 {f['p50'][-1]:.1f} ms, p99 {f['p99'][-1]:.1f} ms, "
                  f"{t.failed + warm.failed} failed", flush=True)
    med = {m: {k: statistics.median(v) for k, v in f.items()} for m, f in figures.items()}
    print("\n| --counts-min-replicas | pushes/s | rows/s | push p50 ms | push p99 ms | failed pushes |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in SETTINGS:
        x = med[m]
        print(f"| {m} | {x['pushes']:,.0f} | {x['rows']:,.0f} | {x['p50']:.1f} | {x['p99']:.1f} | {x['failed']:.0f} |")
    ratio = med[1]["rows"] / med[0]["rows"] if med[0]["rows"] else float("nan")
    per_round = [a / b for a, b in zip(figures[1]["rows"], figures[0]["rows"]) if b]
    print(f"min 1 / min 0 ingest: {ratio:.2f}x rows/s (rounds: {', '.join(f'{r:.2f}' for r in per_round)}); "
          f"WAIT costs {100 * (1 - ratio):.0f}% of ingest throughput (target <= 30%); p50 "
          f"{med[1]['p50'] - med[0]['p50']:+.1f} ms, p99 {med[1]['p99'] - med[0]['p99']:+.1f} ms")
    ok = True
    for m in SETTINGS:
        total = int(stored_rows(url, f"wait{m}")[:, COUNT].sum())
        ok = ok and total == acked_rows[m]
        print(f"checksum, --counts-min-replicas {m}: store {total:,} == acknowledged {acked_rows[m]:,}: "
              f"{total == acked_rows[m]}")
    return ok


def full_after(tally: Tally, killed_at: float, promoted_at: float, before_s: float) -> float | None:
    """Seconds from the promotion to the first WINDOW_S window at >= FULL_RATE of the rate in the ``before_s`` seconds
    before the kill (None: never)."""
    acks = np.sort(np.asarray(tally.acked_at))
    rate = np.count_nonzero((acks >= killed_at - before_s) & (acks < killed_at)) / before_s
    if rate == 0:
        return None
    for start in acks[acks >= promoted_at]:
        if np.count_nonzero((acks >= start) & (acks < start + WINDOW_S)) / WINDOW_S >= FULL_RATE * rate:
            return float(start - promoted_at)
    return None


def one_failover(args: argparse.Namespace, services: dict[int, Service], group: RedisSentinelGroup,
                 batches: list[bytes], rows: list[np.ndarray]) -> bool:
    """Section 2; prints its table; returns whether nothing was over-counted."""
    print(f"\n## 2. One failover under load: both services pushed by {args.clients} senders each; the master SIGKILLed "
          f"after {args.failover_warm:g} s, {args.failover_after:g} s more after the promotion", flush=True)
    for m, service in services.items():
        service.create(f"failover{m}")
    tallies = {m: Tally() for m in SETTINGS}
    stop = threading.Event()
    marks: dict[str, float] = {}

    def orchestrate() -> None:
        try:
            if stop.wait(args.failover_warm):  # Ctrl-C
                return
            old = group.master()
            marks["killed"] = time.monotonic()
            old.kill()
            marks["promoted"] = group.wait_promoted(old)[1]
            group.rejoin(old)
            marks["rejoined"] = time.monotonic()
            stop.wait(args.failover_after)
        finally:
            stop.set()

    async def load() -> None:
        try:
            await asyncio.gather(
                asyncio.to_thread(orchestrate),
                *(senders(services[m].address, f"failover{m}", "f", args.clients, batches, stop, tallies[m],
                          args.rpc_timeout) for m in SETTINGS))
        finally:  # Ctrl-C: the orchestrating thread stops waiting
            stop.set()

    asyncio.run(load())
    killed, promoted = marks["killed"], marks["promoted"]
    print(f"replica promoted {promoted - killed:.2f} s after the kill; the old master back as its replica "
          f"{marks['rejoined'] - promoted:.2f} s after that")
    print("\n| --counts-min-replicas | first ack after promotion s | full ingest after promotion s | failed pushes "
          "(sent again) | counts acknowledged | stored | over-counted | acknowledged but missing |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    before_s = min(2.0, args.failover_warm / 2)
    for m in SETTINGS:
        t = tallies[m]
        later = [a for a in t.acked_at if a > promoted]
        first = f"{min(later) - promoted:.2f}" if later else "none"
        full = full_after(t, killed, promoted, before_s)
        acked, held, over, missing = compare(rows, t, stored_rows(group.url, f"failover{m}"))
        ok = ok and over == 0
        print(f"| {m} | {first} | {'never' if full is None else f'{full:.2f}'} | {t.failed} | {acked:,} | {held:,} "
              f"| {over} | {missing} |")
    print("(with --counts-min-replicas 1 the new master takes pushes again once it has a replica: the old master "
          "rejoined)")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of section 1 (default 5)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop senders per service (default 8)")
    ap.add_argument("--rows", type=int, default=512, help="delta rows a push (default 512)")
    ap.add_argument("--seconds", type=float, default=5.0, help="a measured run of section 1 (default 5)")
    ap.add_argument("--warm", type=float, default=1.0, help="warm-up before each run (default 1)")
    ap.add_argument("--failover-warm", type=float, default=5.0, help="pushing before the kill (default 5)")
    ap.add_argument("--failover-after", type=float, default=8.0, help="pushing after the promotion (default 8)")
    ap.add_argument("--rpc-timeout", type=float, default=10.0, help="deadline of a push (default 10)")
    ap.add_argument("--skip-failover", action="store_true", help="section 1 only")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in under a minute: 1 round of 1 s, 4 senders, a failover after 2 s "
                    "(figures meaningless)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.clients, args.seconds, args.warm = 1, 4, 1.0, 0.3
        args.failover_warm, args.failover_after = 2.0, 2.0
    if args.reps < 1 or args.clients < 1 or args.rows < 1 or min(args.seconds, args.failover_warm,
                                                                    args.failover_after) <= 0 or args.warm < 0:
        ap.error("--reps, --clients and --rows >= 1; --seconds, --failover-warm and --failover-after > 0; --warm >= 0")
    started = time.monotonic()
    batches = random_batches(np.random.default_rng(41), BATCHES, args.rows)
    rows = [bytes_to_delta_rows(b).astype(np.int64) for b in batches]
    ok = True
    try:
        with tempfile.TemporaryDirectory(prefix="ngc-bench-failover-") as tmp, RedisSentinelGroup() as group:
            print(f"a primary and a replica under 3 Sentinels ({group.url}), AOF everysec; 2 services, "
                  f"--counts-min-replicas {' and '.join(map(str, SETTINGS))}", flush=True)
            services: dict[int, Service] = {}
            try:
                for m in SETTINGS:
                    services[m] = Service(Path(tmp), group.url, m)
                for m in SETTINGS:
                    services[m].wait_listening()
                    services[m].create(f"wait{m}")
                ok = wait_cost(args, services, group.url, batches, rows)
                if not args.skip_failover:
                    ok = one_failover(args, services, group, batches, rows) and ok
            finally:
                for service in services.values():
                    service.close()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(f"\nchecksum: {'store == acknowledged, nothing over-counted' if ok else 'MISMATCH'}; total "
          f"{time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
