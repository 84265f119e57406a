"""Load test of the whole fleet path: a Redis Cluster, service replicas and many clients, ramped to the knee.

Everything runs on this machine over loopback: a Redis Cluster of MASTERS redis-server
processes (AOF on, ``--fsync`` policy, default everysec as the deploy files), REPLICAS
`ngramcache serve` processes over it, and CLIENTS real `NgramClient`s in match mode (pushing
counts, publishing the fleet history and mirroring both, default settings), ``--per-proc``
(16) to a client process. Each client is an engine's sync layer without the engine: it runs
a group of 8 siblings at a time (one prompt of 64-128 tokens, then 200-400 tokens each, the
siblings' tokens mostly alike, `set_group` per group), drafting 8 tokens and accepting 1-8 at
every step; its first group starts part-way (a fleet already running). One driver thread per
client process paces its clients to the offered rate in tokens/s. The client processes run at a
lower CPU priority (``--client-nice``, 10): they stand in for engine hosts, which in a fleet do
not share cores with the service replicas and Redis; here they do, and take what those leave.

A ramp: one step with no load (the fleet's polling and the marker alone), then the offered
load from ``--start`` tokens/s, times ``--factor`` each step, until the knee: the first step
whose accepted rate is below 90% of what was offered (saying whether the client processes
or the store fell behind), or whose push-to-draftable p99 passed ``--max-p99`` seconds. The
knee is the highest accepted rate of the ramp; one more step then runs at 80% of it, once the
clients have pushed what the overloaded step left buffered and a step's time at that rate has
passed unmeasured (else it measures the recovery). Beside
it, the service-level knee: the highest accepted rate of a step whose push-to-draftable p50 and
p99 are within ``--slo-p50`` and ``--slo-p99`` (250 ms and 1 s by default).

Per step: offered, fed (accepted into the drafters) and accepted tokens/s (acknowledged by
the store, counts and history both: the lower of the two), counts rows/s and history
records/s acknowledged, CPU per component (the Redis masters, the replicas, the client
processes: CPU seconds per second from /proc/<pid>/stat, so per-core figures hold on a
shared machine; in brackets the CPUs the machine's other work used meanwhile, from /proc/stat), push-to-draftable p50/p99 (a marker sequence accepted by a client on the
first replica, timed until a client on the last replica drafts it, checked every
millisecond; both sequences share a group, as siblings do; about 200 tokens/s of its own),
the part of it after the store (the reading client's lag from the store's time of its last
1,000 records to its drafter),
pushes shed, rows and history tokens dropped, failed drafts, Redis `used_memory` summed over
the masters, MB/s pushed, history tokens pulled by all the clients (the mirrors' fan-out) and
MB/s pulled per client. After the ramp every client closes (flushing) and the store's total
count is compared with what the clients got acknowledged (``store == acked``).

``--setups`` runs a ramp per MASTERSxREPLICASxCLIENTS (default: the base 3x2x64, one master
more, one replica more, 16 and 192 clients). On a machine with fewer cores than processes the
knee in tokens/s cannot rise with more processes, so the check is per core: per setup,
tokens/s per busy core of each component, how evenly the masters and the replicas share the
load, and the knee each component allows on a core per unit: measured (accepted / the
busiest unit's CPUs) and projected from the costs (the busiest unit's idle CPUs plus its share
of the marginal CPU per accepted token reaching one core). The cost table gives, per setup,
the idle CPUs per client and the marginal microseconds per accepted token of each component.

    nice flock /tmp/ngc-heavy.lock python tests/bench/bench_fleet_load.py             # about 11 min
    python tests/bench/bench_fleet_load.py --setups 3x2x64 --reps 3                   # the base, 3 ramps
    python tests/bench/bench_fleet_load.py --setups 3x2x64 --serve-args='--mirror-interval 1'  # a serve setting
    python tests/bench/bench_fleet_load.py --quick     # checks the script (< 60 s; figures meaningless)
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the bench library (and, through it, the helpers)
from bench.lib.fleet_load_runner import Fleet, Point


def knee_reached(points: list[Point], max_p99: float) -> str | None:
    p = points[-1]
    if p.accepted < 0.9 * p.offered:
        where = ("the client processes fell behind: fed " + f"{p.fed:,.0f}" if p.fed < 0.9 * p.offered
                 else "the store fell behind the fed tokens")
        return f"accepted {p.accepted:,.0f} < 90% of offered {p.offered:,.0f}; {where}"
    if len(points) > 1 and p.accepted < 0.95 * p.offered and p.accepted < 1.05 * points[-2].accepted:
        return f"accepted rose {100 * (p.accepted / points[-2].accepted - 1):.1f}% (< 5%) and fell behind the offer"
    if p.p99 > max_p99:
        return f"push-to-draftable p99 {p.p99:.2f} s > {max_p99:g} s"
    return None


def slo_knee(points: list[Point], p50: float, p99: float) -> Point | None:
    """The service-level knee: of the steps whose push-to-draftable p50 and p99 are within ``p50`` and ``p99``
    seconds, the one with the highest accepted rate (None: no step met both)."""
    met = [p for p in points if p.lags and p.p50 <= p50 and p.p99 <= p99]
    return max(met, key=lambda p: p.accepted) if met else None


def fmt_point(p: Point) -> str:
    cpu = " ".join(f"{p.cpu[k]:.2f}" for k in ("masters", "replicas", "clients")) + f" ({p.cpu_others:.2f})"
    store_lag = " / ".join("-" if x != x else f"{x:.0f}" for x in p.store_lag_ms)  # nan: not read (no load)
    return (f"| {p.offered:,.0f} | {p.fed:,.0f} | {p.accepted:,.0f} | {p.counts_rows:,.0f} | {p.history_records:,.0f} | "
            f"{cpu} | {1e3 * p.p50:.0f} / {1e3 * p.p99:.0f} ({len(p.lags)}) | {store_lag} | {p.shed:.0f} / "
            f"{p.dropped_rows:.0f} / "
            f"{p.dropped_history:.0f} | {p.failures} | {p.redis_mb:.1f} | {p.pushed_mb:.2f} | {p.pulled_tokens:,.0f} | "
            f"{p.pulled_mb_per_client:.2f} |")


HEADER = ("| offered tok/s | fed tok/s | accepted tok/s | counts rows/s | history rec/s | CPUs masters replicas clients "
          "(other work) | "
          "push->draftable p50 / p99 ms (n) | of which store->B p50 / p99 ms | shed / dropped rows / dropped hist tok | failed drafts | Redis MB | "
          "MB/s pushed | history tok/s pulled (all clients) | MB/s pulled per client |\n|" + "---:|" * 14)


@dataclass
class Ramp:
    setup: str
    masters: int
    replicas: int
    clients: int
    idle: Point  # no load offered: the clients' polling and the marker alone
    points: list[Point]  # the ramp's steps, up to the knee
    knee: Point
    at80: Point
    store_total: int
    acked_total: int
    final: dict[str, float]
    why: str


def ramp(tmp: Path, masters: int, replicas: int, clients: int, args: argparse.Namespace) -> Ramp:
    setup = f"{masters}x{replicas}x{clients}"
    procs = -(-clients // args.per_proc)
    t = time.monotonic()
    fleet = Fleet(tmp, masters, replicas, clients, procs, args.fsync, args.marker_timeout, args.workers,
                  args.marker_pause, args.client_nice, shlex.split(args.serve_args))
    try:
        print(f"\nsetup {setup}: {masters} masters, {replicas} replicas, {clients} clients in {procs} processes; "
              f"started in {time.monotonic() - t:.0f} s{'; replicas: serve ' + args.serve_args if args.serve_args else ''}",
              flush=True)
        print(HEADER, flush=True)
        idle = fleet.step(0.0, args.step_seconds)
        print(fmt_point(idle), flush=True)
        points: list[Point] = []
        rate, why = args.start, "not reached"
        for _ in range(args.max_steps):
            points.append(fleet.step(rate, args.step_seconds))
            print(fmt_point(points[-1]), flush=True)
            reason = knee_reached(points, args.max_p99)
            if reason:
                why = reason
                break
            rate *= args.factor
        knee = max(points, key=lambda p: p.accepted)
        # The step past the knee left a backlog (buffered pushes, a tail behind): drained first, then a whole step's
        # time at the new rate unmeasured, so the 80% step measures 80% of the knee, not the recovery from the overload.
        drained = fleet.drain(60)
        at80 = fleet.step(0.8 * knee.accepted, args.step_seconds, warmup=args.step_seconds)
        print(f"knee ({why}): {knee.accepted:,.0f} tokens/s accepted at {knee.offered:,.0f} offered; at 80% of it "
              f"(after {drained:.0f} s without load, the backlog drained, and {args.step_seconds:g} s at that rate "
              f"before it is measured):", flush=True)
        print(fmt_point(at80), flush=True)
        total, acked, final = fleet.finish()
    finally:
        fleet.close()
    print(f"  store {total:,}, acked {acked:,}, unconfirmed {final['unconfirmed_count']:,.0f} (counts): nothing "
          f"acknowledged lost: {held(total, acked, final)}; shed {final['overloaded']:.0f}, dropped rows "
          f"{final['dropped_rows']:.0f}, dropped history tokens {final['history_dropped_tokens']:.0f}, unconfirmed rows "
          f"{final['unconfirmed_rows']:.0f}, failed drafts {final['failures']:.0f}", flush=True)
    return Ramp(setup, masters, replicas, clients, idle, points, knee, at80, total, acked, final, why)


COMPONENTS = ("masters", "replicas", "clients")


def held(total: int, acked: int, final: dict[str, float]) -> bool:
    """The store holds every acknowledged count, and no more than the pushes whose answer never came (unconfirmed:
    applied or not) add; exactly the acknowledged ones when none is unconfirmed."""
    return acked <= total <= acked + final["unconfirmed_count"]


def top(r: Ramp) -> list[Point]:
    """The knee and the two steps before it: where per-core figures are read (fixed costs matter least)."""
    i = r.points.index(r.knee)
    return r.points[max(0, i - 2):i + 1]


def spread(values: list[float]) -> float:
    """Largest distance from the mean, as a fraction of the mean."""
    mean = statistics.mean(values)
    return max(abs(v - mean) for v in values) / max(mean, 1e-9)


def marginal(r: Ramp) -> dict[str, float]:
    """Per component, CPU microseconds per accepted token above the idle fleet's: the median over the knee and the two
    steps before it of (CPUs - CPUs idle) / accepted tokens/s."""
    return {k: 1e6 * statistics.median((p.cpu[k] - r.idle.cpu[k]) / max(p.accepted, 1.0) for p in top(r))
            for k in COMPONENTS}


def projected(r: Ramp, k: str) -> float:
    """Tokens/s at which the busiest unit of component ``k`` (masters, replicas), a core each, reaches one core: its idle
    CPUs plus its share (as measured near the knee) of the marginal cost per token."""
    units = r.idle.cpu_units[k]
    share = statistics.median(max(p.cpu_units[k]) / max(sum(p.cpu_units[k]), 1e-9) for p in top(r))
    cost = max(marginal(r)[k], 0.01) / 1e6  # CPU s per token, all units
    return (1.0 - max(units)) / (cost * share)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="3x2x16,3x2x64,4x2x64,3x3x64,3x2x192",
                    help="MASTERSxREPLICASxCLIENTS,... (default 3x2x16,3x2x64,4x2x64,3x3x64,3x2x192)")
    ap.add_argument("--per-proc", type=int, default=16, help="clients a client process runs (default 16)")
    ap.add_argument("--start", type=float, default=2000, help="first offered load, tokens/s (default 2000)")
    ap.add_argument("--factor", type=float, default=1.4, help="the load grows by this each step (default 1.4)")
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--step-seconds", type=float, default=10.0, help="measured seconds a step (plus a quarter warm-up)")
    ap.add_argument("--max-p99", type=float, default=5.0, help="push-to-draftable p99 past this (s) is the knee")
    ap.add_argument("--slo-p50", type=float, default=0.25, help="the service-level knee's push-to-draftable p50 (s)")
    ap.add_argument("--slo-p99", type=float, default=1.0, help="the service-level knee's push-to-draftable p99 (s)")
    ap.add_argument("--marker-timeout", type=float, default=10.0, help="a marker not draftable by then counts as inf")
    ap.add_argument("--marker-pause", type=float, default=0.5,
                    help="seconds between two marker trials (default 0.5: 9-13 markers a 10 s step; less times more "
                         "of them, each about 100 tokens the load does not count)")
    ap.add_argument("--fsync", choices=("always", "everysec", "no"), default="everysec")
    ap.add_argument("--workers", type=int, default=1,
                    help="server processes per replica (serve --workers N; their CPU counts as the replica's; default 1)")
    ap.add_argument("--client-nice", type=int, default=10,
                    help="niceness added to the client processes (default 10; 0: none). The clients stand in for "
                         "engine hosts, which do not share cores with the service and Redis; on one machine they "
                         "would, so they get the CPU the service leaves. The marker's two clients are not niced")
    ap.add_argument("--serve-args", default="",
                    help="more `ngramcache serve` options for every replica, one string with '=' (such as "
                         "--serve-args='--mirror-interval 1'): compares a replica setting against the default")
    ap.add_argument("--reps", type=int, default=1, help="ramps per setup; knees and per-core figures are medians")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in < 60 s: setup 3x2x16, 2 steps of 2 s (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.setups, args.max_steps, args.step_seconds, args.reps = "3x2x16", 2, 2.0, 1
    try:
        setups = [tuple(int(x) for x in s.split("x")) for s in args.setups.split(",")]
        assert all(len(s) == 3 and min(s) >= 1 for s in setups)
    except (ValueError, AssertionError):
        ap.error(f"--setups takes MASTERSxREPLICASxCLIENTS,... (such as 3x2x64), got {args.setups!r}")
    if not 0 <= args.client_nice <= 19:
        ap.error(f"--client-nice takes 0..19 (10 by default), got {args.client_nice}")
    try:
        shlex.split(args.serve_args)
    except ValueError as e:
        ap.error(f"--serve-args: {e} in {args.serve_args!r}")
    if not 0.01 <= args.marker_pause <= 60:
        ap.error(f"--marker-pause takes seconds in 0.01..60 (0.5 by default), got {args.marker_pause}")
    cores = os.cpu_count() or 1
    results: dict[str, list[Ramp]] = {}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ngc-bench-fleet-load-") as tmp:
        for rep in range(args.reps):
            for masters, replicas, clients in setups:
                try:
                    r = ramp(Path(tmp) / f"{masters}x{replicas}x{clients}-{rep}", masters, replicas, clients, args)
                except RuntimeError as e:  # a replica that did not start (such as a bad --serve-args): its log
                    print(f"bench_fleet_load.py: error: {e}", file=sys.stderr)
                    return 1
                except KeyboardInterrupt:  # Ctrl-C: ramp's finally stopped the fleet; the folder goes with tmp
                    print("bench_fleet_load.py: interrupted; the Redis Cluster, replicas and clients it started are "
                          "stopped", file=sys.stderr)
                    return 130
                results.setdefault(r.setup, []).append(r)

    print(f"\n## Knees and per-core figures (medians of {args.reps} ramp(s); per-core figures over the knee and the two "
          f"steps before it; {cores} CPUs on this machine; fsync {args.fsync})\n")
    print("| setup (masters x replicas x clients) | knee tok/s accepted | CPUs at the knee: masters / replicas / clients | "
          "tok/s per busy core: masters / replicas / clients | spread of masters / replicas | "
          "knee on a core each, measured (busiest unit at one core): by masters / by replicas | "
          "projected from idle + marginal costs: by masters / by replicas |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for setup, rs in results.items():
        knee = statistics.median(r.knee.accepted for r in rs)
        cpus = {k: statistics.median(r.knee.cpu[k] for r in rs) for k in COMPONENTS}
        core = {k: statistics.median(statistics.median(p.accepted / max(p.cpu[k], 1e-3) for p in top(r)) for r in rs)
                for k in COMPONENTS}
        m_spread = statistics.median(spread(p.cpu_units["masters"]) for r in rs for p in top(r))
        r_spread = statistics.median(spread(p.cpu_units["replicas"]) for r in rs for p in top(r))
        # With a core each, a component tops out when its busiest unit reaches one core. Measured: accepted / (the
        # busiest unit's CPUs), fixed costs included. Projected: the busiest unit's idle CPUs plus its share of the
        # marginal cost reach one core, (1 - idle of the busiest unit) / (marginal CPU s a token x its share).
        by = {k: statistics.median(statistics.median(p.accepted / max(max(p.cpu_units[k]), 1e-3) for p in top(r))
                                   for r in rs) for k in ("masters", "replicas")}
        proj = {k: statistics.median(projected(r, k) for r in rs) for k in ("masters", "replicas")}
        print(f"| {setup} | {knee:,.0f} | {cpus['masters']:.2f} / {cpus['replicas']:.2f} / {cpus['clients']:.2f} | "
              f"{core['masters']:,.0f} / {core['replicas']:,.0f} / {core['clients']:,.0f} | "
              f"±{100 * m_spread:.0f}% / ±{100 * r_spread:.0f}% | {by['masters']:,.0f} / {by['replicas']:,.0f} | "
              f"{proj['masters']:,.0f} / {proj['replicas']:,.0f} |")
    print()
    for setup, rs in results.items():
        for r in rs:
            at = r.at80
            print(f"{setup} at 80% of the knee ({at.offered:,.0f} tok/s): push->draftable p50 {1e3 * at.p50:.0f} ms, "
                  f"p99 {1e3 * at.p99:.0f} ms ({len(at.lags)} markers), failed drafts {at.failures}, shed {at.shed:.0f}, "
                  f"dropped rows {at.dropped_rows:.0f}; nothing acknowledged lost: {held(r.store_total, r.acked_total, r.final)}")
            ok = ok and held(r.store_total, r.acked_total, r.final)
    print(f"\nService-level knee: the highest accepted rate of a step (the 80% step included) whose push->draftable "
          f"p50 <= {1e3 * args.slo_p50:.0f} ms and p99 <= {1e3 * args.slo_p99:.0f} ms (the throughput knee above is "
          f"where the accepted rate falls behind the offer or p99 passes {args.max_p99:g} s):")
    for setup, rs in results.items():
        for r in rs:
            slo = slo_knee([*r.points, r.at80], args.slo_p50, args.slo_p99)
            if slo is None:
                print(f"{setup}: no step met both (knee {r.knee.accepted:,.0f} tok/s)")
            else:
                print(f"{setup}: {slo.accepted:,.0f} tok/s accepted at {slo.offered:,.0f} offered, push->draftable p50 "
                      f"{1e3 * slo.p50:.0f} ms, p99 {1e3 * slo.p99:.0f} ms ({100 * slo.accepted / r.knee.accepted:.0f}% of "
                      f"the knee, {r.knee.accepted:,.0f} tok/s)")
    print("\nCPU cost model (medians over the ramps of a setup): idle, the fleet's polling with no load (% of a core per "
          "client); marginal, CPU per accepted token above idle, over the knee and the two steps before it (us); the "
          "history tokens the clients pulled per accepted token (the mirrors' fan-out):")
    print("| setup | idle % of a core per client: masters / replicas / clients | marginal us per accepted token: masters / "
          "replicas / clients | pulled per accepted token |")
    print("|---|---:|---:|---:|")
    for setup, rs in results.items():
        idle = {k: statistics.median(100 * r.idle.cpu[k] / r.clients for r in rs) for k in COMPONENTS}
        cost = {k: statistics.median(marginal(r)[k] for r in rs) for k in COMPONENTS}
        fan = statistics.median(statistics.median(p.pulled_tokens / max(p.accepted, 1.0) for p in top(r)) for r in rs)
        print(f"| {setup} | {idle['masters']:.3f} / {idle['replicas']:.3f} / {idle['clients']:.3f} | "
              f"{cost['masters']:.1f} / {cost['replicas']:.1f} / {cost['clients']:.1f} | {fan:.1f} |")
    print(f"\nchecksum: nothing acknowledged lost (acked <= store <= acked + unconfirmed) in "
          f"{sum(held(r.store_total, r.acked_total, r.final) for rs in results.values() for r in rs)}/"
          f"{sum(len(rs) for rs in results.values())} ramps; total {time.monotonic() - t_all:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
