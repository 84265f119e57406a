"""The Redis backend's reads: buckets read by READ scripts shard by shard, the version clock and change pieces, lookups and exports.

A version is handed out only after every shard's open change piece started at or after it
(TICK, then ROLL on every shard), so every write after the hand-out lands in a piece
``changes_since`` will read. Change pieces are roaring bitmaps of local bucket ids
(bucket // shards); a reader seals the closed pieces it reads into one bitmap each.

TICK is acknowledged like counts (``min_replicas`` replicas): a version is the master's
clock, ``max(cur + 1, now)``, so one lost with a dead master is handed out again only if the
promoted replica's clock is behind by more than the failover took; with ``min_replicas``
>= 1 the clock never goes back, whatever the clocks. Waiting for every replica as leases
do would stall every version read (four a second in each service's mirror, and push
answers) on one slow replica even with ``min_replicas`` 0.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import pyroaring

from ngramcache.client.kernel.rows import COUNT, FOLLOWER, TOKENS, N, empty_counts

from . import schema
from .config import CountsStoreConfig
from .layout import FIELD_TOKENS, ngram_bucket, ngram_key, rows_from_matrix
from .namespace import StaleNamespace, namespace_changed
from .redis_connection import RedisConnection
from .redis_handles import Handle
from .redis_scripts import READ, ROLL, SEAL, TICK, Call
from .values import ChangeSet
from .versions import check_version, history_lost

__all__ = ["RedisReader"]

_READ_KEYS_PER_CALL: Final = 512  # buckets per READ call: bounds how long one call blocks Redis


class RedisReader:
    """Reads a namespace's counts and versions through its handle. Thread-safe.

    Every method raises `StaleNamespace` when a script saw another instance of the namespace
    (the caller reloads the handle and tries again), except `export`, which raises
    NamespaceNotFoundError: its rows would mix two incarnations.

    Args:
        conn: the store's connection (it runs TICK acknowledged by ``config.min_replicas`` replicas).
        config: the store's options (prefix, epoch length, history kept).
    """

    def __init__(self, conn: RedisConnection, config: CountsStoreConfig) -> None:
        self._conn = conn
        self._config = config

    def lookup(self, handle: Handle, ngram: Sequence[int]) -> dict[int, int]:
        """Followers of one n-gram and their counts (one bucket read)."""
        info = handle.info
        bucket = ngram_bucket(ngram, info)
        rows = self._read_buckets(handle, [bucket])
        key = ngram_key(ngram, info)
        n = len(key) // info.token_width
        tokens = np.array(list(ngram), dtype=np.int64)
        tokens_of = rows[:, TOKENS][:, :n]
        hit = (rows[:, N] == n) & (tokens_of == tokens[None, :]).all(axis=1)
        return {int(f): int(c) for f, c in zip(rows[hit, FOLLOWER].tolist(), rows[hit, COUNT].tolist())}

    def _read_buckets(self, handle: Handle, buckets: Iterable[int]) -> np.ndarray:
        """Rows of the given buckets, read atomically bucket by bucket (one READ call per shard slice)."""
        info = handle.info
        by_shard: dict[int, list[int]] = {}
        for b in buckets:
            by_shard.setdefault(b % info.shards, []).append(b)
        calls: list[Call] = []
        for s, ids in by_shard.items():
            sk = handle.shards[s]
            for i in range(0, len(ids), _READ_KEYS_PER_CALL):
                keys = [sk.state] + [sk.base + str(b) for b in ids[i:i + _READ_KEYS_PER_CALL]]
                calls.append((READ, keys, [info.instance, FIELD_TOKENS * info.token_width]))
        parts = []
        for reply in self._conn.run(calls):
            if int(reply[0]) == -1:
                raise StaleNamespace()
            parts.append(_rows_from_read(reply, info.token_width))
        return np.concatenate(parts) if parts else empty_counts()

    def _tick(self, handle: Handle) -> tuple[int, int]:
        reply = self._conn.for_counts([(TICK, [handle.clock, handle.epochs],
                                        [handle.info.instance, self._config.epoch_ms, self._config.history_epochs])])[0]
        if int(reply[0]) == -1:
            raise StaleNamespace()
        return int(reply[0]), int(reply[1])

    def _roll(self, handle: Handle, cur: int, floor: int, since: int | None) -> list[Any]:
        calls: list[Call] = [(ROLL, [sk.state, sk.changes, sk.history, sk.index],
                              [handle.info.instance, cur, floor, "" if since is None else since])
                             for sk in handle.shards]
        replies = self._conn.run(calls)
        for reply in replies:
            if int(reply[0]) == -1:
                raise StaleNamespace()
        return replies

    def version(self, handle: Handle) -> int:
        """The current version, once every shard's open change piece started at or after it.

        A version is handed out only then, so every write after the hand-out lands in a piece
        `changes_since` will read.
        """
        cur, floor = self._tick(handle)
        self._roll(handle, cur, floor, None)
        return cur

    def changes_since(self, handle: Handle, since: int) -> ChangeSet:
        """Current counts of every bucket changed since ``since``, and the new version; seals the pieces it read.

        Raises:
            ResyncRequiredError: ``since`` is outside the history kept.
        """
        namespace = handle.info.name
        info = handle.info
        cur, floor = self._tick(handle)
        check_version(namespace, since, floor, cur)
        replies = self._roll(handle, cur, floor, since)
        changed = pyroaring.BitMap()
        seals: list[Call] = []
        for s, reply in enumerate(replies):
            if int(reply[0]) == -3:
                raise history_lost(namespace, since)
            local = _piece_buckets(reply[1])
            for i in range(2, len(reply), 2):
                piece, blob = reply[i], reply[i + 1]
                bits = _piece_buckets(blob)
                local |= bits
                if blob[:1] == b"L":  # seal it: one compact bitmap instead of one per unit
                    sk = handle.shards[s]
                    seals.append((SEAL, [sk.state, sk.history], [info.instance, piece, bits.serialize()]))
            if local:
                ids = np.fromiter(local, dtype=np.int64, count=len(local))
                changed.update((ids * info.shards + s).tolist())
        if seals:
            self._conn.run(seals)
        buckets = np.array(changed, dtype=np.uint32) if changed else np.zeros(0, dtype=np.uint32)
        rows = self._read_buckets(handle, buckets.tolist())
        return ChangeSet(cur, rows, buckets)

    def export(self, handle: Handle, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        """Every count of the namespace, SCANned node by node and read bucket by bucket (each atomically).

        Raises:
            NamespaceNotFoundError: the namespace was dropped or recreated during the export.
        """
        info = handle.info
        pattern = schema.bucket_match(self._config.prefix, info.name, info.instance)
        seen = pyroaring.BitMap()
        per_read = max(1, min(_READ_KEYS_PER_CALL, chunk_rows // 16))  # ~16+ entries a bucket
        pending: list[int] = []
        out: list[np.ndarray] = []
        out_rows = 0
        for node_client in self._conn.node_clients():
            with self._conn.errors():
                keys = node_client.scan_iter(match=pattern, count=1000)
                while True:
                    try:
                        key = next(keys)
                    except StopIteration:
                        break
                    bucket = schema.bucket_of_key(key)
                    if bucket in seen:  # SCAN may return a key twice
                        continue
                    seen.add(bucket)
                    pending.append(bucket)
                    if len(pending) >= per_read:
                        rows = self._read_export(handle, pending)
                        pending = []
                        out.append(rows)
                        out_rows += len(rows)
                        if out_rows >= chunk_rows:
                            yield np.concatenate(out)
                            out, out_rows = [], 0
        if pending:
            out.append(self._read_export(handle, pending))
        if out:
            rows = np.concatenate(out)
            if len(rows):
                yield rows

    def _read_export(self, handle: Handle, buckets: list[int]) -> np.ndarray:
        try:
            return self._read_buckets(handle, buckets)
        except StaleNamespace:
            raise namespace_changed(handle.info.name, "export") from None


def _rows_from_read(reply: Sequence[Any], width: int) -> np.ndarray:
    fields, counts = reply[1], reply[2]
    record = 1 + FIELD_TOKENS * width
    k = len(fields) // record
    if k == 0:
        empty: np.ndarray = empty_counts()
        return empty
    raw = np.frombuffer(fields, dtype=np.uint8).reshape(k, record)
    values = np.fromstring(counts, dtype=np.int64, sep=",")  # text mode: not the deprecated binary one
    return rows_from_matrix(raw[:, 0].astype(np.int64), raw[:, 1:], values, width)


def _piece_buckets(blob: bytes) -> pyroaring.BitMap:
    """The local bucket ids of a change piece: b"R" + roaring, or b"L" + ('<I4' length, roaring)..."""
    if blob[:1] == b"R":
        return pyroaring.BitMap.deserialize(blob[1:])
    parts = []
    view = memoryview(blob)
    pos = 1
    while pos < len(blob):
        (length,) = struct.unpack_from("<I", blob, pos)
        parts.append(pyroaring.BitMap.deserialize(bytes(view[pos + 4:pos + 4 + length])))
        pos += 4 + length
    return pyroaring.BitMap.union(*parts) if parts else pyroaring.BitMap()
