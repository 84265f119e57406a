"""Benchmark of the drafter's concurrency: parallel drafting and drafting under mirror writes.

Data: CPython's standard library (the running interpreter's), byte tokens or, with
--tokenizer, a real tokenizer's; 90% of the files build a static cache, the held-out 10%
are the sequences drafted. A Drafter holds one context table per held-out file (its first
half accepted) over the static cache and a dynamic table.

1. Throughput of the core: tests/bench/lib/drafter_threads.cc drafts from 1 and 2 native threads
   on disjoint sequences of one ngc::Drafter (the same data and positions), no Python; and
   the baseline in the same run: the same drafts with thread-private tables and no locks
   (what this machine's two cores allow).
2. Throughput: drafts per second (n_draft 8, at --positions points of the second half of
   each sequence) from 1 thread and from 2 threads on disjoint sequences of ONE Drafter,
   through the Python API: one draft() per call (the interpreter's share of each call holds
   the GIL), and draft_batch() of --batch drafts per call (the GIL is released for the
   batch, as an engine drafting for its whole batch each step would). Ratio 2 threads / 1.
3. Latency under writes: one thread drafts in a loop, timing each call, while another
   applies a change set of --rows absolute-count rows to the dynamic table
   (CountTable.assign_rows, as a mirror applies changes_since). p50 / p99 / p99.9 / max of
   the drafts that ran during the apply, against the same loop with no writer (baseline).

Each figure is the median of --reps runs; a checksum of the drafted tokens shows the runs
drafted the same things.

    python tests/bench/bench_concurrency.py                  # byte tokens
    python tests/bench/bench_concurrency.py --tokenizer tiktoken:qwen
    python tests/bench/bench_concurrency.py --quick          # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ngramcache import UNTAGGED, CountTable, Drafter, StaticCache, build_static_from_tokens, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def stdlib_streams(tokenizer_spec: str | None) -> tuple[list[np.ndarray], list[np.ndarray], int, bytes]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 4000)
    if tokenizer_spec:
        tok = load_tokenizer(tokenizer_spec)
        streams = tok.encode_batch([p.read_text(errors="replace") for p in files])
        vocab, fp = tok.vocab_size, tok.fingerprint
    else:
        streams = [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int32) for p in files]
        vocab, fp = 256, UNTAGGED
    held = [s for i, s in enumerate(streams) if i % 10 == 0]
    corpus = [s for i, s in enumerate(streams) if i % 10]
    return corpus, held, vocab, fp


def make_drafter(static: StaticCache, dynamic: CountTable, held: list[np.ndarray]) -> Drafter:
    d = Drafter(static=static, dynamic=dynamic)
    for i, s in enumerate(held):
        d.accept(i, s[: len(s) // 2])
    return d


def positions_of(s: np.ndarray, positions: int) -> list[int]:
    """`positions` evenly spaced points of the second half of a sequence."""
    return np.linspace(len(s) // 2, len(s) - 1, positions, dtype=np.int64).tolist()


def draft_loop(d: Drafter, ids: list[int], held: list[np.ndarray], positions: int, batch: int,
               digests: dict[int, str]) -> int:
    """Drafts at every position of each sequence: one call per draft (batch 1) or `batch`
    positions per draft_batch call. Records a digest of each sequence's drafts."""
    calls = 0
    for i in ids:
        s = held[i]
        h = hashlib.blake2b(digest_size=8)
        pos = positions_of(s, positions)
        if batch == 1:
            for p in pos:
                h.update(d.draft(i, s[:p], 8).tobytes())
        else:
            for b in range(0, len(pos), batch):
                chunk = pos[b:b + batch]
                drafts, lengths = d.draft_batch([i] * len(chunk), [s[:p] for p in chunk], 8)
                for row, n in zip(drafts, lengths.tolist()):
                    h.update(row[:n].tobytes())
        calls += len(pos)
        digests[i] = h.hexdigest()
    return calls


def throughput(d: Drafter, held: list[np.ndarray], n_threads: int, positions: int, batch: int) -> tuple[float, str]:
    ids = list(range(len(held)))
    parts = [ids[k::n_threads] for k in range(n_threads)]
    digests: dict[int, str] = {}
    counts = [0] * n_threads

    def run(k: int) -> None:
        counts[k] = draft_loop(d, parts[k], held, positions, batch, digests)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    checksum = hashlib.blake2b("".join(digests[i] for i in ids).encode(), digest_size=8).hexdigest()
    return sum(counts) / elapsed, checksum


