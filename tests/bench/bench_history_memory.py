"""Redis memory per stored fleet-history token, and append/read rates (prints figures; not a test).

    python tests/bench/bench_history_memory.py [--tokens 100000] [--min 8] [--max 64] [--clients 64]
    python tests/bench/bench_history_memory.py --quick     # checks the script (10,000 tokens; figures meaningless)

It starts its own redis-server on 127.0.0.1 (no persistence), appends ``--tokens`` tokens
in records of ``--min``..``--max`` tokens (uniform, seed 0) from ``--clients`` senders, 16
records a batch, with a budget large enough to keep them all, and prints:

* MEMORY USAGE of the namespace's stream (SAMPLES 0: every node counted) and of the other
  history keys, per stored token;
* the growth of ``used_memory`` (INFO memory) over the load, per stored token;
* records appended per second (one EVALSHA a batch, one process) and records read per
  second (pages of 1024);
* a checksum of what was read back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for redis_servers

from helpers.redis_servers import RedisServer

from ngramcache.cache_service.counts import schema
from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.history import HistoryRecord

VOCAB = 128_256  # Llama 3
FP = bytes(range(32))
PER_BATCH = 16


def used_memory(server: RedisServer) -> int:
    client = server.client()
    try:
        client.execute_command("MEMORY", "PURGE")
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--min", type=int, default=8)
    parser.add_argument("--max", type=int, default=64)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="checks the script: 10,000 tokens (figures meaningless)")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 10_000
    rng = np.random.default_rng(0)
    records: list[HistoryRecord] = []
    total = 0
    while total < args.tokens:
        n = int(rng.integers(args.min, args.max + 1))
        tokens = rng.integers(0, VOCAB, n, dtype=np.int32)
        records.append(HistoryRecord("", int(rng.integers(0, 2**62)), f"g{len(records) // 8}",
                                     int(rng.integers(1, 4096)), tokens))
        total += n
    with RedisServer() as server:
        store = open_counts_store(server.url, history_max_bytes=1 << 40, history_max_age=1e6)
        try:
            store.create_namespace("mem", FP, VOCAB)
            store.append_history("mem", "warm-up", 1, records[:1])  # creates the keys, loads the script
            base = used_memory(server)
            start = time.perf_counter()
            batch_seq = 1
            for i in range(1, len(records), PER_BATCH):
                client = f"client-{(i // PER_BATCH) % args.clients:03d}-{'x' * 24}"  # ~36 chars, as a UUID
                batch_seq += 1
                store.append_history("mem", client, batch_seq, records[i:i + PER_BATCH])
            append_s = time.perf_counter() - start
            grown = used_memory(server) - base
            stats = store.history_stats("mem")
            redis = server.client()
            try:
                usage = {key.rsplit(":", 1)[1]: int(redis.execute_command("MEMORY", "USAGE", key, "SAMPLES", 0) or 0)
                         for key in schema.history_keys(store.config.prefix, "mem")}
            finally:
                redis.close()
            start = time.perf_counter()
            after, read, crc = "", 0, 0
            while True:
                page = store.read_history("mem", after, 1024)
                if not page.records:
                    break
                for record in page.records:
                    crc = zlib.crc32(record.tokens.tobytes(), crc)
                read += len(page.records)
                after = page.cursor
            read_s = time.perf_counter() - start
        finally:
            store.close()
    tokens = stats["tokens"]
    print(f"records {stats['records']}, tokens {tokens} ({args.min}..{args.max} a record, "
          f"mean {tokens / stats['records']:.1f}), {args.clients} senders, {PER_BATCH} records a batch")
    print(f"MEMORY USAGE stream: {usage['hist']} bytes = {usage['hist'] / tokens:.2f} bytes/token "
          f"({usage['hist'] / stats['records']:.1f} bytes/record)")
    others = {k: v for k, v in usage.items() if k != "hist"}
    print(f"MEMORY USAGE other history keys: {others}")
    print(f"used_memory growth: {grown} bytes = {grown / tokens:.2f} bytes/token")
    print(f"append: {len(records) / append_s:,.0f} records/s ({tokens / append_s:,.0f} tokens/s)")
    print(f"read: {read / read_s:,.0f} records/s; checksum {crc:08x}")


if __name__ == "__main__":
    main()
