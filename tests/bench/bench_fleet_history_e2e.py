"""End to end with the real model: two worker processes sample rollout groups from SmolLM2-135M-Instruct
through the transformers adapter, sharing what they generate through a service, against the same two
workers siloed and against plain sampling.

    python tests/bench/bench_fleet_history_e2e.py [--groups 8] [--samples 8] [--max-new-tokens 96]
    python tests/bench/bench_fleet_history_e2e.py --quick   # checks the script: 1 group of 2 samples of 8 tokens

Per setup, two worker processes (one torch thread each: the machine has two cores) generate the
same G groups x S samples: the prompts of workload (a) of tests/bench/data/fleet_workloads.npz
(tests/bench/record_workloads.py), temperature 0.8, top-p 0.95. Sample s of group g runs on
worker s % 2 and both workers walk the groups in the same order, so the siblings of a group are
generated at the same time on both, as an RL rollout spreads them:

- plain: ``model.generate(do_sample=True)``, no drafting;
- siloed: each worker drafts with an `NgramClient` of its own namespace (match mode, 8 tokens);
- fleet: both workers on one namespace, so each drafts from the other's counts and generated
  sequences (the fleet history) as well as its own.

It prints, per setup, the forward passes per generated token (counted by a hook on the model,
prefill included), tokens per pass, tokens/s (both workers' tokens over the setup's wall time),
drafted and accepted tokens, and the ratios fleet/siloed and fleet/plain. Drafted sampling is
exact in distribution (a drafted token is kept with the model's own probability; see the
transformers adapter) but does not reproduce the plain run's random draws, so outputs are not
compared token for token; ``--check-greedy`` instead runs every setup with top_k=1 (sampling
that is argmax) and checks that every drafted output equals plain's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "tests" / "bench" / "data" / "fleet_workloads.npz"
N_DRAFT = 8


def load_prompts(path: Path, groups: int) -> tuple[list[list[int]], int]:
    """The first `groups` prompts of workload (a) (rollout groups) and the model's vocabulary size."""
    if not path.is_file():
        raise SystemExit(f"bench_fleet_history_e2e: no recording at {path}: run `python tests/bench/record_workloads.py` "
                         "first (or give --recording)")
    data = np.load(path)
    meta = json.loads(str(data["meta"]))
    rollout = meta["workloads"].index("rollout")
    offsets = data["prompt_offsets"]
    prompts = [data["prompt_tokens"][offsets[i]:offsets[i + 1]].tolist()
               for i in np.flatnonzero(data["prompt_workload"] == rollout)[:groups]]
    return prompts, int(meta["vocab_size"])


