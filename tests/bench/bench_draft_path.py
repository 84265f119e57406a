"""What the drafting path costs per step, apart from the model: each adapter's calls with n_draft 64, fixed vs cost-aware vs the default ("auto").

No model: requests copy a CPython standard library module with edits (prompt: its first
--prompt tokens, tiktoken's qwen encoding; answer: the same tokens with one in --edit-every
replaced by another, up to --new-tokens), a stand-in for a code-editing model that mostly
repeats its input. Each step the adapter drafts, the simulated model keeps the drafted tokens
that equal the answer and adds the answer's next one, as greedy verification would, and hands
the adapter what the engine would:

- transformers: `NgramCandidateGenerator.get_candidates` then `update_candidate_strategy`
  (CPU tensors, as transformers' assisted-decoding loop calls them);
- llama-cpp-python: `NgramDraftModel.__call__` on a view of one reused intc buffer;
- vLLM: `NgramCacheProposer.propose` on a one-row batch laid out as vLLM 0.33.0's
  (``num_speculative_tokens`` 64; no cost-aware setting: its default drafts up to the engine's
  limit; auto is ``NGC_VLLM_N_DRAFT=auto``, opt-in there).

Settings: fixed (n_draft=64, every drafted token sent), cost-aware (n_draft=64,
``cost_aware=True`` with flat given costs, c(k) = 1 + k/1000: a GPU's, so the drafts are the fixed
ones and only the path's cost differs), auto (the default: costs learned from the steps'
timings; here the steps are only the path, so the costs it learns are the path's own). The
drafters are match-mode `Drafter`s (context only), one per request and setting; the first
--warmup requests of each setting are not timed. Reported: the median and 90th percentile of one
step's calls (microseconds), tokens per step, and a checksum of every drafted token sent (equal
for fixed and cost-aware: the same drafts).

    python tests/bench/bench_draft_path.py            # 12 requests, 1,024-token prompts, 512 new tokens
    python tests/bench/bench_draft_path.py --quick    # 3 requests, 256 new tokens (~10 s)
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ngramcache import UNTAGGED, Drafter
from ngramcache.client.kernel.tokenizer import load_tokenizer

FLAT = [1.0 + k / 1000 for k in range(65)]  # a GPU's verify costs: every drafted token worth sending
SETTINGS = {"fixed": dict(n_draft=64), "cost-aware": dict(n_draft=64, cost_aware=True, verify_cost=FLAT),
            "auto": {}}


def requests(n: int, prompt: int, new_tokens: int, edit_every: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) pairs: a stdlib module's tokens, and the same tokens with edits."""
    tok = load_tokenizer("tiktoken:qwen")
    lib = Path(sysconfig.get_paths()["stdlib"])
    rng = np.random.default_rng(seed)
    out = []
    for path in sorted(lib.glob("*.py")):
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace")).astype(np.int32)
        if len(ids) < prompt:
            continue
        p = ids[:prompt]
        answer = p[:new_tokens].copy()
        edits = rng.choice(len(answer), size=max(1, len(answer) // edit_every), replace=False)
        answer[edits] = rng.integers(0, 100_000, size=len(edits))
        out.append((p, answer))
        if len(out) == n:
            break
    return out


def kept(drafted: np.ndarray, answer: np.ndarray, done: int) -> int:
    """How many drafted tokens greedy verification keeps: those equal to the answer's next ones."""
    want = answer[done: done + len(drafted)]
    agree = drafted[: len(want)] == want
    return int(np.argmin(agree)) if not agree.all() else len(want)


class Path_:
    """One adapter's step: draft from the verified sequence, then see the kept tokens (timed together)."""

    def start(self, prompt: np.ndarray) -> None: ...

    def step(self, kept_tokens: np.ndarray) -> np.ndarray: ...


class TransformersPath(Path_):
    def __init__(self, setting: dict[str, Any]) -> None:
        import torch

        from ngramcache.client.adapters.draft_length import VerifyCost
        from ngramcache.client.adapters.transformers import NgramCandidateGenerator

        self.torch = torch
        kwargs: dict[str, Any] = {"n_draft": setting.get("n_draft", "auto")}
        if setting.get("cost_aware"):
            kwargs["verify_cost"] = VerifyCost(setting["verify_cost"], 64)
        self.make = lambda: NgramCandidateGenerator(Drafter(fingerprint=UNTAGGED, vocab_size=200_000, mode="match"), 1,
                                                    **kwargs)

    def start(self, prompt: np.ndarray) -> None:
        self.gen = self.make()
        self.ids = self.torch.from_numpy(prompt.astype(np.int64)).unsqueeze(0)
        self.cand, _ = self.gen.get_candidates(self.ids)

    def drafted(self) -> np.ndarray:
        return self.cand[0, self.ids.shape[1]:].numpy()

    def step(self, kept_tokens: np.ndarray) -> None:
        n = len(kept_tokens) - 1
        self.ids = self.torch.cat((self.cand[:, : self.ids.shape[1] + n],
                                   self.torch.from_numpy(kept_tokens[-1:].astype(np.int64)).unsqueeze(0)), dim=1)
        self.gen.update_candidate_strategy(self.ids, self.torch.empty(0), n)
        self.cand, _ = self.gen.get_candidates(self.ids)


class LlamaCppPath(Path_):
    def __init__(self, setting: dict[str, Any]) -> None:
        from ngramcache.client.adapters.llama_cpp import NgramDraftModel

        self.make = lambda: NgramDraftModel(Drafter(fingerprint=UNTAGGED, vocab_size=200_000, mode="match"), 1, **setting)
        self.buf = np.zeros(8192, dtype=np.intc)

    def start(self, prompt: np.ndarray) -> None:
        self.dm = self.make()
        self.n = len(prompt)
        self.buf[: self.n] = prompt
        self.draft = self.dm(self.buf[: self.n])

    def drafted(self) -> np.ndarray:
        return self.draft

    def step(self, kept_tokens: np.ndarray) -> None:
        self.buf[self.n: self.n + len(kept_tokens)] = kept_tokens
        self.n += len(kept_tokens)
        self.draft = self.dm(self.buf[: self.n])


class VllmPath(Path_):
    def __init__(self, setting: dict[str, Any]) -> None:
        from ngramcache.client.adapters.vllm import NgramCacheProposer, ProposerConfig

        config = SimpleNamespace(
            speculative_config=SimpleNamespace(method="custom_class", model="x", num_speculative_tokens=64),
            model_config=SimpleNamespace(max_model_len=8192, tokenizer=None, get_vocab_size=lambda: 200_000),
            scheduler_config=SimpleNamespace(max_num_seqs=1))
        n_draft = setting.get("n_draft", "auto")
        self.make = lambda: NgramCacheProposer(config, ProposerConfig(mode="match", n_draft=n_draft))
        self.token_ids = np.zeros((1, 8192), dtype=np.int32)
        self.num = np.zeros(1, dtype=np.int32)

    def start(self, prompt: np.ndarray) -> None:
        self.proposer = self.make()
        self.n = len(prompt)
        self.token_ids[0, : self.n] = prompt
        self.num[0] = self.n
        self.draft = np.asarray(self.proposer.propose([[int(prompt[-1])]], self.num, self.token_ids)[0], dtype=np.int32)

    def drafted(self) -> np.ndarray:
        return self.draft

    def step(self, kept_tokens: np.ndarray) -> None:
        self.token_ids[0, self.n: self.n + len(kept_tokens)] = kept_tokens
        self.n += len(kept_tokens)
        self.num[0] = self.n
        self.draft = np.asarray(self.proposer.propose([kept_tokens.tolist()], self.num, self.token_ids)[0], dtype=np.int32)


ADAPTERS: dict[str, tuple[Callable[[dict[str, Any]], Path_], tuple[str, ...]]] = {
    "transformers": (TransformersPath, tuple(SETTINGS)),
    "llama-cpp": (LlamaCppPath, tuple(SETTINGS)),
    "vllm": (VllmPath, ("fixed", "auto")),
}


def run(path: Path_, reqs: list[tuple[np.ndarray, np.ndarray]], warmup: int) -> tuple[list[float], int, int, int]:
    """Timed steps (seconds), steps, new tokens and a CRC of the drafted tokens, over the requests after `warmup`."""
    times: list[float] = []
    steps = tokens = 0
    crc = 0
    for i, (prompt, answer) in enumerate(reqs):
        path.start(prompt)
        done = 0
        while done < len(answer):
            drafted = np.asarray(path.drafted(), dtype=np.int32)  # type: ignore[attr-defined]
            k = kept(drafted, answer, done)
            new = answer[done: done + k + 1]
            done += len(new)
            if done >= len(answer):
                break
            t0 = time.perf_counter()
            path.step(new)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
                steps += 1
                tokens += len(new)
                crc = zlib.crc32(drafted.tobytes(), crc)
    return times, steps, tokens, crc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12, help="timed requests per adapter and setting (default 12)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--new-tokens", type=int, default=512, help="answer tokens (default 512)")
    ap.add_argument("--edit-every", type=int, default=40, help="one answer token in this many is edited (default 40)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--adapters", default=",".join(ADAPTERS), help="comma list of transformers, llama-cpp, vllm")
    ap.add_argument("--quick", action="store_true", help="3 requests (1 untimed), 256 new tokens")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.new_tokens = 2, 256
    chosen = [a.strip() for a in args.adapters.split(",") if a.strip()]
    if not chosen or set(chosen) - set(ADAPTERS):
        ap.error(f"--adapters: a comma list of {', '.join(ADAPTERS)}, got {args.adapters!r}")
    reqs = requests(args.requests + args.warmup, args.prompt, args.new_tokens, args.edit_every, args.seed)
    print(f"{len(reqs)} requests ({args.warmup} untimed) of {args.prompt}-token stdlib prompts, answers of "
          f"{args.new_tokens} tokens with one in {args.edit_every} edited; match-mode Drafter, n_draft 64")
    print(f"{'adapter':<13} {'setting':<11} {'median us/step':>14} {'p90 us':>8} {'steps':>6} {'tokens/step':>11}  checksum")
    worst = 0.0
    for name in chosen:
        make, settings = ADAPTERS[name]
        for setting in settings:
            try:
                path = make(SETTINGS[setting])
            except ImportError as e:
                print(f"{name:<13} {setting:<11} skipped: {e}")
                break
            times, steps, tokens, crc = run(path, reqs, args.warmup)
            med = statistics.median(times) * 1e6
            p90 = float(np.percentile(times, 90)) * 1e6
            worst = max(worst, med)
            print(f"{name:<13} {setting:<11} {med:>14.1f} {p90:>8.1f} {steps:>6} {tokens / steps:>11.2f}  {crc:08x}")
    print(f"target: the drafting path <= 100 us per step at n_draft 64: {'met' if worst <= 100 else 'MISSED'} "
          f"(slowest median {worst:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
