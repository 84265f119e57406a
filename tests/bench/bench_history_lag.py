"""Fleet history lag: from a token accepted on one client to it being draftable on another, through a real service.

Starts `ngramcache serve` as its own process on loopback (embedded counts store; with
``--redis``, a redis-server of its own behind it) and two match-mode `NgramClient`s with the
default history intervals. Each trial, client B first accepts the opening of a fresh random
sequence (so its drafter knows where it stands); then client A accepts the whole sequence
(its prompt, then what it "generated"), and the benchmark times until B's drafter drafts
the continuation of that opening token for token, checking every millisecond. Random tokens
over a 50k vocabulary: only A's sequence can draft it, so the time measured is the fleet
history's path (A's publisher -> PushHistory -> store -> the replica's tail -> B's long poll
-> B's drafter). Prints p50/p99/max (ms), the bytes B pulled per record and per token, and
a checksum of the drafts.

    python tests/bench/bench_history_lag.py                 # 200 trials, embedded store
    python tests/bench/bench_history_lag.py --redis         # the same over a local redis-server
    python tests/bench/bench_history_lag.py --quick         # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for redis_servers

from helpers.redis_servers import RedisServer

from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc

FP = hashlib.sha256(b"bench-history-lag").digest()
VOCAB = 50_000
SERVE = [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())", "serve"]


def start_service(data_dir: Path, counts: str | None) -> tuple[subprocess.Popen[str], int]:
    cmd = [*SERVE, "--port", "0", "--data-dir", str(data_dir), *(["--counts", counts] if counts else [])]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"the service did not start: {line!r}")
    return p, int(m.group(1))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(address: str, args: argparse.Namespace, tmp: Path) -> None:
    ch = grpc.insecure_channel(address)
    admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
        name="lag", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=30)
    ch.close()
    rng = np.random.default_rng(args.seed)
    options = {"mode": "match", "connect_timeout": 10.0, "ready_timeout": 30.0}
    with NgramClient(address, "lag", (FP, VOCAB), cache_dir=tmp / "a", **options) as a, \
            NgramClient(address, "lag", (FP, VOCAB), cache_dir=tmp / "b", **options) as b:
        da, db = a.drafter(), b.drafter()
        lags: list[float] = []
        checksum = hashlib.sha256()
        misses = 0
        for trial in range(args.warmup + args.trials):
            text = rng.integers(0, VOCAB, args.prompt + args.generated, dtype=np.int32)
            cut = args.prompt + args.generated // 2
            want = text[cut:cut + args.draft].tolist()
            db.accept(2 * trial + 1, text[:cut])
            started = time.perf_counter()
            da.accept(2 * trial, text[:args.prompt])
            da.accept(2 * trial, text)
            drafted: list[int] = []
            while time.perf_counter() - started < args.timeout:
                drafted = db.draft(2 * trial + 1, text[:cut], args.draft).tolist()
                if drafted == want:
                    break
                time.sleep(0.001)
            took = (time.perf_counter() - started) * 1000
            da.reset(2 * trial)
            db.reset(2 * trial + 1)
            if trial < args.warmup:
                continue
            if drafted != want:
                misses += 1
                continue
            lags.append(took)
            checksum.update(np.asarray(drafted, dtype=np.int32).tobytes())
        sb = b.stats()
    print(f"trials {args.trials} (after {args.warmup} warm-up), {args.prompt}+{args.generated} tokens each, "
          f"drafting {args.draft} tokens; misses (not draftable within {args.timeout:g} s): {misses}")
    if lags:
        print(f"accept on A -> draftable on B: p50 {quantile(lags, 0.5):.1f} ms, p99 {quantile(lags, 0.99):.1f} ms, "
              f"max {max(lags):.1f} ms, mean {sum(lags) / len(lags):.1f} ms")
    records, tokens, nbytes = sb["history_pulled_records"], sb["history_pulled_tokens"], sb["history_pulled_bytes"]
    print(f"B pulled {records} records, {tokens} tokens, {nbytes} bytes: {nbytes / max(records, 1):.1f} bytes a record, "
          f"{nbytes / max(tokens, 1):.2f} bytes a token; store-to-B lag p50 {sb['history_lag_ms_p50'] or 0:.1f} ms, "
          f"p99 {sb['history_lag_ms_p99'] or 0:.1f} ms")
    print(f"checksum {checksum.hexdigest()[:16]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=16, help="tokens of each sequence's prompt (default 16)")
    ap.add_argument("--generated", type=int, default=48, help="tokens it generates (default 48)")
    ap.add_argument("--draft", type=int, default=8, help="tokens B must draft (default 8)")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds a trial waits (default 5)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--redis", action="store_true", help="run the service over a local redis-server")
    ap.add_argument("--quick", action="store_true", help="checks the script in seconds: 5 trials after 1 warm-up")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.warmup = 5, 1
    tmp = Path(tempfile.mkdtemp(prefix="ngc-bench-history-"))
    redis_server = RedisServer() if args.redis else None
    try:
        url = redis_server.__enter__().url if redis_server is not None else None
        service, port = start_service(tmp / "data", url)
        try:
            print(f"service: {'redis ' + url if url else 'embedded store'}, 127.0.0.1:{port}")
            run(f"127.0.0.1:{port}", args, tmp)
        finally:
            service.terminate()
            service.wait(30)
    finally:
        if redis_server is not None:
            redis_server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