def worker(rank: int, conn: Any, barrier: Any) -> None:
    """One worker process: loads the model once, then runs the setups the parent sends."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading draws a progress bar per worker
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from helpers.model import load_transformers_model

    from ngramcache import UNTAGGED, NgramClient
    from ngramcache.client.adapters.transformers import DraftStats, generate

    torch.set_num_threads(1)
    model, tok = load_transformers_model()
    passes = [0]
    model.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    eos = int(tok.eos_token_id)
    conn.send({"ready": True})
    while (job := conn.recv()) is not None:
        client = None
        if job["namespace"]:
            client = NgramClient(job["address"], job["namespace"], (UNTAGGED, job["vocab_size"]),
                                 cache_dir=job["cache_dir"], mode="match")
        sampling = dict(do_sample=True, top_k=1) if job["greedy"] else dict(do_sample=True, temperature=0.8, top_p=0.95,
                                                                             top_k=0)
        out: list[dict[str, Any]] = []
        barrier.wait()
        t_start = time.perf_counter()
        for g, prompt in enumerate(job["prompts"]):
            for s in range(rank, job["samples"], 2):
                ids = torch.tensor([prompt], dtype=torch.long)
                kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=job["max_new_tokens"],
                              eos_token_id=eos, pad_token_id=eos, **sampling)
                torch.manual_seed(1000 * g + s)
                passes[0] = 0
                stats = DraftStats()
                with torch.inference_mode():
                    if client is None:
                        result = model.generate(ids, **kwargs)
                    else:
                        seq = 1000 * g + s
                        client.set_group(seq, f"g{g}")
                        result = generate(model, ids, client.drafter(), seq_id=seq, n_draft=N_DRAFT, stats=stats,
                                          **kwargs)
                out.append({"group": g, "sample": s, "tokens": result[0, len(prompt):].tolist(), "passes": passes[0],
                            "drafted": stats.drafted, "accepted": stats.accepted})
        seconds = time.perf_counter() - t_start
        history = {}
        if client is not None:
            s = client.stats()
            history = {k: s[k] for k in ("history_pulled_tokens", "history_pulled_bytes", "history_lag_ms_p50",
                                         "history_lag_ms_p99", "pulled_bytes")}
            client.close()
        conn.send({"runs": out, "seconds": seconds, "history": history})


def run_setups(args: argparse.Namespace, prompts: list[list[int]], vocab: int) -> dict[str, Any]:
    from ngramcache import UNTAGGED, AdminClient
    from ngramcache.cache_service.config import ServiceConfig
    from ngramcache.cache_service.service_thread import ServiceThread

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=worker, args=(rank, pipes[rank][1], barrier), daemon=True) for rank in range(2)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ngc-e2e-") as tmp:
        service = ServiceThread(ServiceConfig(port=0, data_dir=os.path.join(tmp, "service"))).start()
        try:
            for p in procs:
                p.start()
            for parent, _ in pipes:
                parent.recv()
            address = f"127.0.0.1:{service.port}"
            setups = ["plain", "siloed", "fleet"]
            for mode in (["greedy"] if args.check_greedy else []) + ["sampled"]:
                for setup in setups:
                    names = [""] * 2
                    if setup != "plain":
                        names = ([f"{mode}-fleet"] * 2 if setup == "fleet"
                                 else [f"{mode}-solo-{rank}" for rank in range(2)])
                        with AdminClient(address, timeout=30) as admin:
                            for name in set(names):
                                admin.create_namespace(name, (UNTAGGED, vocab))
                    print(f"{mode} {setup}: {len(prompts)} groups x {args.samples} samples on 2 workers ...", flush=True)
                    t0 = time.perf_counter()
                    for rank, (parent, _) in enumerate(pipes):
                        parent.send({"namespace": names[rank], "address": address, "vocab_size": vocab,
                                     "cache_dir": os.path.join(tmp, f"node-{rank}"), "prompts": prompts,
                                     "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                                     "greedy": mode == "greedy"})
                    answers = [parent.recv() for parent, _ in pipes]
                    results[f"{mode} {setup}"] = {"wall": time.perf_counter() - t0, "workers": answers}
            for parent, _ in pipes:
                parent.send(None)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
            service.stop(grace=0.5)
    return results


def summarize(result: dict[str, Any]) -> dict[str, float]:
    runs = [r for w in result["workers"] for r in w["runs"]]
    tokens = sum(len(r["tokens"]) for r in runs)
    passes = sum(r["passes"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    wall = max(w["seconds"] for w in result["workers"])
    return {"tokens": tokens, "passes": passes, "passes_per_token": passes / max(tokens, 1),
            "tokens_per_pass": tokens / max(passes, 1), "tps": tokens / wall, "wall": wall,
            "drafted": drafted, "accepted": accepted, "accept_pct": 100 * accepted / max(drafted, 1)}


def outputs(result: dict[str, Any]) -> dict[tuple[int, int], list[int]]:
    return {(r["group"], r["sample"]): r["tokens"] for w in result["workers"] for r in w["runs"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recording", type=Path, default=RECORDING, help="the record_workloads.py file (default %(default)s)")
    ap.add_argument("--groups", type=int, default=8, help="rollout prompts (groups) to sample (default %(default)s)")
    ap.add_argument("--samples", type=int, default=8, help="samples per group (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per sample at most (default %(default)s)")
    ap.add_argument("--check-greedy", action="store_true",
                    help="also run every setup with top_k=1 and check the drafted outputs equal plain's")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script: 1 group of 2 samples of at most 8 tokens (figures meaningless)")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.samples, args.max_new_tokens = 1, 2, 8
    if not (1 <= args.groups <= 1000 and 2 <= args.samples <= 64 and 1 <= args.max_new_tokens <= 2048):
        ap.error("--groups 1..1000, --samples 2..64, --max-new-tokens 1..2048")
    prompts, vocab = load_prompts(args.recording, args.groups)
    if not prompts:
        ap.error(f"{args.recording} holds no rollout prompts")
    try:
        results = run_setups(args, prompts, vocab)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    figures = {name: summarize(r) for name, r in results.items()}
    print(f"\n{'setup':<16}{'tokens':>8}{'passes/token':>14}{'tokens/pass':>13}{'tokens/s':>10}{'accept %':>10}"
          f"{'wall s':>8}")
    for name, f in figures.items():
        print(f"{name:<16}{f['tokens']:>8}{f['passes_per_token']:>14.3f}{f['tokens_per_pass']:>13.3f}{f['tps']:>10.2f}"
              f"{f['accept_pct']:>10.1f}{f['wall']:>8.1f}")
    for mode in ("greedy", "sampled"):
        if f"{mode} fleet" not in figures:
            continue
        fleet, siloed, plain = (figures[f"{mode} {s}"] for s in ("fleet", "siloed", "plain"))
        print(f"{mode}: fleet/siloed tokens per pass {fleet['tokens_per_pass'] / siloed['tokens_per_pass']:.3f}x, "
              f"tokens/s {fleet['tps'] / siloed['tps']:.3f}x; fleet/plain tokens/s {fleet['tps'] / plain['tps']:.3f}x, "
              f"siloed/plain {siloed['tps'] / plain['tps']:.3f}x")
        hist = [w["history"] for w in results[f"{mode} fleet"]["workers"]]
        print(f"{mode} fleet history per worker: " + "; ".join(
            f"pulled {h['history_pulled_tokens']:,} tokens ({h['history_pulled_bytes']:,} bytes), store to worker "
            f"p50 {h['history_lag_ms_p50'] or 0:.1f} ms, p99 {h['history_lag_ms_p99'] or 0:.1f} ms" for h in hist))
    if args.check_greedy:
        plain_out = outputs(results["greedy plain"])
        for setup in ("siloed", "fleet"):
            got = outputs(results[f"greedy {setup}"])
            same = sum(got[k] == v for k, v in plain_out.items())
            print(f"greedy {setup}: {same} of {len(plain_out)} outputs equal plain's")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
