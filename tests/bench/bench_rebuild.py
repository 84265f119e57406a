"""What each rebuild option does to drafts: file size and acceptance of a replay per option.

A real `ngramcache serve` process (embedded counts store, loopback). CPython's standard library
tokenized with cl100k: 5% of the files are held out; of the rest, the first part is the
fleet's traffic (pushed by an `NgramClient` as workers would) and the second a corpus built
into a generation and published, as an operator would. Then one rebuild per option set, each
published as the namespace's next generation and replayed on the held-out files as
llama-lookup-stats does (n_ctx 4096, n_draft 8) with that generation as the static cache and
empty context/dynamic tables to start (the replay fills them as it goes).

    python tests/bench/bench_rebuild.py [--fleet-tokens N] [--corpus-tokens N]
    python tests/bench/bench_rebuild.py --quick        # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ngramcache import CountTable, NgramClient, StaticCache, build_static_from_tokens, replay
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, static_files_pb2, static_files_pb2_grpc
from ngramcache.client.kernel.tokenizer import load_tokenizer

NS = "bench"


def stdlib_tokens(max_files: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts))[:max_files]
    tok = load_tokenizer("tiktoken:cl100k_base")
    ids = tok.encode_batch([p.read_text(encoding="utf-8", errors="replace") for p in files])
    train = [t.astype(np.int32) for i, t in enumerate(ids) if i % 20]
    held = np.concatenate([t for i, t in enumerate(ids) if i % 20 == 0]).astype(np.int32)
    return train, held


def start_service(data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", "ngramcache.cache_service.cli", "serve", "--port", "0", "--data-dir",
                          str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    m = re.search(r"listening on (127\.0\.0\.1:\d+)", p.stdout.readline())
    if not m:
        raise SystemExit("the service did not start")
    return p, m.group(1)


def publish(address: str, path: Path) -> int:
    data = path.read_bytes()
    generation = StaticCache.open(path).generation

    def chunks():  # type: ignore[no-untyped-def]
        yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
            namespace=NS, generation=generation, size=len(data), sha256=hashlib.sha256(data).digest()))
        for i in range(0, len(data), 1 << 20):
            yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=i, data=data[i:i + (1 << 20)]))

    with grpc.insecure_channel(address) as ch:
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(chunks(), timeout=120)
    return generation


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet-tokens", type=int, default=1_000_000, help="tokens the fleet pushes (default 1,000,000)")
    ap.add_argument("--corpus-tokens", type=int, default=1_000_000, help="tokens of the published corpus (default 1M)")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script in seconds: 200 files, 20,000 fleet and 20,000 corpus tokens (figures meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.fleet_tokens, args.corpus_tokens = 20_000, 20_000

    train, held = stdlib_tokens(200 if args.quick else None)
    fleet, corpus, n = [], [], 0
    for t in train:
        (fleet if n < args.fleet_tokens else corpus).append(t)
        n += len(t)
        if n >= args.fleet_tokens + args.corpus_tokens:
            break
    print(f"fleet traffic {sum(map(len, fleet)):,} tokens, corpus {sum(map(len, corpus)):,} tokens, "
          f"held out {len(held):,} tokens (CPython standard library, cl100k)")
    tok = load_tokenizer("tiktoken:cl100k_base")
    tmp = Path(tempfile.mkdtemp(prefix="ngc-bench-rebuild-"))
    service, address = start_service(tmp / "data")
    try:
        with grpc.insecure_channel(address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                name=NS, tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size), timeout=30)
        t0 = time.perf_counter()
        print("pushing the fleet's counts through an NgramClient...", flush=True)
        with NgramClient(address, NS, tok, cache_dir=tmp / "cache") as client:
            for k, t in enumerate(fleet):
                client.drafter().accept(k, t)
                client.drafter().reset(k)
                time.sleep(len(t) / 50_000)  # a fleet's pace (50k tokens/s), not a burst past the push buffer
            last = time.monotonic()
            time.sleep(1.0)  # the client drains what was accepted every push_interval (0.1 s)
            while client.stats()["pending_rows"] or client.stats()["acked_count"] < client.stats()["drained_count"]:
                if client.stats()["dropped_rows"]:
                    raise SystemExit("the client dropped rows (push buffer full): pace the accepts")
                time.sleep(0.1)
                if time.monotonic() - last > 10:
                    s = client.stats()
                    print(f"  pushing: {s['acked_rows']:,} rows acknowledged, {s['pending_rows']:,} pending", flush=True)
                    last = time.monotonic()
            stats = client.stats()
        print(f"pushed {stats['acked_rows']:,} rows ({stats['acked_count']:,} counts) in {time.perf_counter() - t0:.1f} s; "
              f"dropped {stats['dropped_rows']:,}")

        next_gen = [1]

        def corpus_generation() -> None:
            path = tmp / f"corpus-{next_gen[0]}.ngc"
            build_static_from_tokens(corpus, str(path), vocab_size=tok.vocab_size, ngram_size=2,
                                     fingerprint=tok.fingerprint, generation=next_gen[0])
            publish(address, path)
            next_gen[0] += 1

        def rebuild(label: str, *, with_corpus: bool = False, **fields: object) -> tuple[str, Path | None]:
            # The corpus is the namespace's base once published: "counts" rows drop it (skip_base), "counts +
            # corpus" rows publish it again first (a rebuild folds the base by default).
            if with_corpus:
                corpus_generation()
            if label == "corpus only (published)":
                corpus_generation()
                return label, tmp / "data" / "static" / NS / f"{next_gen[0] - 1:020d}.ngc"
            with grpc.insecure_channel(address) as ch:
                status = admin_pb2_grpc.AdminStub(ch).StartRebuild(
                    admin_pb2.StartRebuildRequest(namespace=NS, wait=True, keep=100, skip_base=not with_corpus,
                                                  **fields), timeout=600)
            if status.state != "done":
                raise SystemExit(f"rebuild {label} failed: {status.error}")
            next_gen[0] = status.generation + 1
            return label, tmp / "data" / "static" / NS / f"{status.generation:020d}.ngc"

        variants = [
            ("no static cache", None),
            rebuild("corpus only (published)"),
            rebuild("counts alone (--no-base), min count 1"),
            rebuild("counts, min count 2", min_count=2),
            rebuild("counts, min count 4", min_count=4),
            rebuild("counts, 3-gram keys", ngram_size=3),
            rebuild("counts + corpus base (the default)", with_corpus=True),
            rebuild("counts + corpus base, decay 0.25", with_corpus=True, decay=0.25),
        ]
        print("\nreplay of the held-out files (llama-lookup-stats protocol, n_ctx 4096, n_draft 8):")
        print(f"{'static cache':<40}{'file MB':>9}{'keys':>11}{'drafted':>10}{'accepted':>10}{'accept %':>10}"
              f"{'us/drafted':>12}")
        for label, path in variants:
            cache = StaticCache.open(path) if path is not None else None
            r = replay(held, 4096, 8, 1, 4, cache, CountTable())
            size = f"{cache.file_size / 1e6:.2f}" if cache else "-"
            keys = f"{cache.n_keys:,}" if cache else "-"
            print(f"{label:<40}{size:>9}{keys:>11}{r['n_drafted']:>10,}{r['n_accept']:>10,}"
                  f"{100 * r['n_accept'] / max(r['n_drafted'], 1):>10.1f}{r['t_draft_ns'] / 1e3 / max(r['n_drafted'], 1):>12.3f}")
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(30)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
