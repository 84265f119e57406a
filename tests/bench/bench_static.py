"""Benchmark of the static cache tooling and the drafting core on a real corpus.

Corpus: Debian's linux-source-6.1 C sources tokenized with Qwen's tokenizer, nested sets of
about 25, 100 and 300 MB, and a disjoint 2 MB test set (tests/bench/prepare_corpus.py makes
and caches them). For "no static cache" and each corpus, every figure is the median of
--reps runs: build seconds and peak RSS (default budget and 256 MiB), file size against the
same counts in llama.cpp's format, open time, and llama-lookup-stats' replay of the test
set (us per drafted token, accept %, peak RSS). Baselines measured in the same run: the
llama.cpp format's size, and loading that file into a heap table, the kind of table llama.cpp
builds from -lcs (seconds and RSS per process). That load is ngramcache's own loader
(`load_llama_counts` into a `CountTable`), not llama.cpp's: llama.cpp's loader is not timed
here (llama-server's time to ready with a -lcs file: tests/bench/bench_llama_server.py).
Sharing: 4 processes replay against the largest file at once; the sum of their proportional
set sizes (PSS) of the mapping is set against the file size.

    python tests/bench/bench_static.py            # prints one table (markdown) and writes JSON
    python tests/bench/bench_static.py --quick    # checks the script on prepare_corpus.py --quick's data (seconds)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = ["25mb", "100mb", "300mb"]


def cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ngramcache {' '.join(args)} failed:\n{r.stderr}")
    return json.loads(r.stdout)


def median(xs):
    return statistics.median(xs)


def open_ms(path: Path, n: int = 200) -> float:
    from ngramcache.client import StaticCache

    StaticCache.open(str(path))  # warm the page cache for the header
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        StaticCache.open(str(path))
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return median(times)


def heap_load(path: Path, vocab: int) -> dict:
    """The heap-table baseline: ngramcache's loader parses a llama.cpp cache file into a CountTable (a heap table
    like the one llama.cpp builds from -lcs, but not llama.cpp's code), in a fresh process."""
    code = (
        "import json,resource,sys,time\n"
        "from ngramcache.client import CountTable\nfrom ngramcache import load_llama_counts\n"
        "t=CountTable();t0=time.perf_counter();load_llama_counts(sys.argv[1],int(sys.argv[2]),t)\n"
        "print(json.dumps({'seconds':time.perf_counter()-t0,'peak_rss_mb':resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024,"
        "'table_mb':t.memory_bytes()/1e6}))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path), str(vocab)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


WORKER = """
import sys, numpy as np
from ngramcache import CountTable, StaticCache
from ngramcache import replay
c = StaticCache.open(sys.argv[1])
c.verify()  # reads every page of the file
tokens = np.load(sys.argv[2])
replay(tokens, 4096, 8, 1, 4, c, CountTable())
print("ready", flush=True)
sys.stdin.read()
"""


def mapping_kb(pid: int, path: Path) -> tuple[int, int]:
    """(Rss, Pss) in KiB of process `pid`'s mappings of `path`."""
    rss = pss = 0
    inside = False
    target = str(path.resolve())
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(target)
            elif inside and head[0] == "Rss:":
                rss += int(head[1])
            elif inside and head[0] == "Pss:":
                pss += int(head[1])
    return rss, pss


def sharing(path: Path, test: Path, n: int = 4) -> dict:
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(test)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a sharing worker failed")
        figures = [mapping_kb(p.pid, path) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    return {
        "processes": n,
        "rss_sum_mb": sum(r for r, _ in figures) / 1024,
        "pss_sum_mb": sum(p for _, p in figures) / 1024,
        "file_mb": path.stat().st_size / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="prepared corpora (default .bench-data; .bench-data/quick with --quick)")
    parser.add_argument("--work-dir", default=None, help="where built files go (default DATA/bench)")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    parser.add_argument("--sizes", default=",".join(SIZES), help="corpora to run (default 25mb,100mb,300mb)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true",
                        help="checks the script in seconds: prepare_corpus.py --quick's data, 1 run, the 25mb set only "
                        "(figures meaningless)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.sizes = 1, "25mb"

    data = Path(args.data_dir or ROOT / ".bench-data" / ("quick" if args.quick else ""))
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tests/bench/prepare_corpus.py"), "--data-dir", str(data),
                        *(["--quick"] if args.quick else [])], check=True)
    manifest = json.loads((data / "manifest.json").read_text())
    if manifest.get("quick"):
        print(f"{data} holds prepare_corpus.py --quick's data (Python's C headers, KBs): figures meaningless",
              file=sys.stderr)
    vocab = manifest["tokenizer"]["vocab_size"]
    fp = manifest["tokenizer"]["fingerprint"]
    work = Path(args.work_dir or data / "bench")
    work.mkdir(parents=True, exist_ok=True)
    test = data / manifest["test"]["tokens_npy"] if "tokens_npy" in manifest["test"] else data / "tokens/test.npy"
    ident = ["--vocab-size", str(vocab), "--fingerprint", fp]
    rows = []

    def stats_row(static: Path | None) -> dict:
        runs = [cli("stats", "--input", str(test), *(["--static", str(static)] if static else []), "--json")
                for _ in range(args.reps)]
        return {k: median([r[k] for r in runs]) for k in
                ("us_per_drafted", "us_per_drafted_draft_only", "accept_pct", "peak_rss_mb", "t_load_ms", "n_drafted", "n_accept")}

    print(f"test set: {manifest['test'].get('tokens', '?'):,} tokens; tokenizer {manifest['tokenizer']['spec']}", file=sys.stderr)
    rows.append({"corpus": "none", **stats_row(None)})
    checksum = None
    for size in args.sizes.split(","):
        info = manifest["corpora"][size]
        src = data / info["tokens_npy"]
        out = work / f"{size}.ngc"
        print(f"[{size}] building {args.reps}x at the default budget and {args.reps}x at 256 MiB...", file=sys.stderr)
        full = [cli("build", str(src), "-o", str(out), *ident, "--json", "--quiet") for _ in range(args.reps)]
        small = [cli("build", str(src), "-o", str(work / f"{size}.256.ngc"), *ident, "--memory-budget", "256MiB",
                     "--json", "--quiet") for _ in range(args.reps)]
        same = (work / f"{size}.256.ngc").read_bytes() == out.read_bytes()
        (work / f"{size}.256.ngc").unlink()
        cli_export = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", "export-llama", str(out), "-o",
                                     str(work / f"{size}.lcs"), "--quiet"], check=True)
        del cli_export
        llama_bytes = (work / f"{size}.lcs").stat().st_size
        heap = [heap_load(work / f"{size}.lcs", vocab) for _ in range(args.reps)]
        (work / f"{size}.lcs").unlink()
        print(f"[{size}] replaying the test set...", file=sys.stderr)
        row = {
            "corpus": size,
            "tokens": info["tokens"],
            "tokenize_s": info.get("tokenize_seconds"),
            "build_s": median([r["seconds"] for r in full]),
            "build_rss_mb": median([r["peak_rss_mb"] for r in full]),
            "build256_s": median([r["seconds"] for r in small]),
            "build256_rss_mb": median([r["peak_rss_mb"] for r in small]),
            "runs_spilled_256": small[0]["runs_spilled"],
            "same_file_256": same,
            "file_mb": out.stat().st_size / 1e6,
            "llama_mb": llama_bytes / 1e6,
            "file_vs_llama": out.stat().st_size / llama_bytes,
            "open_ms": open_ms(out),
            "heap_load_s": median([h["seconds"] for h in heap]),
            "heap_rss_mb": median([h["peak_rss_mb"] for h in heap]),
            **stats_row(out),
        }
        row["build_s_per_100M"] = row["build_s"] * 1e8 / row["tokens"]
        rows.append(row)
        checksum = hashlib.sha256(out.read_bytes()).hexdigest()[:16]
    largest = work / f"{args.sizes.split(',')[-1]}.ngc"
    print("sharing: 4 processes on the largest file...", file=sys.stderr)
    share = [sharing(largest, test) for _ in range(args.reps)]
    share_row = {k: median([s[k] for s in share]) for k in share[0]}

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print("\n| corpus | tokens | build s (per 100M) | build RSS MB | build s / RSS MB @256MiB | file MB | llama.cpp MB | ratio "
          "| open ms | heap load s / RSS MB (ngramcache's loader of the llama.cpp file) | us/drafted | draft-only | accept % | stats RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["corpus"] == "none":
            print(f"| none | - | - | - | - | - | - | - | - | - | {fmt(r['us_per_drafted'], '.3f')} | "
                  f"{fmt(r['us_per_drafted_draft_only'], '.3f')} | {r['accept_pct']:.1f} | {r['peak_rss_mb']:.0f} |")
            continue
        print(f"| {r['corpus']} | {r['tokens'] / 1e6:.1f}M | {r['build_s']:.2f} ({r['build_s_per_100M']:.2f}) | "
              f"{r['build_rss_mb']:.0f} | {r['build256_s']:.2f} / {r['build256_rss_mb']:.0f} | {r['file_mb']:.1f} | "
              f"{r['llama_mb']:.1f} | {r['file_vs_llama']:.2f} | {r['open_ms']:.4f} | "
              f"{r['heap_load_s']:.2f} / {r['heap_rss_mb']:.0f} | {r['us_per_drafted']:.3f} | "
              f"{r['us_per_drafted_draft_only']:.3f} | {r['accept_pct']:.1f} | {r['peak_rss_mb']:.0f} |")
    print(f"\nsharing ({share_row['processes']:.0f} processes, {largest.name}): sum of PSS {share_row['pss_sum_mb']:.1f} MiB "
          f"for a {share_row['file_mb']:.1f} MiB file ({share_row['pss_sum_mb'] / share_row['file_mb']:.2f}x); "
          f"sum of RSS {share_row['rss_sum_mb']:.1f} MiB")
    print(f"tokenization (reported apart from builds): {manifest['tokenization']['tokens_per_second']:,} tokens/s")
    print(f"256 MiB builds identical to default builds: {all(r.get('same_file_256', True) for r in rows)}; "
          f"result checksum (sha256 of the largest file): {checksum}; medians of {args.reps} runs")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "sharing": share_row}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
