"""The Redis backend's writes: batches and groups encoded into APPLY units, one per shard, sent pipelined, their replies read.

A unit is the entries of one shard of a batch, or of several batches summed (a group), and
is applied by one APPLY script together with every dedup record it carries (see
`redis_scripts`). A reply lost to a timeout, a dropped connection or a server restart (with
``appendonly yes``, which logs a script's effects as one MULTI/EXEC) is therefore retried
safely: the unit is either recorded whole or not at all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import pyroaring

from ngramcache.client.errors import InvalidArgumentError, NgramCacheError

from .config import CountsStoreConfig
from .dedup import batch_too_old
from .layout import EncodedBatch, encode_batch, encode_group
from .redis_connection import RedisConnection
from .redis_handles import Handle, StaleHandle
from .redis_replicas import ReplicaAcks
from .redis_scripts import APPLY, Call
from .values import ApplyResult, GroupItem, ItemOutcome

__all__ = ["RedisWriter"]

_PIPELINE_ROWS: Final = 1 << 16  # rows per pipelined round trip in apply_many (encoding overlaps the previous one)


class RedisWriter:
    """Applies checked batches and groups to a namespace's shards. Thread-safe.

    Args:
        conn: the store's connection.
        config: the store's options (dedup window and its TTL).
        acks: runs the APPLY units, acknowledged by ``config.min_replicas`` replicas.
    """

    def __init__(self, conn: RedisConnection, config: CountsStoreConfig, acks: ReplicaAcks) -> None:
        self._conn = conn
        self._config = config
        self._acks = acks
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # the second round trip in flight

    def close(self) -> None:
        """Wait for the round trips in flight and stop their threads."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def apply_batches(self, handle: Handle, client_id: str,
                      batches: list[tuple[int, np.ndarray]]) -> list[ApplyResult]:
        """Apply checked batches of one sender, each exactly once: one APPLY unit per shard a batch touches.

        Up to two round trips in flight on two connections, so Redis works while we encode the next.

        Raises:
            BatchTooOldError: a batch was older than the dedup window in some shard.
            StaleHandle: the namespace's instance changed.
        """
        results: list[ApplyResult] = []
        inflight: collections.deque[concurrent.futures.Future[list[ApplyResult]]] = collections.deque()
        group: list[tuple[int, EncodedBatch]] = []
        rows = 0
        try:
            for index, (seq, deltas) in enumerate(batches):
                group.append((seq, encode_batch(deltas, handle.info)))
                rows += len(deltas)
                if rows >= _PIPELINE_ROWS or index == len(batches) - 1:
                    calls = self._apply_calls(handle, client_id, group)
                    if len(batches) == 1:
                        return self._finish_apply(calls, group)
                    if len(inflight) == 2:
                        results.extend(inflight.popleft().result())
                    inflight.append(self._executor_submit(self._finish_apply, calls, group))
                    group, rows = [], 0
            while inflight:
                results.extend(inflight.popleft().result())
        finally:
            for future in inflight:  # on an error, let the other round trip finish before returning
                future.cancel() or future.exception()
        return results

    def _executor_submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ngc-redis")
            executor = self._executor
        return executor.submit(fn, *args)

    def _apply_calls(self, handle: Handle, client_id: str,
                     group: list[tuple[int, EncodedBatch]]) -> list[Call]:
        calls: list[Call] = []
        for seq, enc in group:
            bounds = enc.shard_bounds.tolist()
            for s in range(handle.info.shards):
                if bounds[s] != bounds[s + 1]:
                    calls.append(self._unit_call(handle, s, enc, [(client_id, seq)]))
        return calls

    def _unit_call(self, handle: Handle, shard: int, enc: EncodedBatch, batches: Sequence[tuple[str, int]]) -> Call:
        """The APPLY call of shard ``shard``'s entries of ``enc``, which hold the sum of ``batches`` ((client_id, seq)...)."""
        info = handle.info
        bounds = enc.shard_bounds
        sk = handle.shards[shard]
        unit_buckets, args = _unit_args(enc, int(bounds[shard]), int(bounds[shard + 1]), info.shards)
        clients: dict[str, int] = {}
        pairs: list[int] = []
        for client_id, seq in batches:
            pairs += [clients.setdefault(client_id, len(clients) + 1), seq]
        base = sk.base
        keys = [sk.state, sk.changes, *(sk.dedup(c) for c in clients), *(base + str(b) for b in unit_buckets)]
        return (APPLY, keys, [info.instance, self._config.dedup_window, self._config.dedup_ttl_ms, *args,
                               len(clients), *pairs])

    def _finish_apply(self, calls: list[Call], group: list[tuple[int, EncodedBatch]]) -> list[ApplyResult]:
        replies = self._acks.for_counts(calls)
        results = []
        position = 0
        too_old: tuple[int, int] | None = None
        for seq, enc in group:
            units = int(np.count_nonzero(np.diff(enc.shard_bounds)))
            applied = duplicates = 0
            for reply in replies[position:position + units]:
                code = int(reply[0])
                if code == 1:
                    applied += 1
                elif code == -1:
                    raise StaleHandle()
                elif int(reply[1]) == 0:
                    duplicates += 1
                else:
                    too_old = (seq, int(float(reply[2])))
            position += units
            results.append(ApplyResult(units, applied, duplicates, enc.entries))
        if too_old is not None:
            raise batch_too_old(*too_old, self._config.dedup_window)
        return results

    def apply_part(self, handle: Handle, items: list[GroupItem]) -> list[ItemOutcome]:
        """Checked items summed into one unit per shard, all shards pipelined; a unit that found
        some items applied before (or too old) wrote nothing and is redone without them."""
        info = handle.info
        try:
            group = encode_group([item.deltas for item in items], info)
        except InvalidArgumentError as exc:  # one item whose own sum overflows (parts bound the rest)
            return [exc] * len(items)
        k = len(items)
        applied, duplicates = [0] * k, [0] * k
        too_old: dict[int, NgramCacheError] = {}
        # shard -> the items still to apply there; their sum is encoded once per distinct set
        pending = {s: tuple(np.flatnonzero(group.item_shards[:, s]).tolist())
                   for s in np.flatnonzero(group.item_shards.any(axis=0)).tolist()}
        encodings: dict[tuple[int, ...], EncodedBatch] = {}
        first_round = True
        while pending:
            calls: list[Call] = []
            for s, alive in pending.items():
                enc = group.batch if first_round else encodings.get(alive)
                if enc is None:
                    enc = encodings[alive] = encode_group([items[i].deltas for i in alive], info).batch
                calls.append(self._unit_call(handle, s, enc, [(items[i].client_id, items[i].seq) for i in alive]))
            first_round = False
            again: dict[int, tuple[int, ...]] = {}
            for (s, alive), reply in zip(pending.items(), self._acks.for_counts(calls)):
                code = int(reply[0])
                if code == 1:
                    for i in alive:
                        applied[i] += 1
                    continue
                if code == -1:
                    raise StaleHandle()
                fresh = []
                for j, i in enumerate(alive):
                    status = int(reply[1 + 2 * j])
                    if status == 1:
                        fresh.append(i)
                    elif status == 0:
                        duplicates[i] += 1
                    else:
                        too_old[i] = batch_too_old(items[i].seq, int(float(reply[2 + 2 * j])),
                                                   self._config.dedup_window)
                if fresh:
                    again[s] = tuple(fresh)
            pending = again
        units = group.item_shards.sum(axis=1).tolist()
        entries = group.item_entries.tolist()
        return [too_old.get(i) or ApplyResult(units[i], applied[i], duplicates[i], entries[i]) for i in range(k)]


def _unit_args(enc: EncodedBatch, lo: int, hi: int, shards: int) -> tuple[list[int], list[Any]]:
    """Bucket ids (in order) and the APPLY arguments after ttl_ms for entries lo:hi of one shard."""
    buckets = enc.buckets[lo:hi]
    first = np.ones(hi - lo, dtype=bool)
    first[1:] = buckets[1:] != buckets[:-1]
    starts = np.flatnonzero(first)
    unique = buckets[starts]
    changed = pyroaring.BitMap((unique // shards).astype(np.uint32))
    sizes = np.diff(np.append(starts, hi - lo)).astype("<u4").tobytes()
    width = enc.field_matrix.shape[1]
    records = np.zeros((hi - lo, width + 9), dtype=np.uint8)
    records[:, 0] = enc.lengths[lo:hi]
    records[:, 1:width + 1] = enc.field_matrix[lo:hi]  # zero past each field's length
    records[:, width + 1:] = enc.counts[lo:hi].astype("<i8").view(np.uint8).reshape(-1, 8)
    return unique.tolist(), [changed.serialize(), sizes, records.tobytes(), width]

