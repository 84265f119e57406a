"""Fleet history benchmark: recorded real-model workloads replayed over K replicas, ngramcache's fleet against SuffixDecoding.

The recordings (tests/bench/data/fleet_workloads.npz, made by record_workloads.py from
SmolLM2-135M-Instruct) are replayed by fleet_sim.py, an exact simulation of speculative
sampling with deterministic drafts: a drafted token d is accepted with probability p(d)
either way, so replaying a recorded sample, accepting the longest draft prefix equal to it
plus the one token the model emits in that pass, draws the same outputs speculative sampling
would; only the number of passes depends on the drafts. Time is event-driven: requests arrive
over time, every active request takes one step per tick (`--step-ms`, 20 ms), the siblings
of a rollout group arrive together (concurrent) or one after another (sequential), and K
replicas take them round-robin or group-affine. Each replica drafts with what it holds at that
moment; the fleet's tokens become visible elsewhere `--lag-ms` after they were accepted.

Setups (fleet_setups.py), side by side, linear drafts of 8 tokens for all:
- prompt lookup: the match mode with no history (each request alone);
- SuffixDecoding siloed: vLLM's `suffix` method, one cache per replica (the real
  arctic-inference build, tests/bench/engines/build_suffix_decoding.py);
- SuffixDecoding ideal: one cache that sees every request at zero lag;
- ngramcache local only: one match-mode Drafter per replica, its own history;
- ngramcache local, own counts: the same with each replica's own counts mirrored back to its
  dynamic table, as a real client alone on its namespace drafts (the siloed real client);
- ngramcache fleet: the same plus the other replicas' output through add_history after the
  lag (and at lag 0; and holding a remote sequence's tokens back until `--min-piece` are
  visible, since every add_history piece starts a new text of the history), and the fleet's
  counts as real clients share them (fleet_counts.py: pushed every 100 ms, filtered by the
  service's draft view every 250 ms, mirrored into each replica's dynamic table every 500 ms;
  `--no-counts`: the history alone);
- ngramcache one drafter (a diagnostic): one Drafter for every request at zero lag.

Figures: tokens per step (all output tokens / steps), accept % (accepted / drafted), drafted
tokens per step, and for the fleet the bytes each client pulls (4 bytes a token of others'
records); medians over `--seeds` arrival orders. Then the fleet's tokens per step over the ideal,
siloed and local setups, and a cold start: a replica joining late, with and without the history
window handed to it.

    python tests/bench/bench_fleet_history.py --quick     # a smoke run (seconds)
    python tests/bench/bench_fleet_history.py             # the full run (a few minutes)

`--match-params '{"min_match": 2}'` tunes every ngramcache setup (the defaults are the
report's); `--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the benchmarks' library (bench.lib) and helpers

from bench.lib.fleet_setups import MatchFleet, MatchLocal, MatchShared, MatchSiloed, PromptLookup, SuffixTrees  # noqa: E402
from bench.lib.fleet_sim import Request, Result, Schedule, Setup, load_recording, simulate  # noqa: E402

DEFAULT_DATA = ROOT / "tests" / "bench" / "data" / "fleet_workloads.npz"
SETUP_KEYS = ("pl", "sd_silo", "sd_ideal", "local", "local_counts", "fleet", "fleet_lag0", "fleet_pieces", "ngc_shared")
LABELS = {"pl": "prompt lookup (per request)", "sd_silo": "SuffixDecoding siloed (per replica)",
          "sd_ideal": "SuffixDecoding ideal (one tree, no lag)", "local": "ngramcache local only",
          "local_counts": "ngramcache local, own counts mirrored (a client alone on its namespace)",
          "fleet": "ngramcache fleet (lag {lag:g} ms)", "fleet_lag0": "ngramcache fleet (lag 0)",
          "fleet_pieces": "ngramcache fleet (lag {lag:g} ms, remote pieces >= {piece} tokens)",
          "ngc_shared": "ngramcache one drafter (no lag; diagnostic)"}
# K-independent setups run once (K=1): no state across requests, or one state for all replicas.
K_FREE = ("pl", "sd_ideal", "ngc_shared")


def make_setup(key: str, k: int, vocab: int, lag_ms: float, params: dict[str, float] | None,
               lib_dir: Path | None, min_piece: int = 0, counts: bool = True) -> Setup:
    if key == "pl":
        return PromptLookup(k, vocab, params)
    if key == "sd_silo":
        return SuffixTrees(k, shared=False, lib_dir=lib_dir)
    if key == "sd_ideal":
        return SuffixTrees(k, shared=True, lib_dir=lib_dir)
    if key == "local":
        return MatchLocal(k, vocab, params)
    if key == "local_counts":
        return MatchSiloed(k, vocab, params)
    if key == "ngc_shared":
        return MatchShared(k, vocab, params)
    return MatchFleet(k, vocab, 0.0 if key == "fleet_lag0" else lag_ms, params, min_piece if key == "fleet_pieces" else 0,
                      counts=counts)


def summarize(results: list[Result]) -> dict[str, float]:
    """Medians over seeds of each figure."""
    med = statistics.median
    out = {"tokens_per_step": med(r.tokens_per_step for r in results), "accept_pct": med(r.accept_pct for r in results),
           "drafted_per_step": med(r.drafted_per_step for r in results), "steps": med(r.steps for r in results),
           "sim_s": med(r.sim_ms for r in results) / 1000}
    for key in results[0].extra:
        out[key] = med(r.extra[key] for r in results)
    return out


def run_cell(requests: list[Request], key: str, k: int, schedule: Schedule, seeds: int, make: Callable[..., Setup]
             ) -> dict[str, float]:
    results = []
    for seed in range(seeds):
        sched = Schedule(**{**schedule.__dict__, "seed": seed})
        results.append(simulate(requests, make(key, k), sched))
    return summarize(results)


def print_schedule_table(title: str, cells: dict[tuple[str, int], dict[str, float]], ks: list[int], keys: list[str],
                         lag: float, piece: int) -> None:
    print(f"\n## {title}\n")
    print("| setup | " + " | ".join(f"K={k}" for k in ks) + " | K=" + str(ks[-1]) + ": accept % | drafted/step | KB pulled/client |")
    print("|---|" + "---:|" * (len(ks) + 3))
    for key in keys:
        row = [cells[(key, 1 if key in K_FREE else k)]["tokens_per_step"] for k in ks]
        top = cells[(key, 1 if key in K_FREE else ks[-1])]
        pulled = top.get("pulled_bytes_per_client")
        print(f"| {LABELS[key].format(lag=lag, piece=piece)} | " + " | ".join(f"{x:.3f}" for x in row)
              + f" | {top['accept_pct']:.1f} | {top['drafted_per_step']:.2f} | "
              + (f"{pulled / 1024:.0f}" if pulled is not None else "")
              + (f" + {top['view_rows_pulled_per_client'] / 1000:.0f}k view rows" if "view_rows_pulled_per_client" in top
                 else "") + " |")
    k = ks[-1]
    if not all(c in cells for c in (("fleet", k), ("sd_ideal", 1), ("sd_silo", k), ("local", k), ("fleet_pieces", k))):
        return
    fleet, ideal = cells[("fleet", k)]["tokens_per_step"], cells[("sd_ideal", 1)]["tokens_per_step"]
    silo, local = cells[("sd_silo", k)]["tokens_per_step"], cells[("local", k)]["tokens_per_step"]
    pieces = cells[("fleet_pieces", k)]["tokens_per_step"]
    print(f"\nK={k}: fleet / ideal SD {fleet / ideal:.3f}x, fleet / siloed SD {fleet / silo:.3f}x, "
          f"fleet / local {fleet / local:.3f}x; with pieces: {pieces / ideal:.3f}x, {pieces / silo:.3f}x, {pieces / local:.3f}x")
    if ("local_counts", k) in cells:
        print(f"fleet / local with its own counts {fleet / cells[('local_counts', k)]['tokens_per_step']:.3f}x")


def cold_start(requests: list[Request], k: int, join_after: int, schedule: Schedule, make: Callable[..., Setup],
               window_n: int = 5) -> dict[str, Any]:
    """A replica joins after `join_after` groups: its first requests' tokens/step against the
    warm replicas' over the same period, with and without the history window handed to it."""
    out: dict[str, Any] = {}
    for label, key, window in (("fleet, window handed", "fleet", True), ("fleet, cold", "fleet", False),
                               ("local only", "local", False)):
        sched = Schedule(**{**schedule.__dict__, "join_after": join_after, "join_window": window})
        res = simulate(requests, make(key, k), sched)
        cold = [(s, t) for r, s, t, _ in res.per_request if r == k - 1]
        t_join = min((t0 for r, _, _, t0 in res.per_request if r == k - 1), default=0.0)
        warm = [(s, t) for r, s, t, t0 in res.per_request if r != k - 1 and t0 >= t_join]
        if not cold or not warm:
            continue
        steady = sum(t for _, t in warm) / sum(s for s, _ in warm)
        per = [t / s for s, t in cold]
        windows = [sum(t for _, t in cold[i:i + window_n]) / sum(s for s, _ in cold[i:i + window_n])
                   for i in range(max(len(cold) - window_n + 1, 1))]
        reach = next((i + 1 for i, w in enumerate(windows) if w >= 0.9 * steady), None)
        first = [sum(t for _, t in cold[a:b]) / max(sum(s for s, _ in cold[a:b]), 1) for a, b in ((0, 5), (5, 10), (10, 20))]
        out[label] = {"steady": steady, "first_1_5": first[0], "first_6_10": first[1], "first_11_20": first[2],
                      "reaches_90pct_at_request": reach, "cold_requests": len(per)}
    return out


