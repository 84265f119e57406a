"""One namespace's fleet-history appends on a 3-master Redis Cluster: one stream (the layout before partitions) against H partitions, per busy Redis core (prints figures; not a test).

    python tests/bench/bench_history_partitions.py [--layouts 1d,1,3,12] [--procs 2] [--clients 64] [--seconds 6]
                                                   [--repeats 3]
    python tests/bench/bench_history_partitions.py --quick     # checks the script (figures meaningless)

It starts its own 3-master Redis Cluster on 127.0.0.1 (no persistence). Each run creates one
namespace with ``history_partitions`` H (1 is the single stream every namespace had before
partitions, in its coordinator slot; ``1d`` is that stream appended as before this change, one
store call per batch), and ``--procs`` processes append to it for
``--seconds``, each as a service replica would: ``--clients`` concurrent senders push through
the replica's push path (`HistoryTails.push`, which gathers the batches that wait while a
store call is in flight into one `append_history_many`: one HAPPEND per partition for all of
them). Each sender has 4 live groups of 8 sibling sequences; a batch is 16 records of 4..32
tokens (uniform, seed per process) from random live sequences of its sender, one batch in
flight per sender. Redis CPU is INFO cpu (used_cpu_user + used_cpu_sys) of each master
before and after; a run's figure is tokens appended per second of Redis CPU (tokens per busy
Redis core). The layouts alternate within each repeat, and the medians of ``--repeats`` are
compared. The spread is each master's share of the namespace's records (XLEN of the
partitions it holds) and of the Redis CPU, against the mean.
Target: H = 3 within +-20% of the mean on every master, at >= 0.9x the tokens per busy Redis
core of a single stream per namespace (``1d``, the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
import zlib
from collections import Counter
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for redis_servers

from helpers.redis_servers import RedisClusterProcesses

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.history import HistoryRecord
from ngramcache.cache_service.history_tail import HistoryTails
from ngramcache.cache_service.store_runner import StoreRunner

VOCAB = 128_256  # Llama 3
FP = bytes(range(32))
PER_BATCH = 16
GROUPS_PER_CLIENT = 4
SIBLINGS = 8
NAMES = {"1d": "1d: one stream, a call per batch (before)", "1": "1: one stream, gathered"}
OPTIONS: dict[str, Any] = {"history_max_bytes": 1 << 36, "history_max_age": 1e6, "socket_timeout": 30}


def worker(url: str, namespace: str, proc: int, clients: int, seconds: float, start: Any, out: Any,
           direct: bool) -> None:
    """Push batches through a replica's push path until ``seconds`` after ``start``; put (tokens, records) on ``out``."""
    store = open_counts_store(url, **OPTIONS)
    runner = StoreRunner(store)
    rng = np.random.default_rng(proc)
    store.append_history(namespace, f"warm-{proc}", 1, [])  # connections and scripts before the clock starts

    async def sender(c: int, tails: HistoryTails, deadline: float, totals: list[int]) -> None:
        offsets = [0] * (GROUPS_PER_CLIENT * SIBLINGS)
        client_id = f"proc{proc}-client{c:03d}-{'x' * 20}"  # ~36 characters, as a UUID
        batch_seq = 0
        while time.perf_counter() < deadline:
            batch = []
            for _ in range(PER_BATCH):
                s = int(rng.integers(0, GROUPS_PER_CLIENT * SIBLINGS))
                n = int(rng.integers(4, 33))
                batch.append(HistoryRecord("", s, f"p{proc}-c{c}-g{s // SIBLINGS}", offsets[s],
                                           rng.integers(0, VOCAB, n, dtype=np.int32)))
                offsets[s] += n
            batch_seq += 1
            if direct:  # the path before this change: one append_history (one HAPPEND) per batch
                done = await runner.call(store.append_history, namespace, client_id, batch_seq, batch, fingerprint=FP)
            else:
                done = await tails.push(namespace, client_id, batch_seq, batch, FP)
            totals[0] += done.tokens
            totals[1] += done.records

    async def body() -> list[int]:
        tails = HistoryTails(runner)
        totals = [0, 0]
        await asyncio.to_thread(start.wait)
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(sender(c, tails, deadline, totals) for c in range(clients)))
        await tails.close()
        return totals

    tokens, records = asyncio.run(body())
    runner.close()
    store.close()
    out.put((tokens, records))


def redis_cpu(cluster: RedisClusterProcesses) -> dict[int, float]:
    cpu = {}
    for node in cluster.nodes:
        client = node.client()
        try:
            info = client.info("cpu")
            cpu[node.port] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        finally:
            client.close()
    return cpu


