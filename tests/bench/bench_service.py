"""Benchmark of the gRPC service: session steps against a bare echo server, pushes
against the counts store called directly, memory per session, 1 vs 2 workers, and the PSS of a
generation mapped by 2 workers.

Everything runs on this machine over loopback: the service is a real `ngramcache serve`
process, the baseline a bare grpc.aio bidirectional echo server (`ECHO_SERVER` in
tests/bench/lib/service_processes.py) answering each message with one of the same size as a draft reply.

1. Session step: each of C concurrent sessions (C = 1, 16, 64) sends one new token per step
   and waits for the draft of 8 tokens; p50 / p99 step latency and steps/s over all
   sessions, side by side with the echo server under the same client code.
2. Push: real n-gram deltas (each CPython standard-library file counted as llama.cpp counts
   a sequence, 1..4-grams, in batches of --batch rows) pushed through the service into a
   local redis-server (client id + seq, exactly once), by one client with 8 pushes in
   flight and by --clients clients with 2 each (their batches overlap: the service sums
   the batches of the pushes it groups). Each against the direct call doing the same work
   from one process: one client against `CountsStore.apply_group` with one batch a call (one
   batch a store unit: "direct single"), the aggregated clients against
   `CountsStore.apply_group` with the same batches summed, one per client a call.
3. Memory: the service's RSS before and after opening 1000 idle sessions, and after 1000
   sessions of 1k tokens each; per session.
4. Workers: session steps (64 sessions over 8 separate connections: SO_REUSEPORT spreads
   connections, not calls) against `serve --workers 1` and `serve --workers 2` over the same
   redis-server, and against the echo server (the load generator's ceiling); steps/s 2 / 1
   and the CPUs each process kept busy. The load generator is one Python process on the same
   CPUs as the workers and redis: on a 2-CPU machine it caps the figure.
5. PSS: one ~90 MB generation (synthetic Zipf tokens, fixed seed) published through
   StaticFiles.Publish to `serve --workers 2`, opened by both workers (Drafts over new
   connections until each maps it), then Rss and Pss of the .ngc mapping in each worker from
   /proc/<pid>/smaps after more Drafts (--pss-drafts): the sum of Pss against the file size.

Figures are medians of --reps runs.

    python tests/bench/bench_service.py            # about 3 minutes
    python tests/bench/bench_service.py --quick    # checks the script (seconds; figures meaningless)
    python tests/bench/bench_service.py --only workers --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from ngramcache import CountTable
from ngramcache.cache_service.counts import ApplyResult, CountsStore, GroupItem, open_counts_store
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.rows import COUNT
from ngramcache.client.wire.codec import delta_rows_to_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the bench library, the Redis helpers
from bench.lib.proc_stats import CpuMeter, ngc_mapping, rss_kib
from bench.lib.service_load import FP, VOCAB, draft_many, hold_sessions, push_clients, push_requests, session_steps
from bench.lib.service_processes import ECHO_SERVER, start_process, start_workers, stop_process


def stdlib_streams(limit: int) -> list[np.ndarray]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 4000)
    return [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int32) for p in files[:limit]]


# ----------------------------------------------------------------------------- session steps


def bench_sessions(args: argparse.Namespace, service_port: int, echo_port: int, text: np.ndarray) -> None:
    print("\n## Session step: send 1 new token, receive a draft of 8 (echo: the same sizes, no work)")
    print(f"{'sessions':>8} {'server':>10} {'p50 us':>9} {'p99 us':>9} {'steps/s':>10}")
    for c in (1, 4) if args.quick else (1, 16, 64):
        steps = max(20 if args.quick else 50, args.steps // c)
        res: dict[str, tuple[float, float, float]] = {}
        for name, port, echo in (("echo", echo_port, True), ("ngramcache", service_port, False)):
            p50s, p99s, rates = [], [], []
            asyncio.run(session_steps(port, c, 20, echo, text))  # warm-up
            for _ in range(args.reps):
                lat, wall = asyncio.run(session_steps(port, c, steps, echo, text))
                p50s.append(np.percentile(lat, 50) * 1e6)
                p99s.append(np.percentile(lat, 99) * 1e6)
                rates.append(len(lat) / wall)
            res[name] = (statistics.median(p50s), statistics.median(p99s), statistics.median(rates))
            print(f"{c:>8} {name:>10} {res[name][0]:>9.0f} {res[name][1]:>9.0f} {res[name][2]:>10.0f}")
        e, n = res["echo"], res["ngramcache"]
        print(f"{'':>8} {'ratio':>10} {n[0] / e[0]:>8.2f}x {n[1] / e[1]:>8.2f}x {n[2] / e[2]:>9.2f}x   "
              "(targets: p50 <= 1.5x echo, steps/s >= 0.7x echo)")


# ----------------------------------------------------------------------------- pushes


def delta_batches(streams: list[np.ndarray], batch: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    n = 0
    for s in streams:
        t = CountTable()
        t.update(s)
        rows = t.to_rows()
        pending.append(rows)
        n += len(rows)
        while n >= batch:
            allrows = np.concatenate(pending)
            out.append(np.ascontiguousarray(allrows[:batch]))
            pending, n = [allrows[batch:]], len(allrows) - batch
    if n:
        out.append(np.ascontiguousarray(np.concatenate(pending)))
    return out


def total_count(store: CountsStore, namespace: str) -> int:
    return sum(int(chunk[:, COUNT].sum()) for chunk in store.export(namespace))


def push_lines(med: dict[str, float], k: int, runs: Callable[[str], str] = lambda name: "") -> list[str]:
    """The Push figures, each against the direct call doing the same work: one client's pushes (one batch a
    store unit) against `CountsStore.apply_group` of one batch a call ("direct single"), the aggregated pushes
    of k clients (the service sums the batches it groups) against `CountsStore.apply_group` of k batches a call
    (the same summing, from one process)."""
    return [
        f"direct CountsStore.apply_group, one batch a call (single): {med['direct']:,.0f} rows/s (runs: {runs('direct')})",
        f"direct CountsStore.apply_group, {k} batches a call:        {med['direct_group']:,.0f} rows/s "
        f"(runs: {runs('direct_group')})   {med['direct_group'] / med['direct']:.2f}x direct single",
        f"service, 1 client, 8 pushes in flight:                  {med['one']:,.0f} rows/s (runs: {runs('one')})   "
        f"{med['one'] / med['direct']:.2f}x direct single (target >= 0.8x)",
        f"service, {k} clients, 2 pushes in flight each:            {med['many']:,.0f} rows/s (runs: {runs('many')})   "
        f"{med['many'] / med['direct_group']:.2f}x direct apply_group (target > 1x: aggregation, against the same "
        f"summing done directly; {med['many'] / med['direct']:.2f}x direct single)",
    ]


def bench_push(args: argparse.Namespace, service_port: int, redis_url: str, streams: list[np.ndarray],
               pids: dict[str, int]) -> None:
    """One client with 8 pushes in flight, then `--clients` clients with 2 each (their batches overlap: the
    same language, other files), through the service and applied directly with `CountsStore.apply_group` from
    one process: one batch a call, and one batch per client a call."""
    batches = delta_batches(streams, args.batch)
    n_rows = sum(len(b) for b in batches)
    k = args.clients
    per_client = [batches[c::k] for c in range(k)]
    print(f"\n## Push: {n_rows:,} real n-gram delta rows ({len(streams)} files, 1..4-grams) in {len(batches)} batches "
          f"of {args.batch:,}, into one local redis-server")
    admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{service_port}"))
    store = open_counts_store(redis_url, socket_timeout=120)
    figures: dict[str, list[float]] = {name: [] for name in ("direct", "one", "direct_group", "many")}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in figures}
    pids = {**pids, "client": os.getpid()}
    checksums: set[int] = set()
    for rep in range(args.reps):
        ns = f"push{rep}"
        # Direct, one process, one batch a call: the baseline of both service figures.
        store.create_namespace(ns + "w", FP, VOCAB)
        store.apply_group(ns + "w", [GroupItem("warm-up", 0, batches[0][:100])])  # loads the scripts, opens connections
        store.drop_namespace(ns + "w")
        store.create_namespace(ns + "d", FP, VOCAB)
        meter = CpuMeter(pids)
        t0 = time.perf_counter()
        for i in range(len(per_client[0])):
            for c in range(k):
                if i < len(per_client[c]):
                    store.apply_group(ns + "d", [GroupItem(f"bench-{c}", i, per_client[c][i])])
        figures["direct"].append(n_rows / (time.perf_counter() - t0))
        cpu["direct"].append(meter.per_row(n_rows))
        # Direct apply_group: the same batches, one batch per client a call.
        store.create_namespace(ns + "g", FP, VOCAB)
        meter = CpuMeter(pids)
        t0 = time.perf_counter()
        for i in range(len(per_client[0])):
            items = [GroupItem(f"bench-{c}", i, per_client[c][i]) for c in range(k) if i < len(per_client[c])]
            assert all(isinstance(o, ApplyResult) for o in store.apply_group(ns + "g", items))
        figures["direct_group"].append(n_rows / (time.perf_counter() - t0))
        cpu["direct_group"].append(meter.per_row(n_rows))
        # Through the service: one client, 8 in flight.
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=ns + "s", tokenizer_fingerprint=FP,
                                                               vocab_size=VOCAB))
        one = [push_requests(ns + "s", "bench", batches)]
        meter = CpuMeter(pids)
        figures["one"].append(n_rows / asyncio.run(push_clients(service_port, one, 8)))
        cpu["one"].append(meter.per_row(n_rows))
        # Through the service: k clients, 2 in flight each.
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=ns + "m", tokenizer_fingerprint=FP,
                                                               vocab_size=VOCAB))
        many = [push_requests(ns + "m", f"bench-{c}", per_client[c]) for c in range(k)]
        meter = CpuMeter(pids)
        figures["many"].append(n_rows / asyncio.run(push_clients(service_port, many, 2)))
        cpu["many"].append(meter.per_row(n_rows))
        checksums.update(total_count(store, ns + suffix) for suffix in ("d", "g", "s", "m"))
        for suffix in ("d", "g", "s", "m"):
            store.drop_namespace(ns + suffix)
    store.close()
    assert len(checksums) == 1, f"the four ways stored different totals: {checksums}"
    med = {name: statistics.median(values) for name, values in figures.items()}

    def runs(name: str) -> str:
        spent = {p: statistics.median(run[p] for run in cpu[name]) for p in pids}
        us = ", ".join(f"{p} {spent[p]:.2f}" for p in ("redis", "service", "client"))
        return ", ".join(f"{x:,.0f}" for x in figures[name]) + f"; CPU us/row: {us}"

    for line in push_lines(med, k, runs):
        print(line)
    print(f"checksum (sum of counts stored, the same for all four): {checksums.pop()}")


# ----------------------------------------------------------------------------- memory


def bench_memory(service: subprocess.Popen[str], port: int, text: np.ndarray, n: int = 1000) -> None:
    print("\n## Memory of the service process per session")
    base = rss_kib(service.pid)
    idle = asyncio.run(hold_sessions(port, n, 0, text, service.pid))
    time.sleep(0.5)
    base2 = rss_kib(service.pid)
    full = asyncio.run(hold_sessions(port, n, 1000, text, service.pid))
    print(f"RSS before: {base / 1024:.1f} MiB; with {n} idle sessions: {idle / 1024:.1f} MiB "
          f"({(idle - base) / n:.1f} KiB a session)")
    print(f"with {n} sessions of 1k tokens: {full / 1024:.1f} MiB ({(full - base2) / n:.1f} KiB a session)")


# ----------------------------------------------------------------------------- workers


def bench_workers(args: argparse.Namespace, serve: list[str], tmp: Path, echo: tuple[int, int],
                  text: np.ndarray) -> None:
    """Session steps (64 sessions over 8 connections) against `serve --workers 1` and `--workers 2`, both over
    the redis-server of the main service (its "bench" namespace, the same dynamic counts), and against the
    echo server under the same client code (the ceiling of the load generator)."""
    c, channels = 64, 8
    steps = max(50, 4 * args.steps // c)
    print(f"\n## Workers: {c} sessions over {channels} connections, {steps} steps each, 1 new token a step, a draft "
          f"of 8, against `serve --workers N` (one redis-server)")
    print(f"{'server':>10} {'p50 us':>9} {'p99 us':>9} {'steps/s':>10}   runs (steps/s); CPUs busy: server(s), client")
    res: dict[str, tuple[float, float, float]] = {}
    for name in ("echo", "workers 1", "workers 2"):
        if name == "echo":
            proc, (port, echo_pid) = None, echo
            pids = [echo_pid]
        else:
            workers = int(name.split()[1])
            proc, port, pids = start_workers(serve, workers, tmp / f"workers{workers}")
        try:
            time.sleep(args.settle if proc else 0)  # a mirror refresh in every worker
            asyncio.run(session_steps(port, c, 20, name == "echo", text, channels))  # warm-up
            p50s, p99s, rates, cpus = [], [], [], []
            for _ in range(args.reps):
                meter = CpuMeter({**{f"w{i}": pid for i, pid in enumerate(pids)}, "client": os.getpid()})
                lat, wall = asyncio.run(session_steps(port, c, steps, name == "echo", text, channels))
                cpus.append(meter.per_row(int(wall * 1e6)))  # CPU seconds per second of the run
                p50s.append(np.percentile(lat, 50) * 1e6)
                p99s.append(np.percentile(lat, 99) * 1e6)
                rates.append(len(lat) / wall)
            res[name] = (statistics.median(p50s), statistics.median(p99s), statistics.median(rates))
            mid = cpus[sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]]
            where = " + ".join(f"{mid[f'w{i}']:.2f}" for i in range(len(pids))) + f", {mid['client']:.2f}"
            print(f"{name:>10} {res[name][0]:>9.0f} {res[name][1]:>9.0f} {res[name][2]:>10.0f}   "
                  f"{', '.join(f'{r:,.0f}' for r in rates)}; {where}")
        finally:
            if proc is not None:
                stop_process(proc)
    one, two = res["workers 1"], res["workers 2"]
    print(f"{'2 / 1':>10} {two[0] / one[0]:>8.2f}x {two[1] / one[1]:>8.2f}x {two[2] / one[2]:>9.2f}x   "
          f"(target: steps/s >= 1.6x with 2 workers; the load generator, one Python process, shares the "
          f"{os.cpu_count()} CPUs with the workers and redis)")


# ----------------------------------------------------------------------------- PSS of a shared generation


def zipf_streams(tokens: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Synthetic Zipf-like token streams (fixed seed), 100k tokens each."""
    rng = np.random.default_rng(seed)
    toks = ((rng.zipf(1.2, size=tokens) - 1) % vocab).astype(np.int32)
    return [toks[i:i + 100_000] for i in range(0, tokens, 100_000)]


