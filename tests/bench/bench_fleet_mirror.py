"""Fleet-scale mirror benchmark: what one client pulls and holds when 10, 100 or 1,000
clients push, with the service's draft view (the default) vs a full mirror of the store.

Clients are simulated in this one process; the parts that decide the figures are the real
ones: the store's counts are a native `CountTable`, the service's `DraftView`
(cache_service/draft_view.py, the code a replica runs) folds in each second's changes, and
each client's traffic is what a Pull would carry.

Workload: CPython's standard library tokenized with cl100k (tiktoken); 95% of the files are
the fleet's text, 5% held out. Each simulated client reads the fleet text from its own
random offset, `--tokens` tokens a second (1,000 tokens = ~4,000 n-gram deltas of sizes 1-4:
~4k deltas/s per worker), for `--seconds` seconds. Every second:
  - the store applies the second's deltas of all clients (summed);
  - a full-mirror client pulls every (n-gram, follower) row whose count changed: at least
    that many rows (the store's changes_since answers whole buckets, so more);
  - a draft-view client pulls the rows the view logged that second.
Reported per fleet size, steady state (second half of the run): per-client pull rows/s and
bytes/s (56 bytes a row, the wire form), mirror memory at the end, and the acceptance of a
llama-lookup-stats replay of the held-out files with each mirror as the dynamic table (no
static cache, so the dynamic table's part shows alone), and the loss of the view against
the full mirror.

    python tests/bench/bench_fleet_mirror.py                 # 10, 100, 1000 clients
    python tests/bench/bench_fleet_mirror.py --clients 10 100 --seconds 6
    python tests/bench/bench_fleet_mirror.py --quick         # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from ngramcache import CountTable, replay
from ngramcache.cache_service.draft_view import DraftView, ViewPolicy
from ngramcache.client.kernel.tokenizer import load_tokenizer

ROW_BYTES = 56  # an int64 count row on the wire (counts.proto)


def stdlib_tokens(max_files: int) -> tuple[np.ndarray, np.ndarray]:
    """(fleet text, held-out text) of the standard library, cl100k tokens."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts))[:max_files]
    tok = load_tokenizer("tiktoken:cl100k_base")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ids = tok.encode_batch(texts)
    fleet = [t for i, t in enumerate(ids) if i % 20]
    held = [t for i, t in enumerate(ids) if i % 20 == 0]
    return np.concatenate(fleet).astype(np.int32), np.concatenate(held).astype(np.int32)


def copy_of(table: CountTable) -> CountTable:
    out = CountTable()
    out.merge(table)
    return out


def replay_accept(held: np.ndarray, dynamic: CountTable, n_ctx: int) -> dict[str, float]:
    r = replay(held, n_ctx, 8, 1, 4, None, copy_of(dynamic))
    steps = r["n_drafted_calls"] if "n_drafted_calls" in r else None
    out = {"drafted": r["n_drafted"], "accepted": r["n_accept"],
           "accept_pct": 100.0 * r["n_accept"] / max(r["n_drafted"], 1)}
    if steps:
        out["steps"] = steps
    return out


