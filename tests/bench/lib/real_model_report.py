"""bench_real_model.py's report of one engine's run: per setup, tokens/s, forward passes, drafts and outputs against
plain greedy (a); the ratios to (b), match against compatible mode, cost-aware against fixed drafts; and the fleet
effect on worker B."""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.lib.real_model_engines import COST_AWARE, LlamaCppEngine, Run, TransformersEngine
from bench.lib.real_model_setups import MATCH, SOLO
from bench.lib.real_model_workload import Request


@dataclass
class Summary:
    """A setup's runs added up: new tokens, seconds, forward passes, drafted tokens, drafts; the median tokens/s."""

    tokens: int
    seconds: float
    forwards: int
    drafted: int
    drafts: int
    median_tps: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accepted(self) -> int:
        return self.tokens - self.forwards


def summarize(runs: list[Run]) -> Summary:
    return Summary(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs), sum(r.forwards for r in runs),
                   sum(r.drafted for r in runs), sum(r.drafts for r in runs),
                   statistics.median(len(r.tokens) / r.seconds for r in runs))


def same_tokens(runs: list[Run], ref: list[Run]) -> int:
    """How many of `runs` output token for token what the run of `ref` at the same place did."""
    return sum(r.tokens == q.tokens for r, q in zip(runs, ref))


