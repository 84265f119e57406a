"""How many engine steps any context drafter could save on bench_vllm's code edits: a replay.

vLLM's greedy outputs do not depend on the drafter, so a request's engine steps with a drafter
follow from the plain output alone: each step accepts the longest prefix of the draft that the
output continues with, plus one token. This script runs plain decoding once in a real vLLM
(tests/bench/lib/vllm_replica.py, as bench_vllm.py does), then replays the outputs offline in the
vLLM Python with:

- ``ngram``: vLLM's own prompt-lookup function (``prompt_lookup_min`` 1, ``_max`` 4);
- ``ngc``, ``ngc-compatible``: ngramcache's Drafter as the vLLM proposer runs it by default
  (the match mode, each copy run to the width) and in the compatible mode;
- ``oracle``: at each step the best of nine context drafters (vLLM's lookup with n 1..4 and
  with n fixed at 2, 3, 4, 5, 6 and 8, and both ngramcache modes), i.e. a bound on what choosing
  among them could reach without outside knowledge (a corpus, the fleet's history).

The replayed steps of ``ngram``, ``ngc`` and ``ngc-compatible`` equal those bench_vllm.py measures
in the engine (same requests, same k); the oracle says how far below vLLM's ``ngram`` a drafter
that reads only the request can go on these requests.

    python tests/bench/replay_vllm_drafts.py                 # 8 edit requests of 128 tokens, k 8 and 16
    python tests/bench/replay_vllm_drafts.py --quick         # 2 requests of 24 tokens, k 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

# (prompt_lookup_min, prompt_lookup_max) of the vLLM lookups the oracle chooses among.
ORACLE_LOOKUPS = ((1, 4), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (8, 8))


def steps_of(propose: Callable[[Any], list[list[int]]], prompt: list[int], output: list[int]) -> int:
    """Engine steps to produce `output` after `prompt` when each step verifies the best of `propose`'s drafts."""
    import numpy as np

    from bench.lib.real_model_report import common_prefix

    full = np.asarray(prompt + output, dtype=np.int32)
    pos, steps = len(prompt) + 1, 1  # the prefill samples the first token
    while pos < len(full):
        truth = full[pos:].tolist()
        pos += max(common_prefix(d, truth) for d in propose(full[:pos])) + 1
        steps += 1
    return steps


