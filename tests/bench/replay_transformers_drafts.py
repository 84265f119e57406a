"""Tokens per forward pass of transformers' prompt lookup and of ngramcache's adapter, replayed offline against recorded greedy outputs.

Under greedy decoding the output does not depend on the drafts, so the forward passes a drafting
setup needs follow from the output alone: each step drafts from the sequence so far, keeps the
longest prefix of the draft that the output continues with, and adds one token of the model's.
This replays that loop without the model, with the real candidate generators (transformers'
``PromptLookupCandidateGenerator`` and the adapter's ``NgramCandidateGenerator``, the latter fed
the same sequences, in the same order, as in ``model.generate``), so a drafting change can be
judged on the whole workload in seconds instead of an hour of CPU generation.

The input is the results.json that ``bench_transformers_device.py --out DIR`` writes (it holds
each request's prompt and plain greedy's output). The replay counts one forward pass a step as
transformers' assisted decoding does (its first step is the prefill with the first draft). Its
figures match the model's own counts to within a step or two per request; the model run stays the
reference for published tables.

Every setup is also timed by a simulated machine (``--machine``: c(k) = 1 + slope x k, a CPU's or a
GPU's, idle or loaded with bursts and jitter; see MACHINES), and ``auto-learned`` learns its costs
from those times, as the adapters' default does from the engine's steps when no costs are given:
tokens per plain step of time then compare "auto" with the fixed length it replaced (match-8),
noise included, in seconds.

    python tests/bench/bench_transformers_device.py --device cpu --setups plain,pld32 --out /tmp/r
    python tests/bench/replay_transformers_drafts.py /tmp/r/results.json
    python tests/bench/replay_transformers_drafts.py /tmp/r/results.json --setups pld32,auto-gpu-costs
    python tests/bench/replay_transformers_drafts.py /tmp/r/results.json --setups match-8,auto-learned --machine cpu-loaded
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ngramcache import UNTAGGED, CountTable, Drafter
from ngramcache.client.adapters.step_costs import StepCosts

GPU_COSTS = [1.0] + [1.12] * 64  # an H200's c(0..64): what "auto" drafts on such a GPU
# The clock of --machine: a plain step takes STEP_S, one verifying k drafted tokens STEP_S x c(k),
# c(k) = 1 + slope x k (2 CPU cores and SmolLM2: ~0.13; an H200: ~0.002); "loaded" multiplies
# each step by a load factor that jumps among 1, 1.6, 2.5 and 4 (on 8% of steps) and a
# lognormal jitter (sigma 0.3). The "auto-learned" setups learn their costs from its times, as
# "auto" does from the engine's steps when no costs are given; every setup is also costed by it.
STEP_S = 0.07
MACHINES = {"cpu": (0.13, False), "cpu-loaded": (0.13, True), "gpu": (0.002, False), "gpu-loaded": (0.002, True)}
SETUPS: dict[str, dict[str, Any]] = {
    "pld10": {"pld": 10}, "pld16": {"pld": 16}, "pld32": {"pld": 32}, "pld64": {"pld": 64},
    "match-8": {"n_draft": 8}, "match-16": {"n_draft": 16},
    "auto-gpu-costs": {"n_draft": "auto", "verify_cost": GPU_COSTS},
    "auto-learned": {"n_draft": "auto", "learned": True},
}


class StepClock:
    """A decoding loop's clock (see MACHINES), seeded: a replay gives the same steps every run.
    `cost` sums each step's c(k), the load left out: time in plain steps on an idle machine."""

    def __init__(self, slope: float, loaded: bool, seed: int = 0) -> None:
        self.slope, self.loaded = slope, loaded
        self.rng = np.random.default_rng(seed)
        self.now, self.load, self.cost = 0.0, 1.0, 0.0

    def perf_counter(self) -> float:
        return self.now

    def step(self, k: int) -> None:
        if self.loaded and self.rng.random() < 0.08:
            self.load = float(self.rng.choice([1.0, 1.6, 2.5, 4.0]))
        jitter = float(self.rng.lognormal(0.0, 0.3)) if self.loaded else 1.0
        self.now += STEP_S * (1 + self.slope * k) * self.load * jitter
        self.cost += 1 + self.slope * k

    def gap(self) -> None:
        """The prefill and what comes between two requests: not a decoding step."""
        self.now += 1.0
SEQ = 1


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def replay_pld(prompt: list[int], out: list[int], k: int, clock: StepClock) -> int:
    """Forward passes of transformers' prompt lookup (num_output_tokens k) producing `out`."""
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    max_length = len(prompt) + len(out)
    gen = PromptLookupCandidateGenerator(num_output_tokens=k, max_length=max_length)
    seq = list(prompt)
    target = np.asarray(out, dtype=np.int64)
    done, forwards = 0, 0
    while done < len(out):
        cand, _ = gen.get_candidates(torch.tensor([seq], dtype=torch.long))
        drafted = cand[0, len(seq):].numpy()
        kept = min(common_prefix(drafted, target[done:]), len(out) - done - 1)
        seq.extend(out[done: done + kept + 1])
        clock.step(len(drafted))
        done += kept + 1
        forwards += 1
    return forwards


