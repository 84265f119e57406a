"""A sibling's output behind a deep history backlog: how long until a client drafts it, with and without group-first pulls.

A client that falls behind the namespace's history tail (a cold start, a budget, a burst of
many clients) reads the backlog oldest first; without group-first pulls, what a sibling of its
own live sequence just wrote waits behind every unrelated record. The benchmark builds that on
a real service (`ServiceThread` on loopback, embedded store): `--backlog` unrelated records
(8 random tokens each, each in a group of its own) pushed first, then a sibling's 64 tokens in
group "g1"; then a match-mode `NgramClient` starts cold with a small tail page and a bytes/s
budget (`--page`, `--rate`: a deep backlog in miniature), marks its sequence as group "g1",
and the benchmark times until its drafter drafts the sibling's continuation token for token.
Once with `history_groups_per_pull` at its default (8), once at 0 (the tail alone), and once
for the service's own match drafter (a `RemoteDrafter` session in the match mode: the replica
reads the store itself, 4096 records a read, no page or budget, so it needs no group-first
pulls), `--trials` times each; prints the medians and the tail records pulled by then.

    python tests/bench/bench_history_groups.py             # 600 records, page 8, 4000 B/s, 3 trials
    python tests/bench/bench_history_groups.py --backlog 20000 --drafters service
    python tests/bench/bench_history_groups.py --quick     # checks the script (seconds; figures meaningless)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from helpers.service import ServiceThread

from ngramcache import Drafter, NgramClient, RemoteDrafter
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import tokens_to_bytes

FP, VOCAB, SIBLING = b"\x05" * 32, 1000, 64


def record(seq: int, tokens: np.ndarray, offset: int = 0, group: str = "") -> counts_pb2.HistoryRecord:
    return counts_pb2.HistoryRecord(seq=seq, group=group, offset=offset, tokens=tokens_to_bytes(tokens.astype(np.int32)))


def fill(address: str, seed: int, backlog: int) -> np.ndarray:
    """Creates namespace "m", pushes `backlog` unrelated records then a sibling's tokens in group "g1"; returns those."""
    with grpc.insecure_channel(address) as channel:
        admin_pb2_grpc.AdminStub(channel).CreateNamespace(admin_pb2.CreateNamespaceRequest(
            name="m", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        counts = counts_pb2_grpc.CountsStub(channel)
        rng = np.random.default_rng(seed)
        for batch, start in enumerate(range(0, backlog, 200)):
            counts.PushHistory(counts_pb2.PushHistoryRequest(
                namespace="m", tokenizer_fingerprint=FP, client_id="others", seq=batch,
                records=[record(i, rng.integers(0, VOCAB, 8), group=f"r{i}")
                         for i in range(start, min(start + 200, backlog))]), timeout=30)
        sibling = rng.integers(0, VOCAB, SIBLING).astype(np.int32)
        counts.PushHistory(counts_pb2.PushHistoryRequest(
            namespace="m", tokenizer_fingerprint=FP, client_id="sibling", seq=0,
            records=[record(1, sibling[i:i + 16], i, "g1") for i in range(0, SIBLING, 16)]), timeout=10)
    return sibling


def wait_draftable(drafter: Drafter | RemoteDrafter, sibling: np.ndarray, timeout: float) -> float:
    """Seconds until `drafter` drafts the sibling's continuation of its first 24 tokens, token for token."""
    t0 = time.monotonic()
    want = sibling[24:32].tolist()
    while drafter.draft(5, sibling[:24], 8).tolist() != want:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the sibling's tokens were not draftable after {timeout:g} s")
        time.sleep(0.005)
    return time.monotonic() - t0


def trial(seed: int, groups_per_pull: int, args: argparse.Namespace) -> tuple[float, int]:
    """Seconds from the client's start to the sibling's continuation drafted, and tail records pulled by then.

    groups_per_pull < 0: no client; the service's own match drafter, through a RemoteDrafter
    session (it reads the store itself, no page or budget), and the records it was fed."""
    with tempfile.TemporaryDirectory(prefix="ngc-bench-groups-") as tmp_name:
        tmp = Path(tmp_name)
        with ServiceThread(tmp / "data", counts=f"embedded://{tmp / 'c.snap'}?epoch_seconds=0") as service:
            address = f"127.0.0.1:{service.port}"
            sibling = fill(address, seed, args.backlog)
            if groups_per_pull < 0:
                with RemoteDrafter(address, "m", (FP, VOCAB), mode="match", timeout=args.timeout) as remote:
                    seconds = wait_draftable(remote, sibling, args.timeout)
                    # The records the replica's tail had read (and fed the drafter) by then, less the one its
                    # own session published (the drafted sequence); read across threads, for a figure only.
                    ring = list(service.service.replica_history.tails.tails["m"].ring)
                    return seconds, sum(not r.client_id.startswith("replica:") for r in ring)
            with NgramClient(address, "m", (FP, VOCAB), cache_dir=tmp / "cache", mode="match",
                             history_pull_records=args.page, history_max_bytes_per_s=args.rate,
                             history_groups_per_pull=groups_per_pull) as client:
                drafter = client.drafter()
                client.set_group(5, "g1")
                seconds = wait_draftable(drafter, sibling, args.timeout)
                return seconds, int(client.stats()["history_pulled_records"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--backlog", type=int, default=600, help="unrelated records ahead of the sibling's (default 600)")
    ap.add_argument("--page", type=int, default=8, help="the client's history_pull_records (default 8)")
    ap.add_argument("--rate", type=int, default=4000, help="the client's history_max_bytes_per_s (default 4000)")
    ap.add_argument("--trials", type=int, default=3, help="trials per setting; figures are medians (default 3)")
    ap.add_argument("--timeout", type=float, default=120.0, help="give a trial up after this many seconds")
    ap.add_argument("--drafters", default="8,0,service",
                    help="which to time: a client with this history_groups_per_pull, or 'service' (default 8,0,service)")
    ap.add_argument("--quick", action="store_true", help="checks the script in seconds: a backlog of 40 records, 1 trial")
    args = ap.parse_args(argv)
    if args.quick:
        args.backlog, args.trials = 40, 1
    try:
        order = [-1 if d == "service" else int(d) for d in args.drafters.split(",") if d]
    except ValueError:
        ap.error(f"--drafters takes numbers >= 0 and 'service', got {args.drafters!r}")
    if not order or min(order) < -1:
        ap.error(f"--drafters takes numbers >= 0 and 'service', got {args.drafters!r}")
    if args.backlog < 0 or args.page < 1 or args.rate < 0 or args.trials < 1:
        ap.error("--backlog >= 0, --page >= 1, --rate >= 0 and --trials >= 1")
    print(f"backlog {args.backlog} records of 8 tokens, then a sibling's {SIBLING}; client page {args.page} records, "
          f"budget {args.rate or 'unlimited'} B/s; {args.trials} trials")
    print("| drafter | seconds to draftable (median) | each trial | tail records pulled by then |")
    print("|---|---:|---|---:|")
    names = {8: "client, history_groups_per_pull 8 (default)", 0: "client, history_groups_per_pull 0 (tail alone)",
             -1: "the service's own (RemoteDrafter, match mode)"}
    try:
        for groups_per_pull in order:
            runs = [trial(seed, groups_per_pull, args) for seed in range(args.trials)]
            secs = [s for s, _ in runs]
            print(f"| {names.get(groups_per_pull, f'client, history_groups_per_pull {groups_per_pull}')} | {statistics.median(secs):.3f} | {', '.join(f'{s:.2f}' for s in secs)} | "
                  f"{statistics.median(n for _, n in runs):.0f} of {args.backlog + SIBLING // 16} |", flush=True)
    except (TimeoutError, grpc.RpcError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