def run(cluster: RedisClusterProcesses, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    partitions, direct = int(layout.rstrip("d")), layout.endswith("d")
    store = open_counts_store(cluster.url, history_partitions=partitions, **OPTIONS)
    namespace = "bench-" + uuid.uuid4().hex[:8]
    try:
        info = store.create_namespace(namespace, FP, VOCAB)
        assert info.history_partitions == partitions
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(cluster.url, namespace, p, args.clients, args.seconds, start, out,
                                                  direct))
                 for p in range(args.procs)]
        for p in procs:
            p.start()
        time.sleep(1.0 if args.quick else 3.0)  # the workers connect and load the scripts first
        before = redis_cpu(cluster)
        began = time.perf_counter()
        start.set()
        results = [out.get(timeout=args.seconds + 120) for _ in procs]
        wall = time.perf_counter() - began
        after = redis_cpu(cluster)
        for p in procs:
            p.join()
        tokens = sum(r[0] for r in results)
        records = sum(r[1] for r in results)
        cpu = {port: after[port] - before[port] for port in before}
        handle = store._handle(namespace)  # type: ignore[attr-defined]
        client = store._conn.client  # type: ignore[attr-defined]
        per_master: Counter[int] = Counter({port: 0 for port in before})
        for keys in handle.history:
            per_master[client.get_node_from_key(keys.stream).port] += client.xlen(keys.stream)
        stats = store.history_stats(namespace)
        assert stats["records"] == records, (stats, records)  # every acknowledged record is kept, once
        return {"tokens": tokens, "records": records, "wall": wall, "cpu": cpu, "per_master": dict(per_master)}
    finally:
        store.drop_namespace(namespace)
        store.close()


def spread(values: dict[int, float]) -> float:
    """Largest deviation of a master's value from the mean, as a fraction of the mean."""
    mean = sum(values.values()) / len(values)
    return max(abs(v - mean) for v in values.values()) / mean if mean else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="1d,1,3,12",
                        help="history partitions of each run; 'd': one store call per batch, the path before "
                             "partitions (the first is the baseline)")
    parser.add_argument("--procs", type=int, default=2, help="replica processes")
    parser.add_argument("--clients", type=int, default=64, help="concurrent senders per process")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of one run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="checks the script: 1 s runs, 1 process (figures meaningless)")
    args = parser.parse_args()
    if args.quick:
        args.procs, args.clients, args.seconds, args.repeats = 1, 8, 1.0, 1
    layouts = args.layouts.split(",")
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in layouts}
    with RedisClusterProcesses(masters=3) as cluster:
        for _ in range(args.repeats):
            for p in layouts:
                runs[p].append(run(cluster, p, args))
    print(f"3-master Redis Cluster on loopback, {args.procs} replica processes x {args.clients} concurrent senders, "
          f"{PER_BATCH} records of 4..32 tokens a batch, {GROUPS_PER_CLIENT} groups of {SIBLINGS} siblings a sender, "
          f"{args.seconds:g} s a run, medians of {args.repeats}")
    print()
    print("| layout | tokens/s | Redis CPU, cores busy | tokens per busy Redis core | records per master "
          "(max off the mean) | Redis CPU per master (max off the mean) |")
    print("|---|---:|---:|---:|---|---|")
    per_core: dict[str, float] = {}
    worst_spread: dict[str, float] = {}
    for p in layouts:
        rates = [r["tokens"] / r["wall"] for r in runs[p]]
        busy = [sum(r["cpu"].values()) / r["wall"] for r in runs[p]]
        cores = [r["tokens"] / sum(r["cpu"].values()) for r in runs[p]]
        per_core[p] = statistics.median(cores)
        last = runs[p][len(runs[p]) // 2]
        record_spread = max(spread({k: float(v) for k, v in r["per_master"].items()}) for r in runs[p])
        cpu_spread = max(spread(r["cpu"]) for r in runs[p])
        worst_spread[p] = record_spread
        shares = "/".join(f"{v / max(1, sum(last['per_master'].values())):.0%}" for v in last["per_master"].values())
        cpu_shares = "/".join(f"{v / max(1e-9, sum(last['cpu'].values())):.0%}" for v in last["cpu"].values())
        name = NAMES.get(p, f"H={p.rstrip('d')}" + (", a call per batch" if p.endswith("d") else ", gathered"))
        print(f"| {name} | {statistics.median(rates):,.0f} | {statistics.median(busy):.2f} | {per_core[p]:,.0f} | "
              f"{shares} ({record_spread:.0%}) | {cpu_shares} ({cpu_spread:.0%}) |")
    print()
    base = layouts[0]
    for p in layouts[1:]:
        ratio = per_core[p] / per_core[base]
        if int(p.rstrip("d")) == 1:
            print(f"{p} vs {base}: {ratio:.2f}x tokens per busy Redis core (one stream: one master)")
            continue
        verdict = "met" if ratio >= 0.9 and worst_spread[p] <= 0.2 else "missed"
        same_path = f"; {per_core[p] / per_core['1']:.2f}x the one stream gathered too" if "1" in per_core else ""
        print(f"{p} vs {base}: {ratio:.2f}x tokens per busy Redis core, records within {worst_spread[p]:.0%} of the "
              f"mean on every master (target >= 0.9x and <= 20%: {verdict}){same_path}")
    crc = 0
    for p in layouts:
        for r in runs[p]:
            crc = zlib.crc32(str(r["records"]).encode(), crc)
    print(f"checksum {crc:08x}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
