"""bench_real_model.py's engines (transformers, llama-cpp-python), with forward passes counted the same way in both,
and its workers' drafters."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from helpers.model import smollm2_gguf

from ngramcache import Drafter, NgramClient

COST_AWARE = {"g": "c", "h": "e"}  # a cost-aware setup -> the same drafter sending every drafted token
DRAFTED_LABELS = {"c": "(c) ngramcache, local Drafter", "d": "(d) ngramcache + service",
                  "e": "(e) (c) in the match mode", "f": "(f) (d) in the match mode",
                  "g": "(g) (c) cost-aware", "h": "(h) (e) cost-aware"}  # the setups' names in both engines' tables


@dataclass
class Run:
    """One generation's figures."""

    tokens: list[int]
    seconds: float
    forwards: int
    drafted: int  # drafted tokens evaluated by the verification passes
    drafts: int  # verification passes that evaluated at least one drafted token

    @property
    def accepted(self) -> int:
        return len(self.tokens) - self.forwards


class PassCounter:
    """Counts forward passes and the drafted tokens they evaluate (the first pass of a generation is the prefill)."""

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.forwards = self.drafted = self.drafts = 0

    def count(self, n_input: int) -> None:
        extra = n_input - (self.prompt_len if self.forwards == 0 else 1)
        self.forwards += 1
        if extra > 0:
            self.drafted += extra
            self.drafts += 1


class Worker:
    """One worker's drafters in setups (c)-(f): local Drafters with their dynamic tables ((c), (e)), and
    NgramClients ((d), (f), and (d) without A's counts)."""

    def __init__(self, name: str, seq: int, local: dict[str, Drafter]) -> None:
        self.name = name
        self.seq = seq
        self.local = local  # setup -> local Drafter
        self.clients: dict[str, NgramClient] = {}  # setup -> client
        self.last_rows: dict[str, np.ndarray] = {}  # setup -> context table of the last request

    def drafter(self, setup: str) -> Drafter:
        return self.local[setup] if setup in self.local else self.clients[setup].drafter()

    def finish(self, setup: str, drafter: Drafter) -> None:
        """After a request: (c) and (e) merge the context table into the dynamic one; every setup forgets the
        sequence."""
        rows = drafter.context_rows(self.seq)
        self.last_rows[setup] = rows
        if setup in self.local and len(rows):
            dynamic = drafter.dynamic
            assert dynamic is not None
            dynamic.add_rows(rows)
        drafter.reset(self.seq)


class TransformersEngine:
    name = "transformers"

    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from ngramcache.client.adapters.transformers import DraftStats, generate, measure_verify_cost

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(args.threads)
        self.torch, self.DraftStats, self.adapter_generate = torch, DraftStats, generate
        gguf = smollm2_gguf()
        self.model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
        self.args = args
        self.eos = tokenizer.eos_token_id
        self.counter = PassCounter()
        self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.stats_mismatch = 0  # generations whose adapter DraftStats disagree with the counted passes
        self.verify_cost: Any = None  # measured at the first cost-aware run (uncounted: before the hook counts)
        self.measure_verify_cost = measure_verify_cost
        self.title = (f"transformers {transformers.__version__} (torch {torch.__version__}, {args.threads} threads, "
                      f"float32 dequantized from the GGUF)")
        self.labels = {"a": "(a) plain greedy", "b": f"(b) prompt_lookup_num_tokens={args.pld_tokens}", **DRAFTED_LABELS}

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.counter.count(int(ids.shape[1]))

    def run(self, setup: str, ids: list[int], drafter: Any = None, seq: int = 0, max_new: int | None = None,
            worker: str = "") -> Run:
        """One generation: setup "a" plain, "b" the engine's prompt lookup, any other the adapter with `drafter`."""
        torch = self.torch
        max_new = max_new or self.args.max_new_tokens
        inp = torch.tensor([ids], dtype=torch.long)
        kwargs = dict(attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=max_new,
                      eos_token_id=self.eos, pad_token_id=self.eos)
        self.counter.reset(len(ids))
        stats = self.DraftStats()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if setup == "a":
                out = self.model.generate(inp, **kwargs)
            elif setup == "b":
                out = self.model.generate(inp, prompt_lookup_num_tokens=self.args.pld_tokens, **kwargs)
            else:
                cost: dict[str, Any] = {}
                if setup in COST_AWARE:
                    if self.verify_cost is None:
                        self.verify_cost = self.measure_verify_cost(self.model)
                        self.counter.reset(len(ids))
                        t0 = time.perf_counter()
                    cost = dict(cost_aware=True, verify_cost=self.verify_cost)
                out = self.adapter_generate(self.model, inp, drafter, seq_id=seq, n_draft=self.args.n_draft,
                                            stats=stats, **cost, **kwargs)
        seconds = time.perf_counter() - t0
        c = self.counter
        run = Run(out[0, len(ids):].tolist(), seconds, c.forwards, c.drafted, c.drafts)
        if setup not in ("a", "b") and (stats.steps != c.forwards or stats.tokens != len(run.tokens)):
            self.stats_mismatch += 1
        return run

    def forget(self, setup: str, worker: str) -> None:
        """Nothing to forget: each adapter generate() call starts its drafter sequence afresh."""

    def close(self) -> None:
        pass


