"""The Redis backend's namespace handles: a namespace's record and key names, cached, reloaded when a script sees another instance (`namespace.StaleNamespace`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ngramcache.client.kernel.errors import NamespaceNotFoundError, NgramCacheError

from . import schema
from .namespace import NamespaceRecord, no_such_namespace, rerun_if_stale, validate_namespace
from .redis_connection import RedisConnection

__all__ = ["Handle", "HandleCache"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Handle:
    """A namespace's immutable record and its key names (cached; dropped on a stale instance)."""

    __slots__ = ("clock", "epochs", "history", "info", "meta", "shards")

    def __init__(self, prefix: str, info: NamespaceRecord) -> None:
        self.info = info
        self.shards = schema.shard_keys(prefix, info.name, info.instance, info.shards)
        self.history = schema.history_partition_keys(prefix, info.name, info.instance, info.history_partitions)
        self.meta = schema.meta_key(prefix, info.name)
        self.clock = schema.clock_key(prefix, info.name)
        self.epochs = schema.epochs_key(prefix, info.name)


class HandleCache:
    """The handles of the namespaces this process used, read from their meta keys. Thread-safe.

    Every script checks the instance id it is given, so a cached handle is never trusted
    blindly: a script that sees another instance raises `StaleNamespace`, and `run` (or the
    store, for writes: `CountsStore.apply_group`) reloads the handle with `renew` and runs
    the action again, once (`namespace.rerun_if_stale`).
    """

    def __init__(self, conn: RedisConnection, prefix: str) -> None:
        self._conn = conn
        self._prefix = prefix
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str, *, refresh: bool = False) -> Handle:
        """The namespace's handle, from the cache unless ``refresh``. Raises NamespaceNotFoundError."""
        validate_namespace(namespace)
        if not refresh:
            with self._lock:
                handle = self._handles.get(namespace)
            if handle is not None:
                return handle
        with self._conn.errors():
            raw = self._conn.client.hgetall(schema.meta_key(self._prefix, namespace))
        if not raw:
            self.forget(namespace)
            raise no_such_namespace(namespace)
        handle = Handle(self._prefix, info_from_meta(namespace, raw))
        self.remember(handle)
        return handle

    def remember(self, handle: Handle) -> None:
        with self._lock:
            self._handles[handle.info.name] = handle

    def forget(self, namespace: str) -> None:
        with self._lock:
            self._handles.pop(namespace, None)

    def renew(self, namespace: str, stale: NamespaceRecord) -> Handle:
        """The namespace's handle read again, after a script found the instance of ``stale`` gone.

        Raises:
            NamespaceNotFoundError: the namespace is gone, or still that instance: its shard state
                was lost (a Redis node restarted without persistence?).
        """
        log.debug("namespace %s changed instance; reloading its record", namespace)
        fresh = self.get(namespace, refresh=True)
        if fresh.info.instance == stale.instance:
            raise NamespaceNotFoundError(
                f"namespace {namespace!r} lost its shard state (a Redis node restarted without "
                "persistence?); drop and recreate it")
        return fresh

    def of(self, info: NamespaceRecord) -> Handle:
        """The handle of exactly this record (the cached one, unless the cache moved to another instance)."""
        with self._lock:
            handle = self._handles.get(info.name)
        return handle if handle is not None and handle.info == info else Handle(self._prefix, info)

    def run(self, namespace: str, action: Callable[[Handle], _T]) -> _T:
        """Run ``action(handle)``; when a script saw another instance, once more with the handle renewed."""

        def handle(stale: Handle | None) -> Handle:
            return self.get(namespace) if stale is None else self.renew(namespace, stale.info)

        return rerun_if_stale(namespace, handle, action)


def info_from_meta(namespace: str, raw: dict[Any, Any]) -> NamespaceRecord:
    """The record of ``namespace`` from its meta hash, as HGETALL returns it."""
    meta = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}
    if int(meta.get("schema", 0)) != schema.SCHEMA_VERSION:
        raise NgramCacheError(f"namespace {namespace!r} uses key schema {meta.get('schema')}, "
                              f"this code reads schema {schema.SCHEMA_VERSION}")
    # history_partitions is absent from a namespace created before partitions: its history is one stream.
    return NamespaceRecord(namespace, meta["fingerprint"], int(meta["vocab_size"]), int(meta["buckets"]),
                         int(meta["shards"]), meta["instance"], int(meta.get("history_partitions", 1)))
