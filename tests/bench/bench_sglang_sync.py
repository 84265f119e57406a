"""`ngramcache sglang-sync` push-to-listed: from a generation published to its corpus listed on every SGLang server, and the bytes sent per generation.

Starts `ngramcache serve` as its own process on loopback, SGLang stand-ins that answer as SGLang
0.5.23's source does (tests/helpers/sglang_fake.py: each add tokenizes every document again with
the namespace's tokenizer, as SGLang does with the model's; SGLang's suffix-automaton build is not
in it) and `ngramcache sglang-sync --json` as a child process. The generations are real text:
CPython's standard library (the demo's corpus), --mb megabytes of it per generation, a different
slice each time, tokenized with tiktoken:qwen and built with --corpus-index. For each generation:
publish, then time until every server lists it (the feeder's ``listed`` events, stamped when read)
and its predecessor is gone. Then one server is stopped, a generation lands, and the server comes
back --down seconds later with no corpora (a restarted pod): the time until it lists the newest,
against --interval. The baseline, measured in the same run: one add of the same request
body straight to a stand-in (what any feeder pays at least).

    python tests/bench/bench_sglang_sync.py                 # 3 servers, 5 generations of 4 MB, one down 60 s
    python tests/bench/bench_sglang_sync.py --quick         # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

from helpers.sglang_fake import FakeSglang

from ngramcache import build_static_from_tokens
from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.sync.admin import AdminClient

TOKENIZER = "tiktoken:qwen"
SERVE = [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())", "serve"]
FEEDER = [sys.executable, "-m", "ngramcache.client.tools.cli", "sglang-sync"]


def start_service(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([*SERVE, "--port", "0", "--data-dir", str(data_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"the service did not start: {line!r}")
    return p, int(m.group(1))


def stdlib_slices(mb: float, count: int) -> list[list[str]]:
    """``count`` lists of stdlib files' texts, about ``mb`` MB each, taken one after another (wrapping)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts)
                   and p.stat().st_size > 2000)
    texts: list[str] = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    out, i, budget = [], 0, int(mb * 1e6)
    for _ in range(count):
        part, size = [], 0
        while size < budget:
            part.append(texts[i % len(texts)])
            size += len(part[-1].encode())
            i += 1
        out.append(part)
    return out


