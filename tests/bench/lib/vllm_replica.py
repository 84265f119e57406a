"""One vLLM engine replica for bench_vllm.py and the vLLM tests: runs a job of requests, writes what each took.

Run by the Python of the vLLM virtualenv (`.venv-vllm`, made by tests/bench/engines/build_vllm_env.py),
never imported by the tests' own Python (vLLM pins another transformers than ours):

    .venv-vllm/bin/python tests/bench/lib/vllm_replica.py JOB.json RESULT.json

JOB.json holds ``model`` (a folder vLLM loads), ``speculative_config`` (or null for plain
decoding), ``requests`` (each ``{"prompt_ids": [...], "max_tokens": N, "temperature": T,
"seed": S}``), and optionally ``max_model_len``, ``multiprocess`` (vLLM's default engine in
processes of its own; else engine and worker in this process) and ``concurrent`` (all requests
in the batch at once; else one at a time, so each request's engine steps are its own). The
drafter is chosen by the ``NGC_VLLM_*`` variables this process inherits.

RESULT.json: per request its output token ids, engine steps (one request at a time) and
seconds; vLLM's speculative counters (drafts, drafted and accepted tokens); with an in-process
engine and ngramcache's proposer, the seconds spent in ``propose`` against the engine steps'.
A setting vLLM or the proposer refuses ends the process with its message on stderr and exit 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def spec_counters(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters (0 where it kept none)."""
    out = {"drafts": 0, "drafted": 0, "accepted": 0}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "drafted",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off, or a vLLM without the reader
        return out
    for m in metrics:
        key = names.get(m.name.removesuffix("_total"))
        if key is not None and hasattr(m, "value"):
            out[key] += int(m.value)
    return out


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if job.get("multiprocess") else "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timing = {"propose_s": 0.0, "propose_calls": 0}
    if not job.get("multiprocess"):  # the proposer runs in this process: time it
        from ngramcache.client.adapters.vllm import NgramCacheProposer

        original = NgramCacheProposer.propose

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                timing["propose_s"] += time.perf_counter() - t0
                timing["propose_calls"] += 1

        NgramCacheProposer.propose = timed  # type: ignore[method-assign]

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=job.get("max_model_len", 2048),
              speculative_config=job.get("speculative_config"), seed=0, disable_log_stats=False,
              gpu_memory_utilization=job.get("memory_fraction", 0.08))
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    results: list[dict[str, Any]] = []
    step_s = 0.0
    steps_total = 0

    def params(r: dict[str, Any]) -> Any:
        return SamplingParams(temperature=r.get("temperature", 0.0), max_tokens=r["max_tokens"], seed=r.get("seed"),
                              ignore_eos=r.get("ignore_eos", False))

    if job.get("concurrent"):
        t_start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in job["requests"]],
                            [params(r) for r in job["requests"]], use_tqdm=False)
        elapsed = time.perf_counter() - t_start
        for o in outs:
            results.append({"output_ids": list(o.outputs[0].token_ids), "steps": None, "seconds": None})
        step_s = elapsed
    else:
        for i, r in enumerate(job["requests"]):
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=r["prompt_ids"]), params(r))
            steps = 0
            finished = None
            t_req = time.perf_counter()
            while engine.has_unfinished_requests():
                t_step = time.perf_counter()
                outs = engine.step()
                step_s += time.perf_counter() - t_step
                steps += 1
                for o in outs:
                    if o.finished:
                        finished = o
            assert finished is not None
            results.append({"output_ids": list(finished.outputs[0].token_ids), "steps": steps,
                            "seconds": time.perf_counter() - t_req})
            steps_total += steps
    result = {"requests": results, "load_s": load_s, "step_s": step_s, "steps": steps_total,
              "spec": spec_counters(llm), **timing}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    # The proposer's clients (NGC_VLLM_SERVICE) push what they learned before the process ends.
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