def replay_ngram(drafter: Drafter, prompt: list[int], out: list[int], setup: dict[str, Any], clock: StepClock,
                 learned: Any = None) -> int:
    """Forward passes of the adapter's drafts producing `out` (the drafter then merges the
    request's context into its dynamic table, as the device bench does). Each step advances
    `clock` by what it verified; "auto-learned" learns into `learned` (the StepCosts that a
    model's generate() calls share) from those times."""
    import torch

    from ngramcache.client.adapters import sequence_feed
    from ngramcache.client.adapters import transformers as adapter
    from ngramcache.client.adapters.draft_length import VerifyCost

    cost = VerifyCost(setup["verify_cost"], 64) if "verify_cost" in setup else learned
    sequence_feed.time = clock  # type: ignore[assignment]  # the feed times steps with time.perf_counter()
    clock.gap()
    gen = adapter.NgramCandidateGenerator(drafter, SEQ, setup["n_draft"], verify_cost=cost)
    gen.max_length = len(prompt) + len(out)
    seq = torch.tensor([prompt], dtype=torch.long)
    target = np.asarray(out, dtype=np.int64)
    done, forwards = 0, 0
    while done < len(out):
        cand, _ = gen.get_candidates(seq)
        drafted = cand[0, seq.shape[1]:].numpy()
        kept = min(common_prefix(drafted, target[done:]), len(out) - done - 1)
        seq = torch.cat((seq, torch.tensor([out[done: done + kept + 1]], dtype=torch.long)), dim=1)
        gen.update_candidate_strategy(seq, None, kept)  # type: ignore[arg-type]
        clock.step(len(drafted))
        done += kept + 1
        forwards += 1
    rows = drafter.context_rows(SEQ)
    if len(rows):
        drafter.dynamic.add_rows(rows)
    drafter.reset(SEQ)
    return forwards


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="results.json of bench_transformers_device.py (with its outputs)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma list among {','.join(SETUPS)}")
    ap.add_argument("--machine", choices=sorted(MACHINES), default="cpu",
                    help="the step costs every setup is timed with and auto-learned learns from (default cpu; "
                         "see MACHINES)")
    ap.add_argument("--match-param", action="append", default=[], metavar="NAME=VALUE",
                    help="a match parameter of the ngramcache drafters (repeatable), e.g. max_chain=16")
    args = ap.parse_args()
    try:
        data = json.loads(args.results.read_text())
        prompts, outputs = data["outputs"]["prompts"], data["outputs"]["plain"]
    except OSError as e:
        print(f"{args.results}: {e.strerror}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError):
        print(f"{args.results}: not a results.json with the outputs (bench_transformers_device.py --out DIR writes "
              "one since it records them)", file=sys.stderr)
        return 2
    chosen = [s for s in args.setups.split(",") if s]
    if set(chosen) - set(SETUPS):
        ap.error(f"--setups: a comma list among {','.join(SETUPS)}, got {args.setups!r}")
    params: dict[str, float] = {}
    for item in args.match_param:
        name, _, value = item.partition("=")
        try:
            params[name] = float(value)
        except ValueError:
            ap.error(f"--match-param {item!r}: give NAME=NUMBER, e.g. max_chain=16")
    try:
        Drafter(vocab_size=2, fingerprint=UNTAGGED, mode="match", match_params=params or None)
    except ValueError as e:
        ap.error(f"--match-param: {e}")
    vocab = max(max(max(p) for p in prompts), max(max(o) for o in outputs if o)) + 1
    tokens = sum(len(o) for o in outputs)
    rows: dict[str, float] = {}
    per_time: dict[str, float] = {}
    slope, loaded = MACHINES[args.machine]
    for name in chosen:
        s = SETUPS[name]
        clock = StepClock(slope, loaded)
        if "pld" in s:
            forwards = sum(replay_pld(p, o, s["pld"], clock) for p, o in zip(prompts, outputs))
        else:
            drafter = Drafter(dynamic=CountTable(), vocab_size=max(vocab, 49_152), fingerprint=UNTAGGED, mode="match",
                              **({"match_params": params} if params else {}))
            learned = StepCosts() if s.get("learned") else None
            forwards = sum(replay_ngram(drafter, p, o, s, clock, learned) for p, o in zip(prompts, outputs))
            if learned is not None:
                print(f"{'':>16}  learned on a {args.machine} machine: {learned!r}")
        rows[name] = tokens / forwards
        per_time[name] = tokens / clock.cost
        print(f"{name:>16}: {tokens / forwards:.3f} tokens/forward ({forwards} forwards, {tokens} tokens); "
              f"{tokens / clock.cost:.3f} tokens per plain step of time on a {args.machine} machine", flush=True)
    pld = [s for s in rows if s.startswith("pld")]
    if pld:
        best = max(pld, key=lambda s: rows[s])
        for s in rows:
            if not s.startswith("pld"):
                print(f"{s} / {best}: {rows[s] / rows[best]:.3f}x")
    if "match-8" in per_time:  # the fixed length "auto" replaced, on the same machine's time
        for s in per_time:
            if s != "match-8":
                print(f"{s} / match-8, tokens per time on a {args.machine} machine: {per_time[s] / per_time['match-8']:.3f}x")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