class Feeder:
    """The command as a child process; its JSON events stamped with time.time() when read."""

    def __init__(self, args: list[str]) -> None:
        self.p = subprocess.Popen([*FEEDER, *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self.lock:
                self.events.append((time.time(), json.loads(line)))

    def wait(self, pred: Any, timeout: float, what: str, count: int = 1) -> list[tuple[float, dict[str, Any]]]:
        """The events ``pred`` accepts, once there are ``count`` of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [(t, e) for t, e in self.events if pred(e)]
            if len(found) >= count:
                return found
            if self.p.poll() is not None:
                raise SystemExit(f"sglang-sync exited {self.p.returncode}: {self.p.stderr.read() if self.p.stderr else ''}")
            time.sleep(0.005)
        raise SystemExit(f"timed out waiting for {what}")

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--servers", type=int, default=3, help="SGLang stand-ins (default 3)")
    ap.add_argument("--generations", type=int, default=5, help="generations published, one at a time (default 5)")
    ap.add_argument("--mb", type=float, default=4.0, help="megabytes of text per generation (default 4)")
    ap.add_argument("--interval", type=float, default=10.0, help="the feeder's --interval (default 10)")
    ap.add_argument("--down", type=float, default=60.0,
                    help="seconds one server is down while a generation lands, then back with no corpora (default 60)")
    ap.add_argument("--quick", action="store_true", help="2 servers, 2 generations of 0.2 MB: checks the script")
    args = ap.parse_args()
    if args.quick:
        args.servers, args.generations, args.mb, args.interval, args.down = 2, 2, 0.2, 1.0, 2.0
    t_start = time.perf_counter()
    tokenizer = load_tokenizer(TOKENIZER)
    slices = stdlib_slices(args.mb, args.generations)
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp_name:
        tmp = Path(tmp_name)
        builds = []
        for g, texts in enumerate([*slices, slices[0]], start=1):  # the last: for the down server
            path = tmp / f"g{g}.ngc"
            build_static_from_tokens([tokenizer.encode(t) for t in texts], str(path), vocab_size=tokenizer.vocab_size,
                                     fingerprint=tokenizer.fingerprint, generation=g, corpus_index=True)
            builds.append(path)
        service, port = start_service(tmp / "data")
        fakes = [FakeSglang(tokenizer).start() for _ in range(args.servers)]
        feeder = None
        try:
            address, ns = f"127.0.0.1:{port}", "bench-sglang"
            admin = AdminClient(address, timeout=30)
            admin.wait_ready()
            admin.create_namespace(ns, tokenizer)
            feeder = Feeder(["--server", address, "--namespace", ns, "--tokenizer", TOKENIZER, "--interval",
                             str(args.interval), "--cache-dir", str(tmp / "cache"),
                             *[x for f in fakes for x in ("--sglang", f.url)]])
            feeder.wait(lambda e: e["event"] == "connected", 60, "the feeder to connect")
            rows = []
            for g, path in enumerate(builds[:-1], start=1):
                t0 = time.time()
                admin.publish(ns, path)
                t_pub = time.time()
                cid = f"ngramcache-{ns}-g{g}"
                ready = feeder.wait(lambda e, g=g: e["event"] == "generation" and e["generation"] == g, 600,
                                    f"generation {g} prepared")[0]
                listed = feeder.wait(lambda e, g=g: e["event"] == "listed" and e["generation"] == g, 600,
                                     f"generation {g} listed", count=len(fakes))
                deadline = time.monotonic() + 60
                while any(set(f.corpora) != {cid} for f in fakes):  # and its predecessor removed
                    if time.monotonic() > deadline:
                        raise SystemExit(f"generation {g - 1} not removed everywhere")
                    time.sleep(0.005)
                t_all = max(t for t, _ in listed)
                rows.append({"generation": g, "publish_s": t_pub - t0, "push_to_listed_s": t_all - t_pub,
                             "first_listed_s": min(t for t, _ in listed) - t_pub, "prepare_s": ready[1]["prepare_seconds"],
                             "learned_s": ready[1]["fetched_at"] - t_pub, "documents": ready[1]["documents"],
                             "tokens": ready[1]["tokens"], "bytes": ready[1]["bytes"],
                             "file_bytes": path.stat().st_size})
            sent = sum(n for f in fakes for m, p, n in f.requests if p == "/add_external_corpus")
            # One server down while a generation lands, back after --down seconds with no corpora (a new pod).
            down, g = fakes[0], len(builds)
            down.stop()
            admin.publish(ns, builds[-1])
            cid = f"ngramcache-{ns}-g{g}"
            time.sleep(args.down)
            if any(set(f.corpora) != {cid} for f in fakes[1:]):
                raise SystemExit(f"generation {g} not on the servers that stayed up after {args.down:g} s")
            with down.lock:
                down.corpora = {}
            down.start()
            t_back = time.monotonic()
            while set(down.corpora) != {cid}:
                if time.monotonic() - t_back > 10 * args.interval + 60:
                    raise SystemExit(f"the server back after {args.down:g} s down did not catch up")
                time.sleep(0.005)
            catch_up = time.monotonic() - t_back
            # The baseline: the last generation's body added straight to a stand-in, no feeder.
            body = json.dumps({"corpus_id": "baseline", "documents": [
                tokenizer.decode(tokenizer.encode(t)) for t in slices[-1]]}, ensure_ascii=False).encode()
            t0 = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(fakes[0].url + "/add_external_corpus", data=body,
                                                               headers={"Content-Type": "application/json"}),
                                        timeout=600) as resp:
                resp.read()
            direct = time.perf_counter() - t0
            checksum = hashlib.sha256(json.dumps([sorted(f.corpora.items()) for f in fakes]).encode()).hexdigest()[:16]
        finally:
            if feeder is not None:
                feeder.stop()
            for f in fakes:
                f.stop()
            service.terminate()
            service.wait(10)
    print(f"## sglang-sync push-to-listed: {args.servers} servers, {args.generations} generations of {args.mb:g} MB "
          f"of text (tiktoken:qwen), loopback")
    print()
    print("| gen | documents | tokens | request MB | file MB | publish s | learned s | prepare s | first listed s | "
          "all listed s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['generation']} | {r['documents']:,} | {r['tokens']:,} | {r['bytes'] / 1e6:.2f} | "
              f"{r['file_bytes'] / 1e6:.2f} | {r['publish_s']:.2f} | {r['learned_s']:.3f} | {r['prepare_s']:.2f} | "
              f"{r['first_listed_s']:.2f} | {r['push_to_listed_s']:.2f} |")
    print()
    med = statistics.median(r["push_to_listed_s"] for r in rows)
    per_gen = sent / len(rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    print(f"push-to-listed on every server: median {med:.2f} s, max {max(r['push_to_listed_s'] for r in rows):.2f} s")
    print(f"baseline (one add of the last body straight to a stand-in, no feeder): {direct:.2f} s")
    print(f"bytes sent per generation: {per_gen / 1e6:.2f} MB to {args.servers} servers ({per_gen / args.servers / 1e6:.2f} "
          f"MB each, {per_gen / args.servers / tokens:.2f} bytes per corpus token)")
    print(f"a server down {args.down:g} s while generation {len(builds)} landed, back with no corpora: listed "
          f"{catch_up:.2f} s after it returned (--interval {args.interval:g} s)")
    print(f"checksum {checksum}; total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
