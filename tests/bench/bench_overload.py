"""Benchmark of overload: the ingest rate at which one replica on a local redis-server starts
shedding pushes, per core, and what a client reports when fed 2x and 5x past it.

Everything runs on this machine over loopback: a redis-server (AOF, ``--fsync`` policy,
default ``always`` as in the fleet tests) and one `ngramcache serve` process over it.

1. Shedding point. An open-loop load generator (one asyncio process) sends Push batches of
   ``--batch`` random delta rows (fixed seed, a vocabulary of 50k tokens: rows rarely
   repeat) at a fixed rate, each under a fresh client id with a ``--rpc-timeout`` deadline,
   whatever the answers; the rate doubles from ``--start`` rows/s until more than 1% of the
   batches are shed (RESOURCE_EXHAUSTED, reason OVERLOADED), then two bisection steps. The
   shedding point is the highest rate with at most 1% shed. Per core: that rate divided by
   the CPUs the replica and redis-server used at it (their CPU seconds per second, from
   /proc), and by the machine's CPU count.
2. Past it. One `NgramClient` (defaults but ``push_interval`` 0.05 and ``close_timeout``
   60) accepts random token streams paced to offer 2x and then 5x the shedding
   point in raw delta rows (about 4 a token), for ``--seconds``; then `close` flushes. What
   its ``stats()`` says: rows offered (drained) per second, acknowledged per second, dropped,
   pushes shed (``overloaded``), rate halvings, seconds waited on retry-after hints, the push
   window and batch rows it ended at.

Result checksum: after each client run, the store's total count of the namespace equals the
client's ``acked_count`` (printed as ``store == acked``). Figures are medians of ``--reps``
runs (a new replica, redis-server and namespace each).

    python tests/bench/bench_overload.py               # about 4 minutes
    python tests/bench/bench_overload.py --reps 1 --seconds 8
    python tests/bench/bench_overload.py --quick       # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the redis and serve helpers
from helpers.redis_servers import RedisServer
from helpers.service import start_serve, stop_serve

from ngramcache import UNTAGGED, NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.rows import DELTA_DTYPE, NGRAM_MAX, ROW_WIDTH
from ngramcache.client.wire.codec import bytes_to_count_rows, delta_rows_to_bytes

NS = "overload"
VOCAB = 50_000
SHED_FRACTION = 0.01


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def random_batches(rng: np.random.Generator, count: int, rows: int) -> list[bytes]:
    out = []
    for _ in range(count):
        n = rng.integers(1, NGRAM_MAX + 1, rows)
        b = np.full((rows, ROW_WIDTH), -1, dtype=DELTA_DTYPE)
        b[:, 0] = n
        toks = rng.integers(0, VOCAB, (rows, NGRAM_MAX))
        toks[np.arange(NGRAM_MAX)[None, :] >= n[:, None]] = -1
        b[:, 1:1 + NGRAM_MAX] = toks
        b[:, 1 + NGRAM_MAX] = rng.integers(0, VOCAB, rows)
        b[:, 2 + NGRAM_MAX] = 1
        out.append(delta_rows_to_bytes(b))
    return out


async def offer(address: str, rate: float, seconds: float, batches: list[bytes], batch_rows: int,
                timeout: float, tag: str) -> dict[str, float]:
    """Send batches open-loop at ``rate`` rows/s for ``seconds``; count the answers."""
    counts = {"acked": 0, "shed": 0, "timeout": 0, "other": 0}
    interval = batch_rows / rate
    async with aio.insecure_channel(address) as ch:
        stub = counts_pb2_grpc.CountsStub(ch)
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int) -> None:
            request = counts_pb2.PushRequest(namespace=NS, tokenizer_fingerprint=UNTAGGED, client_id=f"{tag}-{i}",
                                             seq=1, rows=batches[i % len(batches)])
            try:
                await stub.Push(request, timeout=timeout)
                counts["acked"] += 1
            except grpc.RpcError as e:
                code = e.code()
                key = ("shed" if code == grpc.StatusCode.RESOURCE_EXHAUSTED
                       else "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "other")
                counts[key] += 1

        loop = asyncio.get_running_loop()
        start = loop.time()
        i = 0
        while (now := loop.time()) < start + seconds:
            due = start + i * interval
            if due > now:
                await asyncio.sleep(due - now)
            task = loop.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:
            await asyncio.wait(tasks, timeout=timeout + 5)
    counts["sent"] = i
    return counts


class Fleet:
    """A redis-server and one `ngramcache serve` over it, with the namespace created."""

    def __init__(self, tmp: Path, fsync: str) -> None:
        self.redis = RedisServer(args=["--appendonly", "yes", "--appendfsync", fsync]).start()
        self.proc, port = start_serve(tmp / "replica", "--counts", self.redis.url)
        self.address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(self.address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name=NS, tokenizer_fingerprint=UNTAGGED, vocab_size=VOCAB), timeout=30)

    def cpu(self) -> float:
        assert self.redis.pid is not None
        return cpu_seconds(self.proc.pid) + cpu_seconds(self.redis.pid)

    def store_total(self) -> int:
        with grpc.insecure_channel(self.address) as ch:
            chunks = counts_pb2_grpc.CountsStub(ch).Pull(
                counts_pb2.PullRequest(namespace=NS, tokenizer_fingerprint=UNTAGGED), timeout=120)
            return sum(int(bytes_to_count_rows(c.rows)[:, 6].sum()) for c in chunks)

    def close(self) -> None:
        stop_serve(self.proc)
        self.redis.cleanup()


def step(fleet: Fleet, rate: float, args: argparse.Namespace, batches: list[bytes], tag: str) -> tuple[float, float]:
    """(shed fraction, CPUs used by replica + redis) at ``rate`` rows/s."""
    cpu0, t0 = fleet.cpu(), time.monotonic()
    counts = asyncio.run(offer(fleet.address, rate, args.step_seconds, batches, args.batch, args.rpc_timeout, tag))
    cpus = (fleet.cpu() - cpu0) / (time.monotonic() - t0)
    failed = counts["shed"] + counts["timeout"] + counts["other"]
    print(f"  {rate:>10,.0f} rows/s: {counts['sent']} batches, {counts['acked']} acked, {counts['shed']} shed, "
          f"{counts['timeout']} timed out, {counts['other']} other; replica+redis {cpus:.2f} CPUs", flush=True)
    return failed / max(1, counts["sent"]), cpus


def shedding_point(fleet: Fleet, args: argparse.Namespace, rep: int) -> tuple[float, float]:
    batches = random_batches(np.random.default_rng(rep), 64, args.batch)
    step(fleet, args.start / 2, args, batches, f"warm-{rep}")  # warm-up: connections, scripts, throughput estimate
    ok_rate, ok_cpus = 0.0, 0.0
    rate = args.start
    while True:
        fraction, cpus = step(fleet, rate, args, batches, f"r{rep}-{rate:.0f}")
        if fraction > SHED_FRACTION:
            break
        ok_rate, ok_cpus = rate, cpus
        rate *= 2
    low, high = ok_rate, rate
    for _ in range(2):
        mid = (low + high) / 2
        fraction, cpus = step(fleet, mid, args, batches, f"r{rep}-{mid:.0f}")
        if fraction > SHED_FRACTION:
            high = mid
        else:
            low, ok_cpus = mid, cpus
    return low, ok_cpus


def feed(client: NgramClient, rows_per_second: float, seconds: float, seed: int) -> None:
    """Accept random token streams paced to offer about ``rows_per_second`` raw delta rows (4 a token)."""
    drafter = client.drafter()
    rng = np.random.default_rng(seed)
    tokens_per_second = rows_per_second / 4
    start, fed, seq = time.monotonic(), 0, 0
    while time.monotonic() < start + seconds:
        seq += 1
        tokens = rng.integers(0, VOCAB, 8192).astype(np.int32)
        for end in range(512, len(tokens) + 1, 512):
            drafter.accept(seq, tokens[:end])
            fed += 512
            ahead = start + fed / tokens_per_second - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            if time.monotonic() >= start + seconds:
                break
        drafter.reset(seq)


def past_it(fleet: Fleet, rows_per_second: float, args: argparse.Namespace, tmp: Path, seed: int) -> dict[str, float]:
    client = NgramClient(fleet.address, NS, (UNTAGGED, VOCAB), cache_dir=tmp / f"cache-{seed}", push_interval=0.05,
                         close_timeout=60.0)
    t0 = time.monotonic()
    feeder = threading.Thread(target=feed, args=(client, rows_per_second, args.seconds, seed))
    feeder.start()
    feeder.join()
    fed = time.monotonic() - t0
    before_close = client.stats()
    client.close()
    s = client.stats()
    total = fleet.store_total()
    return {"offered": s["drained_rows"] / fed, "acked_per_s": before_close["acked_rows"] / fed,
            "acked": s["acked_rows"], "dropped": s["dropped_rows"], "shed": s["overloaded"],
            "halvings": s["overload_waits"], "waited": s["retry_wait_seconds"], "window": s["push_window"],
            "batch_rows": s["push_batch_rows"], "checksum_ok": float(total == s["acked_count"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4096, help="rows of a pushed batch (load generator)")
    parser.add_argument("--start", type=float, default=25_000, help="first rate tried, rows/s")
    parser.add_argument("--step-seconds", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the client is fed at 2x and 5x")
    parser.add_argument("--rpc-timeout", type=float, default=1.0, help="deadline of the load generator's pushes")
    parser.add_argument("--fsync", choices=("always", "everysec", "no"), default="always")
    parser.add_argument("--quick", action="store_true",
                        help="checks the script in seconds: 1 run, steps of 0.3 s from 100,000 rows/s, the client fed 0.3 s "
                        "past 20,000 rows/s at most "
                        "(figures meaningless)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.start, args.step_seconds, args.seconds = 1, 100_000, 0.3, 0.3
    cores = os.cpu_count() or 1
    points, cpus_used, runs = [], [], {2: [], 5: []}
    with tempfile.TemporaryDirectory(prefix="ngc-bench-overload-") as tmp:
        for rep in range(args.reps):
            print(f"run {rep + 1}/{args.reps}: finding the shedding point", flush=True)
            fleet = Fleet(Path(tmp) / f"run-{rep}", args.fsync)
            try:
                point, cpus = shedding_point(fleet, args, rep)
                points.append(point)
                cpus_used.append(cpus)
                print(f"  shedding starts above {point:,.0f} rows/s ({cpus:.2f} CPUs busy)", flush=True)
            finally:
                fleet.close()
            for factor in (2, 5):
                fleet = Fleet(Path(tmp) / f"run-{rep}-{factor}x", args.fsync)
                try:  # a replica that shed at the first rate tried: fed past half of it; --quick: a small flush
                    fed_at = min(point, 20_000) if args.quick else point
                    r = past_it(fleet, factor * (fed_at or args.start / 2), args, Path(tmp), 100 * rep + factor)
                finally:
                    fleet.close()
                runs[factor].append(r)
                print(f"  {factor}x: offered {r['offered']:,.0f} rows/s, acked {r['acked_per_s']:,.0f} rows/s, "
                      f"dropped {r['dropped']:,.0f} rows, shed {r['shed']:.0f} pushes, {r['halvings']:.0f} halvings, "
                      f"waited {r['waited']:.1f} s, window {r['window']:.1f} x {r['batch_rows']:.0f} rows, "
                      f"store == acked: {bool(r['checksum_ok'])}", flush=True)
    point, cpus = statistics.median(points), statistics.median(cpus_used)
    print(f"\nmedians of {args.reps} runs (fsync {args.fsync}, generator batches of {args.batch} rows, deadline "
          f"{args.rpc_timeout:g} s, {cores} CPUs):")
    print(f"  shedding point: {point:,.0f} rows/s; {point / max(cpus, 0.01):,.0f} rows/s per busy CPU (replica + redis used "
          f"{cpus:.2f}); {point / cores:,.0f} rows/s per core of the machine")
    for factor, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"  {factor}x ({factor * point:,.0f} rows/s asked): offered {med['offered']:,.0f} rows/s, acked "
              f"{med['acked_per_s']:,.0f} rows/s, dropped {med['dropped']:,.0f} rows, shed {med['shed']:.0f} pushes, "
              f"{med['halvings']:.0f} halvings, retry waits {med['waited']:.1f} s, window {med['window']:.1f} x "
              f"{med['batch_rows']:.0f} rows")
    ok = all(r["checksum_ok"] for rs in runs.values() for r in rs)
    print(f"checksum: store == acked in {sum(int(r['checksum_ok']) for rs in runs.values() for r in rs)}/"
          f"{sum(len(rs) for rs in runs.values())} client runs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