def replay(plain: dict[str, Any], ks: list[int]) -> dict[str, dict[str, list[int]]]:
    """Steps per request of each drafter at each k, from the plain outputs (runs in the vLLM Python)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as lookup

    from ngramcache import UNTAGGED, Drafter

    out: dict[str, dict[str, list[int]]] = {}
    for k in ks:
        steps: dict[str, list[int]] = {}
        for name in ("ngram", "ngc", "ngc-compatible", "oracle"):
            # Each drafter as one proposer holds it: one for all requests, in order (an ended
            # request stays in the match mode's history, as in the engine).
            match = Drafter(fingerprint=UNTAGGED, vocab_size=plain["vocab_size"], mode="match")
            compatible = Drafter(fingerprint=UNTAGGED, vocab_size=plain["vocab_size"], mode="compatible")

            def vllm_lookup(prefix: Any, lo: int, hi: int, k: int = k) -> list[int]:
                return [int(t) for t in lookup(prefix, lo, hi, 1 << 20, k)]

            def ngc(drafter: Drafter, seq: int, prefix: Any, k: int = k) -> list[int]:
                drafter.accept(seq, prefix)
                drafts, lengths = drafter.draft_batch([seq], [prefix], k, uncapped=drafter.mode == "match")
                return [int(t) for t in drafts[0, : int(lengths[0])]]

            steps[name] = []
            for seq, (prompt, output) in enumerate(zip(plain["prompts"], plain["outputs"], strict=True)):
                proposers: dict[str, Callable[[Any], list[list[int]]]] = {
                    "ngram": lambda p: [vllm_lookup(p, 1, 4)],
                    "ngc": lambda p, d=match, s=seq: [ngc(d, s, p)],
                    "ngc-compatible": lambda p, d=compatible, s=seq: [ngc(d, s, p)],
                    "oracle": lambda p, m=match, c=compatible, s=seq: [vllm_lookup(p, lo, hi) for lo, hi in ORACLE_LOOKUPS]
                    + [ngc(m, s, p), ngc(c, s, p)],
                }
                steps[name].append(steps_of(proposers[name], prompt, output))
                match.reset(seq)
                compatible.reset(seq)
        out[str(k)] = steps
    return out


def run_plain(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from helpers.model import vllm_model_folder

    from bench.bench_vllm import VLLM_PYTHON, make_workloads, run_replica
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    model = vllm_model_folder()
    tokenizer = load_tokenizer(str(model))
    workload = make_workloads(tokenizer, args.requests, args.max_new_tokens, args.seed, ["edits"])[0]
    print(f"plain decoding of {len(workload.a)} edit requests in vLLM...", flush=True)
    result = run_replica(VLLM_PYTHON, {"model": str(model), "speculative_config": None, "requests": workload.a},
                         work, {}, "plain")
    return {"prompts": [r["prompt_ids"] for r in workload.a],
            "outputs": [r["output_ids"] for r in result["requests"]],
            "measured_plain_steps": [r["steps"] for r in result["requests"]],
            "vocab_size": tokenizer.vocab_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the drafters replayed.")
    ap.add_argument("--quick", action="store_true", help="2 requests of 24 tokens, k 8: checks the script")
    ap.add_argument("--requests", type=int, default=8, help="edit requests (default 8, as bench_vllm.py)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7, help="the workload's seed (default 7, as bench_vllm.py)")
    ap.add_argument("--k", default="8,16", help="num_speculative_tokens values, comma-separated (default 8,16)")
    ap.add_argument("--replay", metavar="PLAIN_JSON", help=argparse.SUPPRESS)  # the child's part, in the vLLM Python
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_new_tokens, args.k = 2, 24, "8"
    try:
        ks = [int(x) for x in args.k.split(",")]
    except ValueError:
        ap.error(f"--k takes whole numbers separated by commas, not {args.k!r}")
    if args.requests < 1 or args.max_new_tokens < 1 or any(k < 1 or k > 64 for k in ks):
        ap.error("--requests and --max-new-tokens must be >= 1, each --k 1..64")

    if args.replay:
        print(json.dumps(replay(json.loads(Path(args.replay).read_text()), ks)))
        return 0

    import subprocess

    from bench.bench_vllm import VLLM_PYTHON

    if not VLLM_PYTHON.is_file():
        print(f"error: {VLLM_PYTHON} is missing: run python tests/bench/engines/build_vllm_env.py first", file=sys.stderr)
        return 1
    try:
        with tempfile.TemporaryDirectory(prefix="ngc-replay-vllm-") as tmp:
            work = Path(tmp)
            plain = run_plain(args, work)
            (work / "plain.json").write_text(json.dumps(plain))
            child = subprocess.run([str(VLLM_PYTHON), __file__, "--replay", str(work / "plain.json"), "--k", args.k],
                                   capture_output=True, text=True, check=False)
            if child.returncode != 0:
                print(f"error: the replay failed:\n{child.stderr[-3000:]}", file=sys.stderr)
                return 1
            steps = json.loads(child.stdout.strip().splitlines()[-1])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    n = len(plain["outputs"])
    print(f"\n{n} edit requests, {args.max_new_tokens} new tokens, greedy; plain steps/request "
          f"{sum(plain['measured_plain_steps']) / n:.1f} (measured)")
    for k in ks:
        table = steps[str(k)]
        base = sum(table["ngram"])
        print(f"\nnum_speculative_tokens {k}\n{'drafter':<16}{'steps/req':>10}{'x ngram':>9}  per request")
        for name, per in table.items():
            print(f"{name:<16}{sum(per) / n:>10.1f}{sum(per) / base:>9.2f}  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
