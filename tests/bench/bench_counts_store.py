"""Benchmark of the Redis counts store against baselines measured in the same run (prints figures; not a test).

    python tests/bench/bench_counts_store.py [--reps 3] [--deltas 1048576] [--entries 4000000]
    python tests/bench/bench_counts_store.py --quick     # checks the script (seconds; figures meaningless)

It starts its own redis-server on 127.0.0.1 (no persistence) and prints, as medians of the
repetitions:

* raw delta rows/s ingested from one process with `apply_group`, the store's one write path
  (exactly-once Lua units; groups of 4 batches of 16,384 rows from 4 senders, the largest
  group the service forms), against pipelined plain HINCRBYs (no dedup, no change
  tracking: the strongest fair baseline, the headline ratio) and, as context only, one
  HINCRBY round trip per entry (a naive client). The baselines get their keys, fields and
  summed counts precomputed outside the clock (`encode_group` sums repeated keys of a group
  as `apply_group` does), so they pay for nothing but Redis; every row of the table is
  rated in raw delta rows (an entry's count is the number of count-1 rows it stands for),
  never in entries;
* bytes of Redis memory per stored (n-gram, follower) entry after a large load
  (``used_memory`` from INFO memory, before and after);
* milliseconds of `changes_since` for a version behind which exactly 1000 buckets changed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for redis_servers

from helpers.redis_servers import RedisServer

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.layout import encode_batch, encode_group
from ngramcache.cache_service.counts.redis_backend import RedisCountsStore
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem, ItemOutcome
from ngramcache.client.kernel.rows import COUNT, DELTA_DTYPE, FOLLOWER, NGRAM_MAX, ROW_WIDTH, TOKENS, N

VOCAB = 128_256  # Llama 3: 3-byte tokens
FP = bytes(range(32))
BATCH = 16_384
GROUP = 4  # batches a group: 65,536 rows, the service's largest group (push_group_rows' default)


def make_deltas(rng: np.random.Generator, m: int, zipf: float = 1.2) -> np.ndarray:
    """m delta rows: n in 1..4, Zipf-distributed tokens (repeated keys, as real text gives)."""
    n = rng.integers(1, NGRAM_MAX + 1, m)
    toks = (rng.zipf(zipf, (m, NGRAM_MAX + 1)) - 1) % VOCAB
    out = np.empty((m, ROW_WIDTH), dtype=DELTA_DTYPE)
    out[:, N] = n
    out[:, TOKENS] = np.where(np.arange(NGRAM_MAX)[None, :] < n[:, None], toks[:, :NGRAM_MAX], -1)
    out[:, FOLLOWER] = toks[:, NGRAM_MAX]
    out[:, COUNT] = 1
    return out


def raw_deltas_per_second(counts: np.ndarray | list[int], seconds: float) -> float:
    """Raw delta rows per second for (n-gram, follower) entries or rows with these counts applied in `seconds`.

    The benchmark's rows all have count 1 (make_deltas), so a row or an entry that `encode_batch`
    summed from k repeated rows counts k: `apply_group` (fed rows) and the baselines (fed summed
    entries) are rated in the same unit."""
    return float(np.sum(counts, dtype=np.int64)) / seconds


def groups_of(deltas: np.ndarray, sender: str) -> list[list[GroupItem]]:
    """The rows in batches of BATCH rows, GROUP batches a group, each batch from one of GROUP senders."""
    items = [GroupItem(f"{sender}-{k % GROUP}", k // GROUP, np.ascontiguousarray(deltas[i:i + BATCH]))
             for k, i in enumerate(range(0, len(deltas), BATCH))]
    return [items[g:g + GROUP] for g in range(0, len(items), GROUP)]


def apply_groups(store: RedisCountsStore, ns: str, groups: list[list[GroupItem]]) -> list[ItemOutcome]:
    return [outcome for group in groups for outcome in store.apply_group(ns, group)]


def used_memory(server: RedisServer) -> int:
    client = server.client()
    try:
        client.execute_command("MEMORY", "PURGE")
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def bench_ingest(store: RedisCountsStore, server: RedisServer, rep: int, deltas: np.ndarray,
                 naive_entries: int = 15_000) -> dict[str, float]:
    ns = f"ingest-{rep}"
    store.create_namespace(ns, FP, VOCAB, buckets=16_384)
    groups = groups_of(deltas, f"bench-{rep}")
    warm_up = deltas[:2 * BATCH]
    apply_groups(store, ns, groups_of(warm_up, "warm-up"))  # loads scripts, warms connections and caches
    start = time.perf_counter()
    results = apply_groups(store, ns, groups)
    grouped = raw_deltas_per_second(deltas[:, COUNT], time.perf_counter() - start)
    assert all(isinstance(r, ApplyResult) and r.applied == r.units for r in results)
    total = sum(int(chunk[:, COUNT].sum()) for chunk in store.export(ns))
    expected = int(deltas[:, COUNT].sum()) + int(warm_up[:, COUNT].sum())
    assert total == expected, (total, expected)

    # Baselines over the same groups, each summed by encode_group as apply_group sums it: keys, fields and
    # counts precomputed outside the clock, so they pay for nothing but Redis.
    info = store.namespace_info(ns)
    handle = store._handle(ns)
    keys: list[str] = []
    fields: list[bytes] = []
    counts: list[int] = []
    for group in groups:
        enc = encode_group([item.deltas for item in group], info).batch
        keys += [handle.shards[b % info.shards].bucket(b) for b in enc.buckets.tolist()]
        fields += enc.field_list()
        counts += enc.counts.tolist()
    client = server.client()
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, (key, field, count) in enumerate(zip(keys, fields, counts)):
        pipe.hincrby("plain:" + key, field, count)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    plain = raw_deltas_per_second(counts, time.perf_counter() - start)
    naive_n = min(len(keys), naive_entries)
    start = time.perf_counter()
    for key, field, count in zip(keys[:naive_n], fields[:naive_n], counts[:naive_n]):
        client.hincrby("naive:" + key, field, count)
    naive = raw_deltas_per_second(counts[:naive_n], time.perf_counter() - start)
    client.close()
    store.drop_namespace(ns)
    flush = server.client()
    flush.flushall()
    flush.close()
    return {"grouped": grouped, "naive": naive, "plain_pipelined": plain, "checksum": total,
            "rows_per_entry": len(deltas) / len(keys), "naive_entries": naive_n}


def bench_memory(store: RedisCountsStore, server: RedisServer, entries_target: int, seed: int) -> dict[str, float]:
    ns = f"memory-{seed}"
    rng = np.random.default_rng(seed)
    before = used_memory(server)
    store.create_namespace(ns, FP, VOCAB, buckets=65_536)
    deltas = make_deltas(rng, int(entries_target * 1.3), zipf=1.05)  # flatter: mostly distinct entries
    apply_groups(store, ns, groups_of(deltas, "loader"))
    entries = sum(len(chunk) for chunk in store.export(ns))
    after = used_memory(server)
    client = server.client()
    encodings = {client.object("encoding", k) for k in client.scan_iter(match="ngc:*", count=1000, _type="hash")}
    client.close()
    store.drop_namespace(ns)
    return {"bytes_per_entry": (after - before) / entries, "entries": entries,
            "per_bucket": entries / 65_536, "encodings": sorted(e.decode() for e in encodings)}


def bench_changes(store: RedisCountsStore, seed: int, loaded: int = 2_000_000) -> dict[str, float]:
    ns = f"changes-{seed}"
    info = store.create_namespace(ns, FP, VOCAB, buckets=65_536)
    rng = np.random.default_rng(seed)
    apply_groups(store, ns, groups_of(make_deltas(rng, loaded, zipf=1.05), "loader"))
    # A batch that touches exactly 1000 buckets: one new 1-gram row per bucket.
    candidates = make_deltas(rng, 200_000, zipf=1.05)
    candidates = candidates[candidates[:, N] == 1]
    enc_buckets = encode_batch(np.ascontiguousarray(candidates), info)
    _, first = np.unique(enc_buckets.buckets, return_index=True)
    picked = enc_buckets.buckets[first[:1000]]
    rows = []
    for b in picked.tolist():
        i = int(np.flatnonzero(enc_buckets.buckets == b)[0])
        field = enc_buckets.field_matrix[i, :enc_buckets.lengths[i]].tobytes()
        t0, f = int.from_bytes(field[:3], "little"), int.from_bytes(field[3:6], "little")
        rows.append([1, t0, -1, -1, -1, f, 1])
    store.changes_since(ns, store.version(ns))  # load the scripts
    time.sleep(0.01)
    version = store.version(ns)
    store.apply_group(ns, [GroupItem("changer", 0, np.array(rows, dtype=np.int32))])
    start = time.perf_counter()
    change = store.changes_since(ns, version)
    elapsed = time.perf_counter() - start
    assert len(change.buckets) == 1000, len(change.buckets)
    store.drop_namespace(ns)
    return {"ms": elapsed * 1000, "rows": len(change.rows)}


def ingest_lines(grouped: float, plain: float, naive: float, n_deltas: int, rows_per_entry: float) -> list[str]:
    """The ingest rows of the report, all in raw delta rows/s; the headline ratio is against pipelined plain
    HINCRBY (the strongest fair baseline), the one-round-trip-per-entry client only context."""
    rows = [
        ("apply_group (exactly-once, groups summed)", grouped,
         f"({n_deltas:,} deltas in groups of {GROUP} batches of {BATCH:,})"),
        ("baseline: plain HINCRBY pipelined (no dedup, no change tracking)", plain,
         f"apply_group {grouped / plain:.2f}x"),
        ("context only: one HINCRBY round trip per entry (a naive client)", naive,
         f"apply_group {grouped / naive:.1f}x"),
    ]
    return [f"  ingest, every row rated in raw delta rows/s (the baselines send summed entries, "
            f"{rows_per_entry:.3f} raw rows an entry):"] + [
        f"  {label + ':':<66} {rate:>10,.0f} deltas/s   {note}" for label, rate, note in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--deltas", type=int, default=1 << 20, help="deltas ingested per repetition")
    parser.add_argument("--entries", type=int, default=4_000_000, help="entries loaded for the memory figure")
    parser.add_argument("--quick", action="store_true",
                        help="checks the script in seconds: 1 repetition, 32,768 deltas, 30,000 entries (figures meaningless)")
    args = parser.parse_args()
    naive_entries, changes_loaded = 15_000, 2_000_000
    if args.quick:
        args.reps, args.deltas, args.entries = 1, 1 << 15, 30_000
        naive_entries, changes_loaded = 1_000, 20_000
    rng = np.random.default_rng(20240601)
    deltas = make_deltas(rng, args.deltas)
    with RedisServer() as server:
        store = open_counts_store(server.url, socket_timeout=60)
        assert isinstance(store, RedisCountsStore)
        ingest, memory, changes = [], [], []
        for rep in range(args.reps):
            ingest.append(bench_ingest(store, server, rep, deltas, naive_entries))
            memory.append(bench_memory(store, server, args.entries, seed=rep))
            changes.append(bench_changes(store, seed=100 + rep, loaded=changes_loaded))
            print(f"rep {rep}: {ingest[-1]['grouped']:,.0f} deltas/s apply_group, "
                  f"{ingest[-1]['plain_pipelined']:,.0f} plain pipelined, {ingest[-1]['naive']:,.0f} naive, "
                  f"{memory[-1]['bytes_per_entry']:.1f} B/entry, changes_since {changes[-1]['ms']:.1f} ms", flush=True)
        store.close()
    med = statistics.median
    print()
    print(f"redis-server {server.server_bin}, {args.reps} repetitions, medians"
          + (" (--quick: figures meaningless)" if args.quick else "") + ":")
    for line in ingest_lines(med(r["grouped"] for r in ingest), med(r["plain_pipelined"] for r in ingest),
                             med(r["naive"] for r in ingest), len(deltas), med(r["rows_per_entry"] for r in ingest)):
        print(line)
    print(f"  memory: {med(r['bytes_per_entry'] for r in memory):.1f} bytes per stored entry "
          f"({med(r['entries'] for r in memory):,.0f} entries, {med(r['per_bucket'] for r in memory):.0f} a bucket, "
          f"encodings {memory[0]['encodings']})")
    print(f"  changes_since with 1000 changed buckets: {med(r['ms'] for r in changes):.1f} ms "
          f"({med(r['rows'] for r in changes):,.0f} rows)")
    print(f"  checksum (sum of counts ingested per rep): {ingest[0]['checksum']}")


if __name__ == "__main__":
    main()
