"""The Redis backend's replica acknowledgements: writes answered only once the master's replicas hold them (WAIT).

Redis replicates asynchronously: a master answers a write before any replica has it, so a
master that dies takes its last writes with it when a replica is promoted in its place. A
generation number or a fencing token lost that way would be handed out again. `ReplicaAcks`
runs a call's scripts on their master, then ``INCR`` of a marker in the slot of the call's
first key and ``WAIT n timeout`` in the same pipeline, so on the same connection: WAIT
blocks until n replicas acknowledged the connection's last write, the marker, and with it
everything the master ran before it (its replication stream is one ordered log). The
marker makes WAIT cover a script that wrote nothing now (a batch applied before, whose
write may still be on its way to the replicas).

How many replicas, two policies:

* counts, history and the version clock (`for_counts`): ``config.min_replicas``; 0 runs
  the scripts as before, with no WAIT.
* generation numbers, leases, fencing tokens and namespace records (`for_leases`, and
  `settle` for plain commands written before): every replica the master has connected
  (``INFO replication``, read before each call: these writes are rare). A replica that
  left meanwhile is not waited for.

Fewer replicas within ``config.replica_timeout`` raise a retriable `BackendUnavailableError`:
the write is applied on the master but not acknowledged, and the caller's retry is safe
(every script is exactly once or checks its state). On a Cluster each master's calls go
in one pipeline on that master's client, routed by the cached slot map; a redirection or
a dead node raises the same retriable error and reads the slot map again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ngramcache.client.errors import BackendUnavailableError

from .config import CountsStoreConfig
from .redis_connection import RedisConnection
from .redis_scripts import Call

__all__ = ["ReplicaAcks", "ack_key"]

log = logging.getLogger(__name__)


def ack_key(key: str | bytes) -> str:
    """The WAIT marker in the slot of ``key`` (its hash tag, ``P:{T}:ack``; `schema` lists it)."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[:text.index("}") + 1] + ":ack"


class ReplicaAcks:
    """Runs script calls on their masters, answered once enough replicas hold them. Thread-safe.

    Args:
        conn: the store's connection.
        config: the store's options (``min_replicas``, ``replica_timeout``).
    """

    def __init__(self, conn: RedisConnection, config: CountsStoreConfig) -> None:
        self._conn = conn
        self._min_replicas = config.min_replicas
        self._timeout_ms = config.replica_timeout_ms

    def for_counts(self, calls: Sequence[Call]) -> list[Any]:
        """Counts and history writes: acknowledged by ``min_replicas`` replicas (0: by the master alone).

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        if self._min_replicas == 0:
            return self._conn.run(calls)
        return self._run(calls, self._min_replicas)

    def for_leases(self, calls: Sequence[Call]) -> list[Any]:
        """Generation numbers, leases, fencing tokens: acknowledged by every connected replica.

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        return self._run(calls, None)

    def settle(self, keys: Sequence[str]) -> None:
        """Plain commands this store wrote before on the masters of ``keys``: returns once every replica each of those
        masters has connected holds them (a marker in the slot of the master's first key, then WAIT).

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        by_node: dict[str, tuple[Any, str]] = {}
        for key in keys:
            name, client = self._conn.node_of(key)
            by_node.setdefault(name, (client, key))
        try:
            for name, (client, key) in by_node.items():
                self._on_node(name, client, [], None, marker=key)
        except BackendUnavailableError:
            self._conn.refresh_topology()
            raise

    def _run(self, calls: Sequence[Call], required: int | None) -> list[Any]:
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (_script, keys, _args) in enumerate(calls):
            name, client = self._conn.node_of(keys[0])
            by_node.setdefault(name, (client, []))[1].append(i)
        results: list[Any] = [None] * len(calls)
        try:
            for name, (client, indices) in by_node.items():
                replies = self._on_node(name, client, [calls[i] for i in indices], required)
                for i, reply in zip(indices, replies):
                    results[i] = reply
        except BackendUnavailableError:
            self._conn.refresh_topology()
            raise
        return results

    def _on_node(self, name: str, client: Any, calls: list[Call], required: int | None, *,
                 marker: str | None = None) -> list[Any]:
        """Run calls on one master with the marker (in the slot of ``marker``, else of the first call's first key) and
        WAIT in the same pipeline; their replies."""
        need = self._connected_replicas(client) if required is None else required
        marker_key = ack_key(marker if marker is not None else calls[0][1][0])

        def then(pipe: Any) -> int:  # the marker and WAIT, on the same connection as the calls
            if not need:
                return 0
            pipe.incr(marker_key)
            pipe.execute_command("WAIT", need, self._timeout_ms)
            return 2

        results, extra = self._conn.run_on(client, calls, then)
        acked = extra[-1] if need else 0
        if int(acked) < need and not (required is None and int(acked) >= self._connected_replicas(client)):
            raise BackendUnavailableError(
                f"{self._conn.where}: the write reached {int(acked)} of {need} replicas of {name} in "
                f"{self._timeout_ms} ms; not acknowledged (it may be applied: a retry is safe)")
        return results

    def _connected_replicas(self, client: Any) -> int:
        """The replicas the master has connected now (INFO replication's connected_slaves)."""
        with self._conn.errors():
            info = client.info("replication")
        if info.get("role") != "master":
            raise BackendUnavailableError(f"{self._conn.where}: the node asked is a {info.get('role')}, not the master "
                                          "(a failover is under way)")
        return int(info.get("connected_slaves", 0))
