"""Benchmark of the synced client: drafting cost with background sync running vs a
bare local Drafter on the same tables, and the delay from one client's accept to the change
showing in another client's drafts.

A real `ngramcache serve` process (embedded counts store, loopback) holds a static generation
built from CPython's standard library (byte tokens); the held-out files are drafted.

1. Drafting cost: each held-out file is drafted at every 7th position of its second half
   (accept + draft of 8, as a worker does per step) through `NgramClient.drafter()` while its
   background thread pulls the mirror and pushes deltas, and through a bare `Drafter` over
   the same static file and a snapshot of B's mirror taken before each run. Microseconds per call;
   ratio client / bare (target <= 1.2x). Medians of --reps runs.
2. Push to visible: client A accepts a fresh pattern (a new 4-gram followed by one token,
   three times); client B drafts after the 4-gram until it drafts that token. Delay p50 and
   p99 over --trials trials, with the client's default pull interval.

    python tests/bench/bench_client.py
    python tests/bench/bench_client.py --quick      # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ngramcache import UNTAGGED, CountTable, Drafter, NgramClient, StaticCache, build_static_from_tokens
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, static_files_pb2, static_files_pb2_grpc

VOCAB = 256


def stdlib_streams(max_files: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 4000)
    streams = [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int32) for p in files[:max_files]]
    return [s for i, s in enumerate(streams) if i % 20], [s for i, s in enumerate(streams) if i % 20 == 0][:15]


def start_service(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())",
                          "serve", "--port", "0", "--data-dir", str(data_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", p.stdout.readline())
    if not m:
        raise SystemExit("the service did not start")
    return p, int(m.group(1))


def publish(port: int, path: Path) -> None:
    data = path.read_bytes()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    admin_pb2_grpc.AdminStub(ch).CreateNamespace(
        admin_pb2.CreateNamespaceRequest(name="bench", tokenizer_fingerprint=UNTAGGED, vocab_size=VOCAB))

    def chunks():  # type: ignore[no-untyped-def]
        yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
            namespace="bench", generation=1, size=len(data), sha256=hashlib.sha256(data).digest()))
        for i in range(0, len(data), 1 << 20):
            yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=i, data=data[i:i + (1 << 20)]))

    static_files_pb2_grpc.StaticFilesStub(ch).Publish(chunks(), timeout=60)
    ch.close()


def drive(drafter: Drafter, held: list[np.ndarray], seq_base: int) -> tuple[float, str]:
    """us per (accept + draft) call over the held-out files; a checksum of the drafts."""
    h = hashlib.blake2b(digest_size=8)
    calls = 0
    t0 = time.perf_counter()
    for k, s in enumerate(held):
        seq = seq_base + k
        for pos in range(len(s) // 2, len(s), 7):
            drafter.accept(seq, s[:pos])
            h.update(drafter.draft(seq, s[:pos], 8).tobytes())
            calls += 1
        drafter.reset(seq)
    return (time.perf_counter() - t0) / calls * 1e6, h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="runs of the drafting loop; medians reported (default 5)")
    ap.add_argument("--trials", type=int, default=30, help="push-to-visible trials (default 30)")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in seconds: 120 files, 1 run, 3 trials (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.trials = 1, 3

    corpus, held = stdlib_streams(120 if args.quick else None)
    tmp = Path(tempfile.mkdtemp(prefix="ngc-bench-client-"))
    static = tmp / "stdlib.ngc"
    build_static_from_tokens(corpus, static, vocab_size=VOCAB, fingerprint=UNTAGGED, generation=1)
    service, port = start_service(tmp / "data")
    try:
        publish(port, static)
        addr = f"127.0.0.1:{port}"
        with NgramClient(addr, "bench", (UNTAGGED, VOCAB), cache_dir=str(tmp / "cache-a")) as a, \
                NgramClient(addr, "bench", (UNTAGGED, VOCAB), cache_dir=str(tmp / "cache-b")) as b:
            # Give the fleet some dynamic counts, pushed by A and mirrored by both.
            for k, s in enumerate(corpus[:30]):
                a.drafter().accept(10_000 + k, s)
            time.sleep(2.0)
            print(f"service on {addr}; static generation {static.stat().st_size / 1e6:.2f} MB; "
                  f"client stats: {{'generation': {b.stats().get('generation')}, "
                  f"'mirror_rows': {b.stats().get('mirror_rows')}}}")

            # 1. drafting cost, B's synced drafter vs a bare one on the same tables
            synced = b.drafter()
            bare = Drafter(static=StaticCache.open(static), dynamic=CountTable())
            drive(bare, held[:2], 0)  # warm-up
            drive(synced, held[:2], 0)
            t_bare, t_sync, sums = [], [], set()
            for rep in range(args.reps):
                snapshot = CountTable()  # the bare drafter gets B's mirror as it is now
                assert synced.dynamic is not None
                snapshot.merge(synced.dynamic)
                bare.set_dynamic(snapshot)
                tb, cb = drive(bare, held, 100 * rep)
                ts, cs = drive(synced, held, 100 * rep + 50)
                t_bare.append(tb)
                t_sync.append(ts)
                sums |= {cb, cs}
            mb, ms = statistics.median(t_bare), statistics.median(t_sync)
            print("\n## Drafting cost per call (accept + draft of 8), CPython held-out files, byte tokens")
            print(f"bare Drafter (same static file, same counts):  {mb:.2f} us  (runs: {', '.join(f'{x:.2f}' for x in t_bare)})")
            print(f"NgramClient drafter, background sync running: {ms:.2f} us  (runs: {', '.join(f'{x:.2f}' for x in t_sync)})")
            print(f"ratio: {ms / mb:.2f}x (target <= 1.2x); drafts identical: {len(sums) == 1} (they differ as B's "
                  "mirror takes in B's own pushes during the run, as a fleet member's does)")

            # 2. push to visible, on a namespace of its own: part 1's bursts (A's 30 files at once,
            # B's replay at ~100x a worker's rate) spend the draft view's rate budget, and a view
            # over it shares only keys counted more often than this probe's 3 times.
            ch = grpc.insecure_channel(addr)
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="visible", tokenizer_fingerprint=UNTAGGED, vocab_size=VOCAB))
            ch.close()
        with NgramClient(addr, "visible", (UNTAGGED, VOCAB), cache_dir=str(tmp / "cache-a")) as a, \
                NgramClient(addr, "visible", (UNTAGGED, VOCAB), cache_dir=str(tmp / "cache-b")) as b:
            rng = np.random.default_rng(7)
            delays = []
            for trial in range(args.trials):
                gram = rng.integers(0, VOCAB, 4).astype(np.int32)
                follower = np.int32(rng.integers(0, VOCAB))
                pattern = np.concatenate([np.concatenate([gram, [follower]]) for _ in range(3)]).astype(np.int32)
                probe = np.concatenate([rng.integers(0, VOCAB, 4), gram]).astype(np.int32)
                t0 = time.perf_counter()
                a.drafter().accept(20_000 + trial, pattern)
                while True:
                    d = b.drafter().draft(30_000 + trial, probe, 1)
                    if len(d) and d[0] == follower:
                        break
                    if time.perf_counter() - t0 > 30:
                        raise SystemExit("a pushed pattern never became visible")
                    time.sleep(0.002)
                delays.append(time.perf_counter() - t0)
                b.drafter().reset(30_000 + trial)
            print(f"\n## Push to visible in another client's drafts ({args.trials} trials; push every "
                  f"0.1 s, service mirror and draft view every 0.25 s, pull every 0.5 s, by default)")
            print(f"p50 {np.percentile(delays, 50) * 1e3:.0f} ms, p99 {np.percentile(delays, 99) * 1e3:.0f} ms, "
                  f"max {max(delays) * 1e3:.0f} ms")
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