def common_prefix(x: list[int], y: list[int]) -> int:
    """The length of the longest common prefix of `x` and `y`."""
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def report(engine: Any, result: dict[str, Any], reqs_a: list[Request], reqs_b: list[Request],
           setups: tuple[str, ...]) -> dict[str, Any]:
    """Prints the report of `run_engine`'s `result`; returns the figures the targets are read from (sums, ratios
    to (b), match, fleet and cost-aware ratios, outputs the same as (a))."""
    runs = result["runs"]
    ref = runs["a"]
    n = len(ref)
    sums = {s: summarize(runs[s]) for s in setups}
    print(f"\n## {engine.title}: {n} requests (A {len(reqs_a)}, B {len(reqs_b)}), "
          f"up to {engine.args.max_new_tokens} new tokens, greedy; {result['seconds']:.0f} s for all setups")
    print(result["cpu"])
    head = (f"{'setup':<38}{'tokens':>7}{'seconds':>9}{'tok/s':>8}{'median':>8}{'vs (a)':>8}{'vs (b)':>8}"
            f"{'passes/tok':>11}{'tok/pass':>9}{'drafted/pass':>13}{'ms/pass':>8}{'acc/draft':>10}{'acc %':>7}"
            f"{'same as (a)':>13}")
    print(head)
    for s in setups:
        m = sums[s]
        acc = f"{m.accepted / m.drafts:.2f}" if m.drafts else "-"
        pct = f"{100 * m.accepted / m.drafted:.0f}" if m.drafted else "-"
        vs_b = f"{m.tps / sums['b'].tps:>7.2f}x" if "b" in sums else f"{'-':>8}"
        print(f"{engine.labels[s]:<38}{m.tokens:>7,}{m.seconds:>9.1f}{m.tps:>8.1f}{m.median_tps:>8.1f}"
              f"{m.tps / sums['a'].tps:>7.2f}x{vs_b}{m.forwards / m.tokens:>11.3f}"
              f"{m.tokens / m.forwards:>9.2f}{m.drafted / m.forwards:>13.2f}{1e3 * m.seconds / m.forwards:>8.1f}"
              f"{acc:>10}{pct:>7}{f'{same_tokens(runs[s], ref)}/{n}':>13}")
    hit = sum(len(r.tokens) >= engine.args.max_new_tokens for r in ref)
    checksum = hashlib.blake2b(b"".join(np.asarray(r.tokens, dtype=np.int32).tobytes() for r in ref), digest_size=8)
    print(f"(a) outputs: {hit} of {n} reach the {engine.args.max_new_tokens}-token limit, the others end with EOS; "
          f"checksum {checksum.hexdigest()}")

    def speed(s: str, base: str) -> tuple[float, float]:
        """tokens/s of `s` over that of `base`: over the run, and the median over requests (the time ratio
        wherever both outputs have the same length)."""
        per = [(len(x.tokens) / x.seconds) / (len(y.tokens) / y.seconds) for x, y in zip(runs[s], runs[base])]
        return sums[s].tps / sums[base].tps, statistics.median(per)

    ratios = {s: speed(s, "b") for s in setups if s not in ("a", "b") and "b" in setups}
    if ratios:
        print("vs (b), tokens/s: " + "; ".join(f"({s}) {t:.2f}x over the run, median per request {m:.2f}x"
                                                 for s, (t, m) in ratios.items()))
    # The match mode against the compatible mode: (e) vs (c), (f) vs (d).
    match = {}
    for s, base in MATCH.items():
        if s in setups and base in setups:
            t, med = speed(s, base)
            pt, pt_base = sums[s].forwards / sums[s].tokens, sums[base].forwards / sums[base].tokens
            match[s] = (t, med, pt / pt_base)
    if match:
        print("match vs compatible mode: " + "; ".join(
            f"({s}) vs ({MATCH[s]}) tokens/s {t:.2f}x over the run, median per request {med:.2f}x; passes/token "
            f"{sums[MATCH[s]].forwards / sums[MATCH[s]].tokens:.3f} -> {sums[s].forwards / sums[s].tokens:.3f} ({p:.2f}x)"
            for s, (t, med, p) in match.items()))
    cost = {}
    for s, base in COST_AWARE.items():
        if s in setups and base in setups:
            t, med = speed(s, base)
            cost[s] = (t, med)
    if engine.verify_cost is not None:
        print(f"verify costs c(k), k = 0..8, measured: {', '.join(f'{c:.2f}' for c in engine.verify_cost.costs[:9])}")
    if cost:
        print("cost-aware vs fixed drafts: " + "; ".join(
            f"({s}) vs ({COST_AWARE[s]}) tokens/s {t:.2f}x over the run, median per request {med:.2f}x; passes/token "
            f"{sums[COST_AWARE[s]].forwards / sums[COST_AWARE[s]].tokens:.3f} -> {sums[s].forwards / sums[s].tokens:.3f}"
            for s, (t, med) in cost.items()))
    if isinstance(engine, TransformersEngine) and engine.stats_mismatch:
        print(f"note: the adapter's DraftStats disagree with the counted forward passes in {engine.stats_mismatch} generations")
    if isinstance(engine, LlamaCppEngine):
        for s in setups[1:]:
            diverged = [common_prefix(r.tokens, q.tokens) for r, q in zip(runs[s], ref) if r.tokens != q.tokens]
            if diverged:
                print(f"  ({s}) differs from (a) in {len(diverged)} of {n} outputs, first at new token "
                      f"{statistics.median(diverged):.0f} (median; min {min(diverged)}, max {max(diverged)})")

    fleet = {}
    if "d" in result["visible"]:
        # The fleet effect: B with and without A's counts (the same static generation in both).
        v = result["visible"]["d"]
        nb = len(reqs_b)
        with_a, alone = runs["d"][-nb:], runs[SOLO]
        groups = [("on A's functions", [i for i, r in enumerate(reqs_b) if r.overlap]),
                  ("on its own files", [i for i, r in enumerate(reqs_b) if not r.overlap]),
                  ("all", list(range(nb)))]
        print(f"fleet (d): A pushed {v['acked_rows']:,} rows ({v['acked_count']:,} counts), all acknowledged; "
              f"B started once all {v['probed']} 4-grams A's last request counted twice were in its mirror "
              f"({v['waited']:.2f} s; {v['mirror_rows']:,} rows mirrored, against {v['alone_rows']:,} in a fresh namespace; "
              f"static generation {v['generation'][0]} in both)")
        for label, idx in groups:
            if not idx:
                continue
            w = summarize([with_a[i] for i in idx])
            o = summarize([alone[i] for i in idx])
            ratio = (w.tokens / w.forwards) / (o.tokens / o.forwards)
            same = same_tokens([with_a[i] for i in idx], [alone[i] for i in idx])
            differ = "" if same == len(idx) else f"; the two runs' outputs are identical in {same} of {len(idx)}"
            fleet[label] = ratio
            print(f"  B {label} ({len(idx)} requests): tokens per forward pass {o.tokens / o.forwards:.2f} alone -> "
                  f"{w.tokens / w.forwards:.2f} with A's counts ({ratio:.2f}x; passes per token {o.forwards / o.tokens:.3f} "
                  f"-> {w.forwards / w.tokens:.3f}); tokens/s {o.tps:.1f} -> {w.tps:.1f}{differ}")
    if "f" in result["visible"]:
        v = result["visible"]["f"]
        print(f"fleet (f): A pushed {v['acked_rows']:,} rows ({v['acked_count']:,} counts), all acknowledged; "
              f"B started once all {v['probed']} 4-grams A's last request counted twice were in its mirror "
              f"({v['waited']:.2f} s; {v['mirror_rows']:,} rows mirrored; static generation {v['generation']})")
    return {"sums": sums, "ratios": ratios, "match": match, "fleet": fleet, "cost": cost,
            "same": {s: same_tokens(runs[s], ref) for s in setups}, "n": n}