def run_fleet(n_clients: int, fleet: np.ndarray, held: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(n_clients)
    offsets = rng.integers(0, len(fleet), n_clients)
    full = CountTable()
    view = DraftView(full, ViewPolicy(top_k=args.top_k, min_change_pct=args.min_change_pct, max_rows=args.max_rows,
                                      max_rows_per_second=args.max_rows_per_second,
                                      settle_seconds=args.settle_seconds, log_rows=4 * args.max_rows))
    per_second: list[tuple[int, int, int]] = []  # (deltas, full-mirror rows, view rows)
    t0 = time.perf_counter()
    for second in range(args.seconds):
        step = CountTable()
        deltas = 0
        for i in range(n_clients):
            start = int(offsets[i]) + second * args.tokens
            idx = np.arange(start - 4, start + args.tokens) % len(fleet)  # 4 tokens of context before the new ones
            step.update(fleet[idx], n_new=args.tokens)
            deltas += 4 * args.tokens
        changed = step.to_rows().astype(np.int64)  # the (n-gram, follower) rows this second changed
        full.merge(step)
        rows, scale = view.diff(changed, 1.0)
        view.apply(rows, scale)
        per_second.append((deltas, len(changed), len(rows)))
    elapsed = time.perf_counter() - t0
    steady = per_second[len(per_second) // 2:]
    full_rows = statistics.mean(r[1] for r in steady)
    view_rows = statistics.mean(r[2] for r in steady)
    acc_full = replay_accept(held, full, args.n_ctx)
    acc_view = replay_accept(held, view.published, args.n_ctx)
    return {
        "clients": n_clients, "fleet_deltas_s": statistics.mean(r[0] for r in steady), "sim_seconds": elapsed,
        "full_rows_s": full_rows, "view_rows_s": view_rows,
        "full_bytes_s": full_rows * ROW_BYTES, "view_bytes_s": view_rows * ROW_BYTES,
        "full_rows": full.n_entries, "view_rows": view.published.n_entries,
        "full_mem": full.memory_bytes(), "view_mem": view.published.memory_bytes(), "view_scale": view.scale,
        "acc_full": acc_full, "acc_view": acc_view,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000], help="fleet sizes (default 10 100 1000)")
    ap.add_argument("--seconds", type=int, default=10, help="simulated seconds per fleet (default 10)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens a client accepts per second (default 1000)")
    ap.add_argument("--top-k", type=int, default=8, help="the view's followers per key (default 8, the service's)")
    ap.add_argument("--min-change-pct", type=int, default=25, help="the view's republish threshold (default 25)")
    ap.add_argument("--max-rows", type=int, default=2_000_000, help="the view's row budget (default 2,000,000)")
    ap.add_argument("--settle-seconds", type=float, default=10.0, help="the view's settle time (default 10)")
    ap.add_argument("--max-rows-per-second", type=int, default=20_000,
                    help="the view's rate budget, rows a client pulls per second (default 20,000)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="replay context size (default 4096)")
    ap.add_argument("--max-files", type=int, default=100_000, help="standard library files read at most")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in seconds: 10 and 20 clients, 2 s simulated, 80 files (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.seconds, args.max_files = [10, 20], 2, 80
    if min(args.clients) < 1 or args.seconds < 2 or args.tokens < 1:
        ap.error("--clients >= 1, --seconds >= 2, --tokens >= 1")

    t0 = time.perf_counter()
    fleet, held = stdlib_tokens(args.max_files)
    print(f"corpus: CPython standard library, cl100k: fleet text {len(fleet):,} tokens, held out {len(held):,} "
          f"(tokenized in {time.perf_counter() - t0:.1f} s)")
    print(f"each client: {args.tokens:,} tokens/s (~{4 * args.tokens:,} deltas/s), {args.seconds} s simulated; "
          f"view: top_k {args.top_k}, republish at > {args.min_change_pct}%, max {args.max_rows:,} rows")
    results = [run_fleet(n, fleet, held, args) for n in args.clients]

    print("\nper client, steady state (second half of the run):")
    print(f"{'clients':>8} {'fleet deltas/s':>15} {'full pull/s':>13} {'view pull/s':>13} {'ratio':>7} "
          f"{'full mirror':>12} {'view mirror':>12} {'ratio':>7} {'scale':>6}")
    for r in results:
        print(f"{r['clients']:>8,} {r['fleet_deltas_s']:>15,.0f} {r['full_bytes_s'] / 1e6:>10.2f} MB "
              f"{r['view_bytes_s'] / 1e6:>10.2f} MB {r['full_bytes_s'] / max(r['view_bytes_s'], 1):>6.1f}x "
              f"{r['full_mem'] / 1e6:>9.1f} MB {r['view_mem'] / 1e6:>9.1f} MB "
              f"{r['full_mem'] / max(r['view_mem'], 1):>6.1f}x {r['view_scale']:>6}")
    print("\nreplay of the held-out files (llama-lookup-stats protocol, n_draft 8, no static cache), "
          "dynamic table = the mirror:")
    print(f"{'clients':>8} {'full: accepted':>15} {'accept %':>9} {'view: accepted':>15} {'accept %':>9} {'lost':>7}")
    for r in results:
        f, v = r["acc_full"], r["acc_view"]
        lost = 100.0 * (f["accepted"] - v["accepted"]) / max(f["accepted"], 1)
        print(f"{r['clients']:>8,} {f['accepted']:>15,} {f['accept_pct']:>9.1f} {v['accepted']:>15,} "
              f"{v['accept_pct']:>9.1f} {lost:>6.1f}%")
    if len(results) > 1:
        a, b = results[0], results[-1]
        grow = b["clients"] / a["clients"]
        print(f"\nfrom {a['clients']:,} to {b['clients']:,} clients ({grow:.0f}x): full-mirror pull per client "
              f"{b['full_bytes_s'] / max(a['full_bytes_s'], 1):.1f}x, view pull per client "
              f"{b['view_bytes_s'] / max(a['view_bytes_s'], 1):.1f}x; mirror memory "
              f"{b['full_mem'] / max(a['full_mem'], 1):.1f}x vs {b['view_mem'] / max(a['view_mem'], 1):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
