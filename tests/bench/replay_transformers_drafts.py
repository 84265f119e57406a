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

    python tests/bench/bench_transformers_device.py --device cpu --setups plain,pld32 --out /tmp/r
    python tests/bench/replay_transformers_drafts.py /tmp/r/results.json
    python tests/bench/replay_transformers_drafts.py /tmp/r/results.json --setups pld32,auto-gpu-costs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ngramcache import UNTAGGED, CountTable, Drafter

GPU_COSTS = [1.0] + [1.12] * 64  # an H200's c(0..64) (issue 30): what "auto" drafts on such a GPU
SETUPS: dict[str, dict[str, Any]] = {
    "pld10": {"pld": 10}, "pld16": {"pld": 16}, "pld32": {"pld": 32},
    "match-8": {"n_draft": 8}, "match-16": {"n_draft": 16},
    "auto-gpu-costs": {"n_draft": "auto", "verify_cost": GPU_COSTS},
}
SEQ = 1


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def replay_pld(prompt: list[int], out: list[int], k: int) -> int:
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
        done += kept + 1
        forwards += 1
    return forwards


def replay_ngram(drafter: Drafter, prompt: list[int], out: list[int], setup: dict[str, Any]) -> int:
    """Forward passes of the adapter's drafts producing `out` (the drafter then merges the
    request's context into its dynamic table, as the device bench does)."""
    import torch

    from ngramcache.client.adapters import transformers as adapter
    from ngramcache.client.adapters.draft_length import VerifyCost

    cost = VerifyCost(setup["verify_cost"], 64) if "verify_cost" in setup else None
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
    for name in chosen:
        s = SETUPS[name]
        if "pld" in s:
            forwards = sum(replay_pld(p, o, s["pld"]) for p, o in zip(prompts, outputs))
        else:
            drafter = Drafter(dynamic=CountTable(), vocab_size=max(vocab, 49_152), fingerprint=UNTAGGED, mode="match",
                              **({"match_params": params} if params else {}))
            forwards = sum(replay_ngram(drafter, p, o, s) for p, o in zip(prompts, outputs))
        rows[name] = tokens / forwards
        print(f"{name:>16}: {tokens / forwards:.3f} tokens/forward ({forwards} forwards, {tokens} tokens)", flush=True)
    pld = [s for s in rows if s.startswith("pld")]
    if pld:
        best = max(pld, key=lambda s: rows[s])
        for s in rows:
            if not s.startswith("pld"):
                print(f"{s} / {best}: {rows[s] / rows[best]:.3f}x")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