class LlamaCppEngine:
    name = "llama-cpp"

    def __init__(self, args: argparse.Namespace, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ngramcache.client.adapters.llama_cpp import NgramDraftModel

        self.Llama, self.NgramDraftModel = llama_cpp.Llama, NgramDraftModel
        self.args = args
        self.gguf = smollm2_gguf()
        self.n_ctx = n_ctx
        self.counter = PassCounter()
        self.instances: dict[str, Any] = {}  # setup -> Llama
        self.draft_models: dict[tuple[str, str], Any] = {}  # (setup, worker) -> NgramDraftModel
        self.instances["a"] = self._llama(None)
        self.instances["b"] = self._llama(LlamaPromptLookupDecoding(num_pred_tokens=args.pld_tokens))
        self.eos = self.instances["a"].token_eos()
        self.title = (f"llama-cpp-python {llama_cpp.__version__} ({args.threads} threads, Q4_1 GGUF, "
                      f"n_ctx {n_ctx})")
        self.labels = {"a": "(a) plain greedy", "b": f"(b) LlamaPromptLookupDecoding({args.pld_tokens})",
                       **DRAFTED_LABELS}
        self.verify_cost: Any = None  # measured on the first cost-aware setup's Llama

    def _llama(self, draft_model: Any) -> Any:
        llm = self.Llama(model_path=str(self.gguf), n_ctx=self.n_ctx, n_threads=self.args.threads,
                         n_threads_batch=self.args.threads, draft_model=draft_model, verbose=False)
        evaluate = llm.eval
        counter = self.counter

        def counted_eval(tokens: Any) -> None:  # generate() calls self.eval: one forward pass per call
            counter.count(len(tokens))
            evaluate(tokens)

        llm.eval = counted_eval
        return llm

    def run(self, setup: str, ids: list[int], drafter: Any = None, seq: int = 0, max_new: int | None = None,
            worker: str = "") -> Run:
        """One generation: setup "a" plain, "b" the engine's prompt lookup, any other an `NgramDraftModel` over
        `drafter` (one Llama per setup, one draft model per setup and worker)."""
        max_new = max_new or self.args.max_new_tokens
        if setup in ("a", "b"):
            llm = self.instances[setup]
        else:
            dm = self.draft_models.get((setup, worker))
            if dm is None:
                dm = self.draft_models[(setup, worker)] = self.NgramDraftModel(drafter, seq_id=seq, n_draft=self.args.n_draft)
            llm = self.instances.get(setup)
            if llm is None:
                llm = self.instances[setup] = self._llama(dm)
            if setup in COST_AWARE and not dm.cost_aware:
                if self.verify_cost is None:
                    self.verify_cost = dm.measure(llm)  # before the run's counter is reset: uncounted
                dm.set_verify_cost(self.verify_cost)
            llm.draft_model = dm
        self.counter.reset(len(ids))
        out: list[int] = []
        t0 = time.perf_counter()
        gen = llm.generate(ids, temp=0.0, repeat_penalty=1.0)
        try:
            for token in gen:
                out.append(int(token))
                if token == self.eos or len(out) >= max_new:
                    break
        finally:
            gen.close()
        seconds = time.perf_counter() - t0
        c = self.counter
        return Run(out, seconds, c.forwards, c.drafted, c.drafts)

    def forget(self, setup: str, worker: str) -> None:
        """The draft model starts its next generation afresh (its drafter sequence was reset)."""
        dm = self.draft_models.get((setup, worker))
        if dm is not None:
            dm.reset()

    def close(self) -> None:
        for llm in self.instances.values():
            if hasattr(llm, "close"):
                llm.close()
        self.instances.clear()
