"""Soak: a fleet runs for --minutes (default 30) and its resources are sampled over time.

Three `ngramcache serve` replicas over a real redis-server (AOF), four `NgramClient` workers
drafting and pushing real text (CPython's standard library, byte tokens) in their own process,
and a rebuild every --rebuild-every seconds on a rotating replica (the others fetch it). Every
--sample seconds it records, per replica process and for the client process: RSS (MB) and
open file descriptors. At the end it prints the samples' table and, per process, the change
between the median of the first and of the last quarter of the run (a leak shows as growth
that does not level off). Drafts failed must be 0; the store's total must equal what the
clients got acknowledged.

    python tests/bench/soak_fleet.py                 # 30 minutes
    python tests/bench/soak_fleet.py --minutes 3     # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fleet_helpers, redis_servers
from helpers.fleet import NS, Replica, Worker, stdlib_texts
from helpers.redis_servers import RedisServer

from ngramcache import UNTAGGED, NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the fleet runs (default 30)")
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between samples (default 30)")
    ap.add_argument("--rebuild-every", type=float, default=120.0, help="seconds between rebuilds (default 120)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ngc-soak-"))
    stop = threading.Event()
    with RedisServer(args=["--appendonly", "yes", "--appendfsync", "everysec"]) as redis:
        replicas = [Replica(tmp, i, redis.url) for i in range(3)]
        clients: list[NgramClient] = []
        workers: list[Worker] = []
        samples: list[tuple[float, list[float], list[int]]] = []
        rebuilds: list[int] = []
        try:
            with grpc.insecure_channel(replicas[0].address) as ch:
                admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                    name=NS, tokenizer_fingerprint=UNTAGGED, vocab_size=256), timeout=20)
            for i in range(4):
                order = [replicas[(i + j) % 3].address for j in range(3)]
                clients.append(NgramClient(order, NS, (UNTAGGED, 256), cache_dir=tmp / f"node-{i % 2}"))
            texts = stdlib_texts()
            workers = [Worker(i, c, texts, stop) for i, c in enumerate(clients)]
            for w in workers:
                w.start()
            pids = [r.proc.pid for r in replicas] + [os.getpid()]
            start = time.monotonic()
            next_sample = next_rebuild = start
            print(f"soak: {args.minutes:g} min, 3 replicas, 4 clients; sampling every {args.sample:g} s", flush=True)
            while time.monotonic() - start < args.minutes * 60:
                now = time.monotonic()
                if now >= next_sample:
                    samples.append((now - start, [rss_mb(p) for p in pids], [open_fds(p) for p in pids]))
                    t, rss, fds = samples[-1]
                    print(f"  {t / 60:5.1f} min  RSS MB {' '.join(f'{x:7.1f}' for x in rss)}  fds "
                          f"{' '.join(f'{x:4d}' for x in fds)}  drafts {sum(w.drafts for w in workers):,}", flush=True)
                    next_sample += args.sample
                if now >= next_rebuild and now > start + 10:
                    replica = replicas[len(rebuilds) % 3]
                    with grpc.insecure_channel(replica.address) as ch:
                        status = admin_pb2_grpc.AdminStub(ch).StartRebuild(
                            admin_pb2.StartRebuildRequest(namespace=NS, wait=True), timeout=600)
                    rebuilds.append(int(status.generation) if status.state == "done" else -1)
                    next_rebuild += args.rebuild_every
                time.sleep(0.5)
        finally:
            stop.set()
            for w in workers:
                w.join(30)
            stats = []
            for c in clients:
                c.close()
                stats.append(c.stats())
            with grpc.insecure_channel(replicas[1].address) as ch:
                chunks = counts_pb2_grpc.CountsStub(ch).Pull(
                    counts_pb2.PullRequest(namespace=NS, tokenizer_fingerprint=UNTAGGED), timeout=120)
                total = sum(int(bytes_to_count_rows(c.rows)[:, 6].sum()) for c in chunks)
            for r in replicas:
                r.stop()

    names = ["replica 0", "replica 1", "replica 2", "clients"]
    quarter = max(1, len(samples) // 4)
    print("\nchange from the first to the last quarter of the run (medians of the samples):")
    for k, name in enumerate(names):
        first_rss = statistics.median(s[1][k] for s in samples[:quarter])
        last_rss = statistics.median(s[1][k] for s in samples[-quarter:])
        first_fd = statistics.median(s[2][k] for s in samples[:quarter])
        last_fd = statistics.median(s[2][k] for s in samples[-quarter:])
        print(f"  {name:<10} RSS {first_rss:7.1f} -> {last_rss:7.1f} MB ({last_rss - first_rss:+.1f}), "
              f"fds {first_fd:.0f} -> {last_fd:.0f}")
    print(f"drafts {sum(w.drafts for w in workers):,}, failed {sum(w.failures for w in workers)}, slowest "
          f"{max(w.slowest for w in workers) * 1e3:.1f} ms; rebuilds {rebuilds}; store total {total:,} vs acknowledged "
          f"{sum(s['acked_count'] for s in stats):,}; dropped {sum(s['dropped_rows'] for s in stats)}")
    return 0 if sum(w.failures for w in workers) == 0 and total == sum(s["acked_count"] for s in stats) else 1


if __name__ == "__main__":
    sys.exit(main())
