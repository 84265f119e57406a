"""The fleet history through a real service and real clients, replayed in real time and checked against the simulation.

bench_fleet_history.py measures the fleet history by simulation: MatchFleet moves what one
replica accepted to the others after a fixed lag. Here the same replay (fleet_sim.simulate,
same recording, same arrival orders) runs with K real `NgramClient`s in match mode, each with
its own channel, history publisher and mirror, against `ngramcache serve` started as a process
on loopback (embedded store, a temporary data dir). The replay runs in real time: a tick at
simulated `now` ms runs at t0 + now of wall time, so what reaches a client from the others is
what the service's PullHistory long poll and the publishers' batches delivered by then.

Each replica drafts with `client.drafter()` (linear drafts of 8): the prompt is accepted at
the request's start (its group set first with `set_group(seq, "g<group>")`), each step's new
tokens after it, and the sequence is reset when it ends, as the adapters' SequenceFeed does.
The bench times, per client, from a token's accept on its replica to the moment the mirror of
another client appends it to its drafter (accept -> mirrored: the publisher's drain interval,
the push, the tail and the long poll), and the clients report their own store -> client lag.

Beside each real run, on the same requests and arrival order, simulated: MatchFleet at
`--lag-ms` (100) and at the measured accept -> mirrored p50, and MatchLocal (siloed).
The real clients also share counts (each mirrors the service's draft view into its drafter's
dynamic table, which the match mode's count walk reads); the simulated fleet has none, so it
drafts less. `--no-counts` detaches that table from the drafters, leaving the fleet history
alone, as simulated; a simulated row publishing prompts too (as the clients do) is beside it.
Figures: tokens/step, accept %, drafted/step (medians over seeds), the ratio real / simulated,
lags p50/p99, bytes pulled per client, history dropped, and the ticks whose work (K clients'
drafts and accepts) overran `--step-ms`.

    python tests/bench/bench_fleet_history_service.py --quick   # a smoke run (about a minute)
    python tests/bench/bench_fleet_history_service.py           # K=2,4, (a) and (b), seeds 0..2 (about 8 min)
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.service import start_serve, stop_serve  # noqa: E402

from bench.lib.fleet_setups import MatchFleet, MatchLocal  # noqa: E402
from bench.lib.fleet_sim import Request, Result, Schedule, Setup, load_recording, simulate  # noqa: E402
from ngramcache import UNTAGGED, AdminClient, NgramClient  # noqa: E402

DEFAULT_DATA = ROOT / "tests" / "bench" / "data" / "fleet_workloads.npz"
N_DRAFT = 8


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class ServiceFleet(Setup):
    """K real NgramClients (match mode) on one namespace of a running service, replayed in real time
    (or, siloed, each on a namespace of its own: its own counts and no one else's history)."""

    name = "ngramcache fleet, real service"

    def __init__(self, k: int, address: str, namespace: str | list[str], vocab: int, cache_dir: Path, step_ms: float,
                 groups: dict[bytes, int], counts: bool = True) -> None:
        super().__init__(k)
        self.step_ms = step_ms
        self.groups = groups  # prompt bytes -> group: Setup.start is given the prompt, not the group
        namespaces = [namespace] * k if isinstance(namespace, str) else namespace
        self.clients = [NgramClient(address, ns, (UNTAGGED, vocab), cache_dir=cache_dir, mode="match",
                                    connect_timeout=10.0, ready_timeout=30.0) for ns in namespaces]
        self.drafters = [c.drafter() for c in self.clients]
        if not counts:
            # History only, as the simulated MatchFleet: the shared counts (the draft view the client
            # mirrors into its dynamic table) no longer reach the drafts.
            for d in self.drafters:
                d.set_dynamic(None)
        ids = [c._sync.state.client_id for c in self.clients]
        self.replica_of = {cid: i for i, cid in enumerate(ids)}
        self.lock = threading.Lock()
        # (replica, seq) -> lengths of the sequence after each accept, and their wall times
        self.accepted: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
        self.mirror_lags: list[float] = []
        for c in self.clients:
            self._time_mirror(c)
        self.t0: float | None = None
        self.tick_work: list[float] = []  # ms from a tick's start to the next tick's call
        self.late_ticks = 0
        self._tick_started: float | None = None

    def _time_mirror(self, client: NgramClient) -> None:
        """Wraps the client's mirror so each record it appends is timed against its accept on the source replica."""
        mirror = client._sync.history_mirror
        apply = mirror.apply

        def timed(records: list[Any]) -> int:
            n = apply(records)
            now = time.perf_counter()
            with self.lock:
                for r in records:
                    replica = self.replica_of.get(r.client_id)
                    seen = self.accepted.get((replica, r.seq)) if replica is not None else None
                    if seen is None:
                        continue
                    end = r.offset + len(r.tokens) // 4  # the record's last token sits at end - 1
                    i = bisect.bisect_left(seen[0], end)
                    if i < len(seen[0]):
                        self.mirror_lags.append((now - seen[1][i]) * 1000)
            return n

        mirror.apply = timed  # type: ignore[method-assign]

    def _accepted(self, replica: int, rid: int, length: int) -> None:
        with self.lock:
            lengths, times = self.accepted.setdefault((replica, rid), ([], []))
            lengths.append(length)
            times.append(time.perf_counter())

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self.clients[replica].set_group(rid, f"g{self.groups[prompt.tobytes()]}")
        self.drafters[replica].accept(rid, prompt)
        self._accepted(replica, rid, len(prompt))

    def draft(self, replica: int, rid: int, tokens: np.ndarray) -> list[int]:
        return self.drafters[replica].draft(rid, tokens, N_DRAFT).tolist()  # type: ignore[no-any-return]

    def observe(self, replica: int, rid: int, tokens: np.ndarray, n_new: int, now: float) -> None:
        self.drafters[replica].accept(rid, tokens)
        self._accepted(replica, rid, len(tokens))

    def finish(self, replica: int, rid: int, now: float) -> None:
        self.drafters[replica].reset(rid)

    def tick(self, now: float) -> None:
        wall = time.perf_counter()
        if self.t0 is None:
            self.t0 = wall - now / 1000
        if self._tick_started is not None:
            self.tick_work.append((wall - self._tick_started) * 1000)
        due = self.t0 + now / 1000
        if wall < due:
            time.sleep(due - wall)
        elif wall - due > self.step_ms / 1000:
            self.late_ticks += 1
        self._tick_started = time.perf_counter()

    def close(self) -> list[dict[str, Any]]:
        stats = [c.stats() for c in self.clients]
        for c in self.clients:
            c.close()
        return stats

    def extra(self) -> dict[str, float]:
        stats = [c.stats() for c in self.clients]
        with self.lock:
            lags = list(self.mirror_lags)
        p50s = [s["history_lag_ms_p50"] for s in stats if s["history_lag_ms_p50"] is not None]
        p99s = [s["history_lag_ms_p99"] for s in stats if s["history_lag_ms_p99"] is not None]
        work = self.tick_work
        return {"pulled_bytes_per_client": statistics.mean(s["history_pulled_bytes"] for s in stats),
                "pulled_tokens_per_client": statistics.mean(s["history_pulled_tokens"] for s in stats),
                "history_dropped": float(sum(s["history_dropped_tokens"] for s in stats)),
                "mirror_lag_p50": quantile(lags, 0.5), "mirror_lag_p99": quantile(lags, 0.99),
                "store_lag_p50": statistics.median(p50s) if p50s else float("nan"),
                "store_lag_p99": max(p99s) if p99s else float("nan"),
                "tick_overrun_pct": 100.0 * sum(w > self.step_ms for w in work) / max(len(work), 1),
                "tick_work_p50_ms": quantile(work, 0.5), "tick_work_p99_ms": quantile(work, 0.99),
                "late_ticks": float(self.late_ticks)}


class PromptFleet(MatchFleet):
    """MatchFleet publishing each sequence's prompt too, as the clients do (their first record is the prompt)."""

    def _publish(self, replica: int, now: float) -> None:
        for seq, _, toks in self.drafters[replica].drain_history():
            self.records.append((now, replica, (replica << 32) | seq, toks))


def figures(r: Result) -> dict[str, float]:
    return {"tokens_per_step": r.tokens_per_step, "accept_pct": r.accept_pct, "drafted_per_step": r.drafted_per_step,
            "sim_s": r.sim_ms / 1000, **r.extra}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def select(requests: list[Request], groups: int) -> list[Request]:
    """The requests of the first `groups` groups (all with 0)."""
    if not groups:
        return requests
    keep = set(sorted({r.group for r in requests})[:groups])
    return [r for r in requests if r.group in keep]


def run_cell(address: str, workload: str, requests: list[Request], k: int, seeds: int, schedule: Schedule,
             args: argparse.Namespace, vocab: int, tmp: Path) -> dict[str, dict[str, float]]:
    """K real clients and the simulated setups, each seed; medians per setup."""
    groups = {r.prompt.tobytes(): r.group for r in requests}
    runs: dict[str, list[dict[str, float]]] = {"real": [], "sim_lag": [], "sim_measured": [], "sim_prompts": [],
                                               "local": []}
    if args.siloed:
        runs["real_siloed"] = []
    for seed in range(seeds):
        sched = Schedule(**{**schedule.__dict__, "seed": seed})
        namespace = f"{workload}-k{k}-s{seed}-{int(time.time())}"
        with AdminClient(address, timeout=30) as admin:
            admin.create_namespace(namespace, (UNTAGGED, vocab))
        t = time.perf_counter()
        fleet = ServiceFleet(k, address, namespace, vocab, tmp / "cache", args.step_ms, groups, counts=not args.no_counts)
        try:
            real = simulate(requests, fleet, sched, N_DRAFT)
        finally:
            fleet.close()
        wall = time.perf_counter() - t
        measured = real.extra["mirror_lag_p50"]
        runs["real"].append({**figures(real), "wall_s": wall})
        runs["sim_lag"].append(figures(simulate(requests, MatchFleet(k, vocab, args.lag_ms), sched, N_DRAFT)))
        runs["sim_measured"].append({**figures(simulate(requests, MatchFleet(k, vocab, measured), sched, N_DRAFT)),
                                     "lag_ms": measured})
        runs["sim_prompts"].append(figures(simulate(requests, PromptFleet(k, vocab, measured), sched, N_DRAFT)))
        runs["local"].append(figures(simulate(requests, MatchLocal(k, vocab), sched, N_DRAFT)))
        if args.siloed:  # the same clients, each on a namespace of its own: the real siloed baseline
            silos = [f"{namespace}-silo{i}" for i in range(k)]
            with AdminClient(address, timeout=30) as admin:
                for ns in silos:
                    admin.create_namespace(ns, (UNTAGGED, vocab))
            siloed = ServiceFleet(k, address, silos, vocab, tmp / "cache", args.step_ms, groups,
                                  counts=not args.no_counts)
            try:
                runs["real_siloed"].append(figures(simulate(requests, siloed, sched, N_DRAFT)))
            finally:
                siloed.close()
        x = runs["real"][-1]
        print(f"  {workload} K={k} seed {seed}: real {x['tokens_per_step']:.3f} tokens/step, sim (lag {args.lag_ms:g}) "
              f"{runs['sim_lag'][-1]['tokens_per_step']:.3f}, sim (lag {measured:.0f}) "
              f"{runs['sim_measured'][-1]['tokens_per_step']:.3f}, local {runs['local'][-1]['tokens_per_step']:.3f}"
              + (f", real siloed {runs['real_siloed'][-1]['tokens_per_step']:.3f}" if args.siloed else "") + "; "
              f"accept->mirrored p50 {measured:.0f} ms; ticks over {args.step_ms:g} ms "
              f"{x['tick_overrun_pct']:.1f}%; {wall:.0f} s", flush=True)
    return {name: median_of(rs) for name, rs in runs.items()}


def print_tables(cells: dict[str, dict[str, dict[str, float]]], lag_ms: float) -> None:
    print("\n## Real service and clients against the simulation (medians over seeds)\n")
    print("| workload, K | setup | tokens/step | accept % | drafted/step | real / this |")
    print("|---|---|---:|---:|---:|---:|")
    for cell, setups in cells.items():
        real = setups["real"]["tokens_per_step"]
        labels = {"real": "real service + clients", "sim_lag": f"simulated fleet, lag {lag_ms:g} ms",
                  "sim_measured": f"simulated fleet, lag {setups['sim_measured']['lag_ms']:.0f} ms (measured p50)",
                  "sim_prompts": "simulated fleet, measured lag, prompts published too",
                  "local": "simulated local only (siloed)",
                  "real_siloed": "real service + clients, siloed (a namespace each)"}
        for name, label in labels.items():
            if name not in setups:
                continue
            f = setups[name]
            print(f"| {cell} | {label} | {f['tokens_per_step']:.3f} | {f['accept_pct']:.1f} | "
                  f"{f['drafted_per_step']:.2f} | {real / f['tokens_per_step']:.3f} |")
    print("\n| workload, K | accept->mirrored p50 / p99 ms | store->client p50 / p99 ms | KB pulled/client | "
          "k tokens pulled/client (real / sim) | history dropped | ticks over step % | tick work p50 / p99 ms | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cell, setups in cells.items():
        r, s = setups["real"], setups["sim_measured"]
        print(f"| {cell} | {r['mirror_lag_p50']:.0f} / {r['mirror_lag_p99']:.0f} | {r['store_lag_p50']:.1f} / "
              f"{r['store_lag_p99']:.1f} | {r['pulled_bytes_per_client'] / 1024:.0f} | "
              f"{r['pulled_tokens_per_client'] / 1000:.1f} / {s['pulled_bytes_per_client'] / 4000:.1f} | "
              f"{r['history_dropped']:.0f} | {r['tick_overrun_pct']:.1f} | "
              f"{r['tick_work_p50_ms']:.2f} / {r['tick_work_p99_ms']:.2f} | {r['wall_s']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the recording (record_workloads.py's output)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 rollout groups, 16 repeated requests, one seed")
    ap.add_argument("--ks", default="2,4", help="replica counts (default 2,4)")
    ap.add_argument("--workloads", default="rollout,repeated")
    ap.add_argument("--seeds", type=int, default=3, help="arrival orders 0..n-1; figures are medians (default 3)")
    ap.add_argument("--groups", type=int, default=0, help="replay only the first N groups of each workload (0: all)")
    ap.add_argument("--lag-ms", type=float, default=100.0, help="the simulated fleet's fixed lag (default 100)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="time of one step (default 20)")
    ap.add_argument("--group-interval-ms", type=float, default=1000.0, help="rollout groups arrive this often")
    ap.add_argument("--interval-ms", type=float, default=150.0, help="repeated requests arrive this often")
    ap.add_argument("--no-counts", action="store_true",
                    help="detach each client's mirrored counts from its drafter: the fleet history alone, as simulated")
    ap.add_argument("--siloed", action="store_true",
                    help="also run the real clients siloed, each on a namespace of its own (the real baseline)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    if not args.data.is_file():
        print(f"error: no recording at {args.data}: run tests/bench/record_workloads.py first", file=sys.stderr)
        return 1
    workloads, meta = load_recording(args.data)
    vocab = int(meta["vocab_size"])
    ks = [int(x) for x in args.ks.split(",")]
    names = [w for w in args.workloads.split(",") if w]
    if unknown := set(names) - set(workloads):
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(workloads)}")
    seeds = 1 if args.quick else args.seeds
    cells: dict[str, dict[str, dict[str, float]]] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ngc-fleet-svc-") as tmp:
        service, port = start_serve(Path(tmp) / "data")
        address = f"127.0.0.1:{port}"
        print(f"service: pid {service.pid}, {address}, embedded store; recording {args.data.name} ({meta['model']}); "
              f"step {args.step_ms:g} ms, {seeds} seed(s){', counts detached' if args.no_counts else ''}", flush=True)
        try:
            for workload in names:
                groups = (8 if workload == "rollout" else 16) if args.quick else args.groups
                requests = select(workloads[workload], groups)
                interval = args.group_interval_ms if workload == "rollout" else args.interval_ms
                schedule = Schedule(interval, args.step_ms, True, "round-robin")
                print(f"{workload}: {len(requests)} requests, {sum(len(r.output) for r in requests)} tokens",
                      flush=True)
                for k in ks:
                    cells[f"{workload}, K={k}"] = run_cell(address, workload, requests, k, seeds, schedule, args, vocab,
                                                           Path(tmp))
        finally:
            code, err = stop_serve(service)
            if code not in (0, -15):
                print(f"service exited {code}: {err[-2000:]}", file=sys.stderr)
    print_tables(cells, args.lag_ms)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