def wheel_core() -> Path | None:
    """The core library the installed extension was linked from (scikit-build's build folder, Release), if there."""
    found = sorted((ROOT / "build").glob("cp*/src/libngc.a"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def build_native_bench(quick: bool = False) -> Path:
    """Compiles the core (Release, as the wheel) and tests/bench/lib/drafter_threads.cc.

    With `quick`, links the wheel's own build of the core when there is one (compiling the core
    again takes about a minute on 2 cores)."""
    build = ROOT / "build" / "bench"
    core = wheel_core() if quick and not (build / "src" / "libngc.a").exists() else None
    if core is not None:
        print(f"--quick: drafter_threads linked with the wheel's build of the core ({core})", file=sys.stderr)
        build.mkdir(parents=True, exist_ok=True)
        exe = build / "drafter_threads.quick"
        subprocess.run(["g++", "-O2", "-std=c++20", f"-I{ROOT / 'native' / 'include'}",
                        str(ROOT / "tests/bench/lib/drafter_threads.cc"), str(core), "-lpthread", "-o", str(exe)], check=True)
        return exe
    bindir = Path(sys.executable).parent
    cmake = shutil.which("cmake", path=str(bindir)) or "cmake"
    ninja = shutil.which("ninja", path=str(bindir))
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    subprocess.run([cmake, "-S", str(ROOT / "native"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *gen],
                   check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(build), "--target", "ngc"], check=True, capture_output=True)
    exe = build / "drafter_threads"
    subprocess.run(["g++", "-O2", "-std=c++20", f"-I{ROOT / 'native' / 'include'}", str(ROOT / "tests/bench/lib/drafter_threads.cc"),
                    str(build / "src" / "libngc.a"), "-lpthread", "-o", str(exe)], check=True)
    return exe


def native_throughput(exe: Path, static_path: str, held: list[np.ndarray], tmp: str, threads: int, positions: int,
                      reps: int, private: bool = False) -> tuple[float, str]:
    toks, offs = os.path.join(tmp, "held.i32"), os.path.join(tmp, "held.i64")
    if not os.path.exists(toks):
        np.concatenate(held).astype(np.int32).tofile(toks)
        np.concatenate([[0], np.cumsum([len(s) for s in held])]).astype(np.int64).tofile(offs)
    r = subprocess.run([str(exe), static_path, toks, offs, str(threads), str(positions), str(reps),
                        *(["private"] if private else [])], check=True, capture_output=True, text=True)
    fields = dict(kv.split("=") for kv in r.stdout.split())
    return float(fields["drafts_per_s"]), fields["checksum"]


def change_set(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.full((rows, 7), -1, dtype=np.int64)
    n = rng.integers(1, 5, rows)
    out[:, 0] = n
    toks = rng.integers(0, vocab, (rows, 4))
    for k in range(4):
        out[:, 1 + k] = np.where(n > k, toks[:, k], -1)
    out[:, 5] = rng.integers(0, vocab, rows)
    out[:, 6] = rng.integers(1, 1000, rows)
    return out


def latency_under_writes(static: StaticCache, held: list[np.ndarray], vocab: int, rows: int, seed: int,
                         with_writer: bool) -> tuple[np.ndarray, float]:
    dynamic = CountTable()
    dynamic.assign_rows(change_set(rows, vocab, seed + 1000))  # a mirror that already holds data
    d = make_drafter(static, dynamic, held)
    cs = change_set(rows, vocab, seed)
    samples: list[int] = []
    stop = threading.Event()
    started = threading.Event()
    apply_time = [0.0]

    def drafter() -> None:
        i = 0
        order = [(k, p) for k, s in enumerate(held) for p in range(len(s) // 2, len(s), 97)]
        started.set()
        while not stop.is_set():
            k, pos = order[i % len(order)]
            toks = held[k][:pos]
            t0 = time.perf_counter_ns()
            d.draft(k, toks, 8)
            samples.append(time.perf_counter_ns() - t0)
            i += 1

    t = threading.Thread(target=drafter)
    t.start()
    started.wait()
    time.sleep(0.05)
    n_before = len(samples)
    t0 = time.perf_counter()
    if with_writer:
        dynamic.assign_rows(cs)
    else:
        time.sleep(0.05)
    apply_time[0] = time.perf_counter() - t0
    n_after = len(samples)
    stop.set()
    t.join()
    window = np.asarray(samples[n_before:n_after], dtype=np.float64) / 1e3  # us
    return window, apply_time[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="tokenizer spec (e.g. tiktoken:qwen); default: byte tokens")
    ap.add_argument("--reps", type=int, default=5, help="runs per figure; the median is reported (default 5)")
    ap.add_argument("--positions", type=int, default=400, help="draft calls per sequence in the throughput test")
    ap.add_argument("--batch", type=int, default=64, help="drafts per draft_batch() call (default 64)")
    ap.add_argument("--rows", type=int, default=100_000, help="rows of the change set applied during drafting")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in seconds: 1 run, 50 positions, 20,000 rows (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.positions, args.rows = 1, 50, 20_000

    corpus, held, vocab, fp = stdlib_streams(args.tokenizer)
    n_tok = sum(len(s) for s in corpus)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.ngc")
        build_static_from_tokens(corpus, path, vocab_size=vocab, fingerprint=fp)
        static = StaticCache.open(path)
        print(f"static cache: {n_tok:,} tokens, {static.n_keys:,} keys; {len(held)} held-out sequences "
              f"({sum(len(s) for s in held):,} tokens); vocabulary {vocab:,}; {os.cpu_count()} CPUs")

        exe = build_native_bench(args.quick)
        native_throughput(exe, path, held, tmp, 1, 50, 1)  # warm-up
        nsums: set[str] = set()
        ratios: dict[bool, float] = {}
        for private, title in ((False, "one ngc::Drafter shared by the threads"),
                               (True, "baseline: thread-private tables and ngc::draft(), no Drafter, no locks")):
            nat: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(args.reps):
                for n in (1, 2):
                    r, c = native_throughput(exe, path, held, tmp, n, args.positions, 3, private)
                    nat[n].append(r)
                    nsums.add(c)
            n1, n2 = statistics.median(nat[1]), statistics.median(nat[2])
            ratios[private] = n2 / n1
            print(f"\n## Draft throughput, native threads on disjoint sequences (n_draft 8): {title}")
            print(f"1 thread : {n1:,.0f} drafts/s  (runs: {', '.join(f'{x:,.0f}' for x in nat[1])})")
            print(f"2 threads: {n2:,.0f} drafts/s  (runs: {', '.join(f'{x:,.0f}' for x in nat[2])})")
            print(f"ratio 2/1: {n2 / n1:.2f}x" + ("   (target >= 1.7x)" if not private else ""))
        print(f"the Drafter's scaling is {ratios[False] / ratios[True]:.2f} of the lock-free baseline's; "
              f"checksum equal across runs, thread counts and modes: {len(nsums) == 1} ({', '.join(sorted(nsums))})")

        d = make_drafter(static, CountTable(), held)
        throughput(d, held, 1, 50, 1)  # warm-up
        sums: set[str] = set()
        for batch, title in ((1, "one draft() per call"), (args.batch, f"draft_batch() of {args.batch} drafts per call")):
            rates: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(args.reps):
                for n in (1, 2):
                    r, c = throughput(d, held, n, args.positions, batch)
                    rates[n].append(r)
                    sums.add(c)
            r1, r2 = statistics.median(rates[1]), statistics.median(rates[2])
            print(f"\n## Draft throughput, one Drafter, Python threads on disjoint sequences, {title} (n_draft 8)")
            print(f"1 thread : {r1:,.0f} drafts/s  (runs: {', '.join(f'{x:,.0f}' for x in rates[1])})")
            print(f"2 threads: {r2:,.0f} drafts/s  (runs: {', '.join(f'{x:,.0f}' for x in rates[2])})")
            print(f"ratio 2/1: {r2 / r1:.2f}x   (target >= 1.7x)")
        print(f"checksum of every sequence's drafts, equal across runs, thread counts and batching: "
              f"{len(sums) == 1} ({', '.join(sorted(sums))})")

        print(f"\n## Draft latency while a {args.rows:,}-row change set is applied to the dynamic table")
        rows_out = []
        for label, writer in (("no writer (baseline)", False), ("during assign_rows", True)):
            p50, p99, p999, mx, n, t_apply = [], [], [], [], [], []
            for rep in range(args.reps):
                for _ in range(5):  # on a busy machine the drafting thread may not run within a short apply
                    w, ta = latency_under_writes(static, held, vocab, args.rows, rep, writer)
                    if len(w):
                        break
                else:
                    print(f"{label}: no draft finished inside the apply window in 5 tries (the machine is too busy "
                          "to measure it)", file=sys.stderr)
                    return 1
                p50.append(np.percentile(w, 50))
                p99.append(np.percentile(w, 99))
                p999.append(np.percentile(w, 99.9))
                mx.append(w.max())
                n.append(len(w))
                t_apply.append(ta)
            rows_out.append((label, statistics.median(p50), statistics.median(p99), statistics.median(p999),
                             statistics.median(mx), statistics.median(n), statistics.median(t_apply)))
        print(f"{'':<22}{'p50 us':>9}{'p99 us':>9}{'p99.9 us':>10}{'max us':>9}{'drafts':>9}{'window ms':>11}")
        for label, a, b, c, m, n, ta in rows_out:
            print(f"{label:<22}{a:>9.1f}{b:>9.1f}{c:>10.1f}{m:>9.0f}{n:>9.0f}{ta * 1e3:>11.1f}")
        print(f"p99 during the apply: {rows_out[1][2]:.1f} us (target <= 50 us); medians of {args.reps} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
