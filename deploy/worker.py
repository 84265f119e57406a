"""A demo inference worker for deployments: drafts with NgramClient against a running service and prints what it gets.

It stands in for an LLM worker: the "model" is text already known (the Python standard
library's source files, as byte tokens), so each step drafts from the synced cache, accepts
the drafted tokens the text confirms plus the model's own next token, and pushes what it
accepted through the service. Every few seconds it prints one line of figures; the
acceptance rate climbs as the counts it (and any other worker on the namespace) pushed come
back through the mirror.

    python worker.py --address ngramcache:50051 --namespace demo --create

Stops on SIGTERM or Ctrl-C (or after --seconds), flushing its pushes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from ngramcache import UNTAGGED, NamespaceNotFoundError, NgramCacheError, NgramClient

VOCAB = 256  # byte tokens: no tokenizer to ship, and the namespace says so (UNTAGGED)


def corpus(folder: Path) -> Iterator[Path]:
    """The .py files under `folder`, in a fixed order, forever."""
    files = sorted(p for p in folder.rglob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"worker: no .py files under {folder}")
    while True:
        yield from files


def create_namespace(address: str, namespace: str, token: str | None) -> None:
    """Creates the namespace for byte tokens unless it exists (needs the admin role when the service has tokens)."""
    from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        try:
            admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=namespace, tokenizer_fingerprint=UNTAGGED,
                                                                   vocab_size=VOCAB),
                                  timeout=30, metadata=metadata, wait_for_ready=True)
            print(f"worker: created namespace {namespace}", flush=True)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise SystemExit(f"worker: creating namespace {namespace}: {e.code().name}: {e.details()}") from None


def replay_file(drafter, seq: int, tokens: np.ndarray, n_ctx: int, n_draft: int) -> tuple[int, int, int]:
    """Generates `tokens` as a model would with drafts: returns (drafted, accepted, generated)."""
    drafted = accepted = generated = 0
    for start in range(0, len(tokens) - 1, n_ctx):
        chunk = tokens[start:start + n_ctx]
        truth = chunk.tolist()
        n = 1
        drafter.accept(seq, chunk[:1])
        while n < len(truth):
            draft = drafter.draft(seq, chunk[:n], n_draft).tolist()[: len(truth) - n]
            ok = 0
            while ok < len(draft) and draft[ok] == truth[n + ok]:
                ok += 1
            drafted += len(draft)
            accepted += ok
            n = min(n + ok + 1, len(truth))  # the accepted draft tokens and the model's own next token
            drafter.accept(seq, chunk[:n])
        generated += len(truth) - 1
        drafter.reset(seq)
    return drafted, accepted, generated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="HOST:PORT of the service (plaintext gRPC)")
    p.add_argument("--namespace", default="demo", help="the cache namespace (default demo)")
    p.add_argument("--create", action="store_true", help="create the namespace (byte tokens) when it does not exist")
    p.add_argument("--token", default=os.environ.get("NGC_TOKEN") or None,
                   help="bearer token (default: $NGC_TOKEN; none)")
    p.add_argument("--text", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="folder of .py files to replay (default: this Python's standard library)")
    p.add_argument("--cache-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ngramcache-worker"),
                   help="where fetched generations are kept (default $TMPDIR/ngramcache-worker)")
    p.add_argument("--n-ctx", type=int, default=1024, help="tokens per request (default 1024)")
    p.add_argument("--n-draft", type=int, default=8, help="tokens per draft (default 8)")
    p.add_argument("--rate", type=float, default=50_000.0,
                   help="most tokens generated per second, like a busy LLM worker (default 50000; 0: as fast as it can)")
    p.add_argument("--report-every", type=float, default=10.0, help="seconds between two lines of figures (default 10)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default 0: until SIGTERM)")
    args = p.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.create:
        create_namespace(args.address, args.namespace, args.token)
    try:
        client = NgramClient(args.address, args.namespace, (UNTAGGED, VOCAB), cache_dir=args.cache_dir, token=args.token)
    except NamespaceNotFoundError:
        print(f"worker: no namespace {args.namespace} (create it, or pass --create with an admin token)", file=sys.stderr)
        return 1
    except NgramCacheError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 1
    started = time.monotonic()
    deadline = started + args.seconds if args.seconds > 0 else float("inf")
    totals = [0, 0, 0]  # drafted, accepted, generated
    files = reported = 0
    with client:
        drafter = client.drafter()
        print(f"worker: drafting on {args.namespace} at {args.address}, replaying {args.text}", flush=True)
        next_report = started + args.report_every
        for seq, path in enumerate(corpus(args.text), 1):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
            for i, v in enumerate(replay_file(drafter, seq, tokens, args.n_ctx, args.n_draft)):
                totals[i] += v
            files += 1
            if args.rate > 0:  # wait until the generated tokens fit the rate (or it is time to stop)
                stop.wait(max(0.0, min(started + totals[2] / args.rate, deadline) - time.monotonic()))
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + args.report_every
                report(files, totals, client.stats())
                reported = files
        if files != reported:
            report(files, totals, client.stats())
    return 0


def report(files: int, totals: list[int], stats: dict) -> None:
    drafted, accepted, generated = totals
    print(f"worker: {files:,} files, {generated:,} tokens generated, {drafted:,} drafted, {accepted:,} accepted "
          f"({100.0 * accepted / max(drafted, 1):.1f}%), {generated / max(generated - accepted, 1):.2f} tokens/step; "
          f"generation {stats['generation']}, mirror {stats['mirror_rows']:,} rows, pushed {stats['acked_rows']:,} rows "
          f"acknowledged, {stats['dropped_rows']:,} dropped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
