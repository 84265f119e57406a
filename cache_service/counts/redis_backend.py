"""The Redis backend of the counts store, for a standalone Redis, a Redis Cluster or Sentinel: `RedisCountsStore`.

Every write is a Lua script over keys of one shard (see `schema` and `redis_scripts`), so
it runs atomically on the shard's node. This module holds the namespaces (create, list,
drop) and wires the parts, one concept each:

* `redis_connection`: the client, its bounded retries, error translation, pipelined scripts,
  and writes acknowledged only once replicas hold them (WAIT): generation numbers, leases,
  fencing tokens and namespace records always; counts, history and the version clock with
  ``min_replicas``.
* `redis_handles`: a namespace's record and key names, reloaded when its instance changed.
* `redis_writes`: a unit of a group as one APPLY call, exactly once per (client_id, seq), and its reply.
* `redis_reads`: lookups, versions, changes since a version, exports.
* `redis_leases`: rebuild leases and committed generations.
* `redis_history`: the fleet history, one stream per namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError, NgramCacheError, TokenizerMismatchError

from . import schema
from .config import CountsStoreConfig
from .history import (
    CLUSTER_HISTORY_PARTITIONS,
    HistoryAppend,
    HistoryBatch,
    HistoryPage,
    HistoryRecord,
    validate_batch_seq,
)
from .namespace import NamespaceRecord, validate_namespace
from .redis_connection import RedisConnection
from .redis_handles import Handle, HandleCache
from .redis_history import RedisHistory
from .redis_leases import RedisLeases
from .redis_reads import RedisReader
from .redis_scripts import CREATE
from .redis_writes import apply_call, unit_answer
from .store import CountsStore
from .values import ChangeSet, Unit, UnitAnswer, validate_client_id

__all__ = ["RedisCountsStore"]

log = logging.getLogger(__name__)

_CLUSTER_DEFAULT_SHARDS: Final = 64


class RedisCountsStore(CountsStore):
    """Counts in a standalone Redis, a Redis Cluster or a Sentinel-managed Redis. Thread-safe; share one per process.

    Args:
        config: a `CountsStoreConfig` whose url is redis://, rediss://, redis+cluster://,
            rediss+cluster://, redis+sentinel:// or rediss+sentinel://.

    Raises:
        BackendUnavailableError: Redis could not be reached.
        StoreAuthenticationError: Redis refused the credentials.
    """

    _unit_per_shard = True  # a unit is one Lua script, on the node of its shard's slot

    def __init__(self, config: CountsStoreConfig) -> None:
        self.config = config
        self._conn = RedisConnection(config)
        self._handles = HandleCache(self._conn, config.prefix)
        self._reader = RedisReader(self._conn, config)
        self._leases = RedisLeases(self._conn, config.prefix)
        self._history = RedisHistory(self._conn, config)

    def __repr__(self) -> str:
        return f"RedisCountsStore({self._conn.where!r}, cluster={self._conn.cluster})"

    def _handle(self, namespace: str, *, refresh: bool = False) -> Handle:
        """The namespace's handle (its record and key names); the benchmark reads key names from it."""
        return self._handles.get(namespace, refresh=refresh)

    # ----------------------------------------------------------------- namespaces

    def _default_shards(self) -> int:
        return _CLUSTER_DEFAULT_SHARDS if self._conn.cluster else 1

    def _default_history_partitions(self) -> int:
        if self.config.history_partitions is not None:
            return self.config.history_partitions
        return CLUSTER_HISTORY_PARTITIONS if self._conn.cluster else 1

    def _find_namespace(self, namespace: str) -> NamespaceRecord | None:
        try:
            return self._handles.get(namespace, refresh=True).info
        except NamespaceNotFoundError:
            return None

    def _namespace_names(self) -> list[str]:
        prefix = self.config.prefix
        names: list[str] = []
        with self._conn.errors():
            for node_client in self._conn.node_clients():  # a Cluster: every primary holds some records
                for key in node_client.scan_iter(match=schema.meta_match(prefix), count=1000):
                    name = schema.namespace_of_meta_key(prefix, key)
                    if name is not None:
                        names.append(name)
        return names

    def _insert_namespace(self, info: NamespaceRecord) -> NamespaceRecord | None:
        handle = Handle(self.config.prefix, info)
        client = self._conn.client
        # Shard state first: the namespace becomes visible (meta) only once every shard can take writes.
        with self._conn.errors():
            pipe = client.pipeline(transaction=False)
            for sk in handle.shards:
                pipe.hset(sk.state, mapping={"instance": info.instance, "e": 0, "f": 0})
            for hk in handle.history[1:]:  # partition 0's guard is meta itself
                pipe.hset(hk.stat, mapping={"instance": info.instance, "tokens": 0})
            pipe.execute()
        # A record acknowledged is never lost with a master that dies: the shard state on every replica first (a
        # Cluster: on each shard's master), then the record (its master's replicas hold the shard state there too).
        self._conn.settle([sk.state for sk in handle.shards] + [hk.stat for hk in handle.history[1:]])
        existing = self._conn.for_leases([(CREATE, [handle.meta, handle.clock, handle.epochs],
                                           [info.instance, info.fingerprint, info.vocab_size, info.buckets, info.shards,
                                            schema.SCHEMA_VERSION, info.history_partitions])])[0]
        if existing:  # lost a creation race: forget our shard state, bind to the winner
            with self._conn.errors():
                pipe = client.pipeline(transaction=False)
                for sk in handle.shards:
                    pipe.delete(sk.state)
                for hk in handle.history[1:]:
                    pipe.delete(hk.stat)
                pipe.execute()
            return self._handles.get(info.name, refresh=True).info
        self._handles.remember(handle)
        log.debug("created counts namespace %s (%d buckets, %d shards, %d history partitions)", info.name,
                  info.buckets, info.shards, info.history_partitions)
        return None

    def namespace_info(self, namespace: str) -> NamespaceRecord:
        return self._handles.get(namespace, refresh=True).info

    def drop_namespace(self, namespace: str) -> bool:
        validate_namespace(namespace)
        prefix = self.config.prefix
        client = self._conn.client
        try:
            handle: Handle | None = self._handles.get(namespace, refresh=True)
        except NamespaceNotFoundError:
            handle = None
        with self._conn.errors():
            if handle is not None:
                # Shard state first: from here on no APPLY of this instance succeeds.
                pipe = client.pipeline(transaction=False)
                for sk in handle.shards:
                    pipe.delete(sk.state)
                for hk in handle.history[1:]:  # their guards: no append lands there any more
                    pipe.delete(hk.stat)
                pipe.execute()
                client.delete(handle.meta, handle.clock, handle.epochs)
            client.delete(*schema.history_keys(prefix, namespace))  # same slot; after meta, so no append lands
            # Partitions 1.. carry the instance in their tag: the scan below unlinks them.
            self._leases.forget_base(namespace)  # its files go with it
            self._handles.forget(namespace)
            pattern = schema.instance_match(prefix, namespace)
            for node_client in self._conn.node_clients():
                batch: list[bytes] = []
                for key in node_client.scan_iter(match=pattern, count=1000):
                    batch.append(key)
                    if len(batch) >= 1000:
                        self._conn.unlink(node_client, batch)
                        batch = []
                self._conn.unlink(node_client, batch)
        return handle is not None

    # ----------------------------------------------------------------- writes

    def _record(self, namespace: str, stale: NamespaceRecord | None = None) -> NamespaceRecord:
        return (self._handles.get(namespace) if stale is None else self._handles.renew(namespace, stale)).info

    def _write_units(self, info: NamespaceRecord, units: list[Unit]) -> list[UnitAnswer]:
        """One APPLY call per unit, pipelined per master (`redis_writes`), acknowledged by ``min_replicas`` replicas."""
        handle = self._handles.of(info)
        replies = self._conn.for_counts([apply_call(handle, unit, self.config) for unit in units])
        return [unit_answer(reply, unit, self.config.dedup_window) for unit, reply in zip(units, replies)]

    # ----------------------------------------------------------------- the fleet history (`redis_history`)

    def _append_history(self, namespace: str, client_id: str, batch_seq: int, records: Sequence[HistoryRecord],
                        fingerprint: bytes | None) -> HistoryAppend:
        def run(handle: Handle) -> HistoryAppend:
            checked = self._check_history(handle.info, fingerprint, client_id, records)
            return self._history.append(handle, client_id, batch_seq, checked)

        return self._handles.run(namespace, run)

    def append_history_many(self, namespace: str, batches: Sequence[HistoryBatch]) -> list[HistoryAppend | NgramCacheError]:
        def run(handle: Handle) -> list[HistoryAppend | NgramCacheError]:
            out: list[HistoryAppend | NgramCacheError | None] = [None] * len(batches)
            good: list[int] = []
            checked: list[tuple[str, int, list[HistoryRecord]]] = []
            for i, batch in enumerate(batches):
                try:
                    validate_client_id(batch.client_id)
                    seq = validate_batch_seq(batch.batch_seq)
                    records = self._check_history(handle.info, batch.fingerprint, batch.client_id, batch.records)
                except (InvalidArgumentError, TokenizerMismatchError) as exc:
                    out[i] = exc
                    continue
                good.append(i)
                checked.append((batch.client_id, seq, records))
            for i, done in zip(good, self._history.append_many(handle, checked) if checked else []):
                out[i] = done
            return [x for x in out if x is not None]

        return self._handles.run(namespace, run)

    def _read_history(self, namespace: str, after: str, limit: int, groups: tuple[str, ...] = ()) -> HistoryPage:
        return self._handles.run(namespace, lambda handle: self._history.read(handle, after, limit, groups))

    def _history_stats(self, namespace: str) -> dict[str, int]:
        return self._history.stats(self._handles.get(namespace, refresh=True))

    # ----------------------------------------------------------------- reads

    def lookup(self, namespace: str, ngram: Sequence[int]) -> dict[int, int]:
        return self._handles.run(namespace, lambda handle: self._reader.lookup(handle, ngram))

    def version(self, namespace: str) -> int:
        return self._handles.run(namespace, self._reader.version)

    def changes_since(self, namespace: str, version: int) -> ChangeSet:
        since = int(version)
        return self._handles.run(namespace, lambda handle: self._reader.changes_since(handle, since))

    def export(self, namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        handle = self._handles.get(namespace, refresh=True)
        yield from self._reader.export(handle, chunk_rows=chunk_rows)

    def close(self) -> None:
        self._conn.close()