def bench_pss(args: argparse.Namespace, serve: list[str], tmp: Path) -> None:
    """Two workers mapping one ~90 MB generation: Rss and Pss of the mapping in each worker."""
    import hashlib

    from ngramcache import build_static_from_tokens
    from ngramcache.client._proto.v1 import static_files_pb2, static_files_pb2_grpc

    vocab, ns = 151_936, "pss"
    path = tmp / "pss.ngc"
    t0 = time.perf_counter()
    streams = zipf_streams(args.pss_tokens, vocab, seed=8)
    build_static_from_tokens(streams, path, vocab_size=vocab, fingerprint=FP, generation=1)
    data = path.read_bytes()
    print(f"\n## PSS: 2 workers mapping one generation of {len(data):,} bytes ({len(data) / 2**20:.1f} MiB; "
          f"{args.pss_tokens:,} Zipf(1.2) tokens, vocab {vocab:,}, seed 8, built in {time.perf_counter() - t0:.1f} s)")
    proc, port, pids = start_workers(serve, 2, tmp / "pss-data")
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=ns, tokenizer_fingerprint=FP, vocab_size=vocab))

        def upload():
            yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace=ns, generation=1, size=len(data), sha256=hashlib.sha256(data).digest()))
            for i in range(0, len(data), 1 << 20):
                yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=i, data=data[i:i + (1 << 20)]))

        reply = static_files_pb2_grpc.StaticFilesStub(ch).Publish(upload())
        ch.close()
        print(f"published generation {reply.generation.generation} through StaticFiles.Publish to workers "
              f"{', '.join(map(str, pids))}")
        rng = np.random.default_rng(9)
        allt = np.concatenate(streams)
        # Contexts: half taken from the streams (hits: the drafts follow chains), half random pairs (misses:
        # uniformly spread lookups of the index).
        def contexts(n: int) -> list[np.ndarray]:
            out: list[np.ndarray] = []
            for k in range(n):
                if k % 2:
                    out.append(rng.integers(0, vocab, size=4, dtype=np.int32))
                else:
                    s = int(rng.integers(0, len(allt) - 4))
                    out.append(allt[s:s + 4])
            return out

        total = 0
        while total < 640 and not all(ngc_mapping(pid)[3] for pid in pids):
            # A namespace is opened (its generation mapped) on first use in each worker: 64 drafts over 16
            # new connections a round, until both workers have it.
            asyncio.run(draft_many(port, contexts(64), 16, ns, vocab))
            total += 64
        print(f"{'drafts':>8} {'worker':>8} {'mapped KiB':>11} {'Rss KiB':>9} {'Pss KiB':>9}")
        for n in [0, *args.pss_drafts]:
            if n:
                asyncio.run(draft_many(port, contexts(n), 16, ns, vocab))
                total += n
            rss_sum = pss_sum = 0
            for pid in pids:
                size, rss, pss, paths = ngc_mapping(pid)
                rss_sum += rss
                pss_sum += pss
                print(f"{total:>8} {pid:>8} {size:>11,} {rss:>9,} {pss:>9,}   {', '.join(paths) or '(not mapped)'}")
            print(f"{total:>8} {'sum':>8} {'':>11} {rss_sum:>9,} {pss_sum:>9,}   Pss sum / file = "
                  f"{pss_sum * 1024 / len(data):.3f}x, Rss sum / file = {rss_sum * 1024 / len(data):.3f}x "
                  f"(target: Pss sum <= 1.2x)")
    finally:
        stop_process(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    ap.add_argument("--steps", type=int, default=3000, help="session steps per run, over all sessions (default 3000)")
    ap.add_argument("--batch", type=int, default=10_000, help="rows per pushed batch (default 10000)")
    ap.add_argument("--files", type=int, default=120, help="standard-library files whose deltas are pushed")
    ap.add_argument("--clients", type=int, default=8, help="concurrent client ids of the aggregated Push figure")
    ap.add_argument("--pss-tokens", type=int, default=15_000_000,
                    help="Zipf tokens of the static file of the PSS figure (default 15M: about 90 MB)")
    ap.add_argument("--pss-drafts", type=lambda v: [int(x) for x in v.split(",")], default=[2000, 20000],
                    help="more Draft requests after each of which the PSS figure is read again (default 2000,20000)")
    ap.add_argument("--only", choices=("sessions", "push", "memory", "workers", "pss"),
                    help="run one part of the benchmark")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in seconds: 1 run, few steps, files and sessions, a small PSS file "
                    "(figures meaningless)")
    args = ap.parse_args()
    args.settle = 2.5  # seconds for a mirror refresh (every 1 s) in every process
    if args.quick:
        args.reps, args.steps, args.files, args.pss_tokens, args.pss_drafts = 1, 100, 12, 300_000, [64]
        args.settle = 0.5

    from helpers.redis_servers import RedisServer

    streams = stdlib_streams(args.files)
    text = np.concatenate(streams)
    tmp = Path(tempfile.mkdtemp(prefix="ngc-bench-service-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        with RedisServer() as redis_server:
            serve = [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())",
                     "serve", "--port", "0", "--data-dir", str(tmp / "data"), "--counts", redis_server.url,
                     "--max-push-rows", str(max(args.batch, 65536))]
            service, sport = start_process(serve)
            procs.append(service)
            echo, eport = start_process([sys.executable, "-c", ECHO_SERVER, "x", "40"])
            procs.append(echo)
            ch = grpc.insecure_channel(f"127.0.0.1:{sport}")
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="bench", tokenizer_fingerprint=FP, vocab_size=VOCAB))
            for i, rows in enumerate(delta_batches(streams[:40], 50_000)):  # dynamic counts: drafts are real
                counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
                    namespace="bench", tokenizer_fingerprint=FP, client_id="seed", seq=i,
                    rows=delta_rows_to_bytes(rows)))
            time.sleep(args.settle)  # a mirror refresh
            if args.quick:
                print("--quick: figures meaningless (one run of a few steps: checks the script)")
            print(f"service pid {service.pid} on port {sport}, echo pid {echo.pid} on port {eport}; "
                  f"{os.cpu_count()} CPUs shared by clients and servers")
            if args.only in (None, "sessions"):
                bench_sessions(args, sport, eport, text)
            if args.only in (None, "push"):
                assert redis_server.pid is not None
                bench_push(args, sport, redis_server.url, streams, {"redis": redis_server.pid, "service": service.pid})
            if args.only in (None, "memory"):
                bench_memory(service, sport, text, 50 if args.quick else 1000)
            serve_n = [*serve[:4], "--port", "0", "--counts", redis_server.url,
                       "--max-push-rows", str(max(args.batch, 65536))]
            if args.only in (None, "workers"):
                bench_workers(args, serve_n, tmp, (eport, echo.pid), text)
            if args.only in (None, "pss"):
                bench_pss(args, serve_n, tmp)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