def schedules_of(workload: str, args: argparse.Namespace) -> list[tuple[str, Schedule]]:
    """The schedules a workload is replayed under, by name: rollout groups' siblings arrive together
    (concurrent) or one after another, routed round-robin or by group; single requests round-robin."""
    if workload == "rollout":
        return [(f"{mode}, {routing}", Schedule(args.group_interval_ms, args.step_ms, mode == "concurrent", routing))
                for mode in ("concurrent", "sequential") for routing in ("round-robin", "group")]
    return [("round-robin", Schedule(args.interval_ms, args.step_ms, True, "round-robin"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Replays the recorded fleet workloads over K simulated replicas: "
                                             "ngramcache's fleet history against siloed and ideal SuffixDecoding.")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the recording (record_workloads.py's output)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few requests, K=1 and 8, one seed (seconds)")
    ap.add_argument("--lag-ms", type=float, default=100.0, help="accept-to-visible lag of the fleet (default 100)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="time of one step (default 20)")
    ap.add_argument("--group-interval-ms", type=float, default=1000.0, help="rollout groups arrive this often")
    ap.add_argument("--interval-ms", type=float, default=150.0, help="single requests (b, c) arrive this often")
    ap.add_argument("--seeds", type=int, default=3, help="arrival orders; figures are medians (default 3)")
    ap.add_argument("--ks", default="1,2,4,8", help="replica counts (default 1,2,4,8)")
    ap.add_argument("--workloads", default="rollout,repeated,control")
    ap.add_argument("--match-params", type=json.loads, default=None, help="JSON overrides of the match mode's tuning")
    ap.add_argument("--min-piece", type=int, default=16,
                    help="the pieces row: hold a remote sequence's tokens until this many are visible or it ended (default 16)")
    ap.add_argument("--lib-dir", type=Path, default=None, help="SuffixDecoding's build (build_suffix_decoding.py)")
    ap.add_argument("--setups", default=",".join(SETUP_KEYS), help=f"run only these (default all: {','.join(SETUP_KEYS)})")
    ap.add_argument("--schedules", default="", help="run only the schedules whose name contains this: rollout's are 'concurrent' or 'sequential', then "
                         "', round-robin' or ', group'; repeated's and control's 'round-robin' (e.g. 'concurrent, round')")
    ap.add_argument("--no-counts", action="store_true",
                    help="the fleet shares its history only, not its counts (the draft view mirrored into each "
                         "replica's dynamic table, as real clients do)")
    ap.add_argument("--no-cold-start", action="store_true")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)

    if not args.data.is_file():
        print(f"error: no recording at {args.data}: run tests/bench/record_workloads.py first", file=sys.stderr)
        return 1
    workloads, meta = load_recording(args.data)
    vocab = int(meta["vocab_size"])
    ks = [int(x) for x in args.ks.split(",")]
    keys = [key for key in args.setups.split(",") if key]
    if unknown := set(keys) - set(SETUP_KEYS):
        ap.error(f"unknown setups {sorted(unknown)}; choose from {','.join(SETUP_KEYS)}")
    names = [w for w in args.workloads.split(",") if w]
    if unknown := set(names) - set(workloads):
        ap.error(f"unknown workloads {sorted(unknown)}; the recording has {','.join(workloads)}")
    schedules = {w: schedules_of(w, args) for w in names}
    if not any(args.schedules in name for w in names for name, _ in schedules[w]):
        ap.error(f"no schedule of {','.join(names)} contains {args.schedules!r}; they are: "
                 + "; ".join(f"{w}: {', '.join(repr(n) for n, _ in schedules[w])}" for w in names))
    seeds = args.seeds
    if args.quick:
        ks, seeds = [1, 8], 1
        for w, reqs in workloads.items():
            keep = sorted({r.group for r in reqs})[: 4 if w == "rollout" else 16]
            workloads[w] = [r for r in reqs if r.group in keep]
    if 1 not in ks:
        ks = [1, *ks]
    try:
        SuffixTrees(1, shared=True, lib_dir=args.lib_dir)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    def make(key: str, k: int) -> Setup:
        return make_setup(key, k, vocab, args.lag_ms, args.match_params, args.lib_dir, args.min_piece, not args.no_counts)

    print(f"recording: {args.data.name} ({meta['model']}, seed {meta['seed']}); lag {args.lag_ms:g} ms, step "
          f"{args.step_ms:g} ms, {seeds} seed(s), match params {args.match_params or 'defaults'}, min piece {args.min_piece}, "
          f"fleet counts {'off' if args.no_counts else 'on (draft view, default intervals)'}")
    report: dict[str, Any] = {"meta": meta, "args": {k: str(v) for k, v in vars(args).items()}, "tables": {}}
    t_all = time.perf_counter()
    for workload in names:
        requests = workloads[workload]
        n_tokens = sum(len(r.output) for r in requests)
        for name, schedule in schedules[workload]:
            if args.schedules not in name:
                continue
            t0 = time.perf_counter()
            cells: dict[tuple[str, int], dict[str, float]] = {}
            for key in keys:
                for k in [1] if key in K_FREE else ks:
                    cells[(key, k)] = run_cell(requests, key, k, schedule, seeds, make)
            title = (f"({'abc'[('rollout', 'repeated', 'control').index(workload)]}) {workload}: {len(requests)} "
                     f"requests, {n_tokens} tokens; {name}; tokens/step ({time.perf_counter() - t0:.0f} s)")
            print_schedule_table(title, cells, ks, keys, args.lag_ms, args.min_piece)
            report["tables"][f"{workload} / {name}"] = {f"{key} K={k}": v for (key, k), v in cells.items()}
    if not args.no_cold_start and "rollout" in workloads:
        print("\n## Cold start: a replica joins after a quarter of the groups (round-robin, concurrent)\n")
        print("| workload, K | setup | steady tokens/step | its requests 1-5 | 6-10 | 11-20 | 5 in a row >= 90% from request |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for workload, k in (("rollout", 8), ("repeated", 2)):
            reqs = workloads[workload]
            n_groups = len({r.group for r in reqs})
            interval = args.group_interval_ms if workload == "rollout" else args.interval_ms
            res = cold_start(reqs, k, max(n_groups // 4, 1), Schedule(interval, args.step_ms, True, "round-robin"), make)
            report.setdefault("cold_start", {})[f"{workload} K={k}"] = res
            for label, r in res.items():
                print(f"| {workload}, K={k} | {label} | {r['steady']:.3f} | {r['first_1_5'] / r['steady']:.0%} | "
                      f"{r['first_6_10'] / r['steady']:.0%} | {r['first_11_20'] / r['steady']:.0%} | "
                      f"{r['reaches_90pct_at_request']} (of {r['cold_requests']}) |")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
