"""The Redis backend's connection: one redis-py client (standalone, Cluster or Sentinel-managed) with bounded retries, errors translated, scripts run pipelined, writes acknowledged by replicas.

Redis replicates asynchronously: a master answers a write before any replica has it, so a
master that dies takes its last writes with it when a replica is promoted in its place. A
generation number or a fencing token lost that way would be handed out again. A write that
must survive that runs its scripts on their master, then ``INCR`` of a marker in the slot of
the call's first key and ``WAIT n timeout`` in the same pipeline, so on the same connection:
WAIT blocks until n replicas acknowledged the connection's last write, the marker, and with
it everything the master ran before it (its replication stream is one ordered log). The
marker makes WAIT cover a script that wrote nothing now (a batch applied before, whose write
may still be on its way to the replicas).

How many replicas, two policies:

* counts, history and the version clock (`RedisConnection.for_counts`): ``config.min_replicas``;
  0 runs the scripts with no WAIT.
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

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
import redis.exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NgramCacheError,
    StoreAuthenticationError,
)

from .config import CountsStoreConfig
from .redis_scripts import Call, Script

__all__ = ["RedisConnection", "ack_key"]

log = logging.getLogger(__name__)

# Server states that pass (failover, loading, resharding, memory pressure): retrying can help.
_UNAVAILABLE_ERRORS = (rexc.ClusterDownError, rexc.ClusterError, rexc.TryAgainError, rexc.MasterDownError,
                       rexc.MovedError, rexc.AskError, rexc.SlotNotCoveredError, rexc.ReadOnlyError,
                       rexc.BusyLoadingError, rexc.OutOfMemoryError)
_UNAVAILABLE_PREFIXES = ("OOM", "BUSY", "LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY",
                         "MOVED", "ASK")
_REFRESH_SECONDS = 0.5  # a Cluster's slot map is read again at most this often after a failed node call


def ack_key(key: str | bytes) -> str:
    """The WAIT marker in the slot of ``key`` (its hash tag, ``P:{T}:ack``; `schema` lists it)."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[:text.index("}") + 1] + ":ack"


class RedisConnection:
    """A client of the store's Redis (standalone, Cluster or Sentinel). Thread-safe, as redis-py's clients are.

    Connection errors are retried by redis-py a bounded number of times (``config.retries``,
    exponential backoff); what still fails reaches the caller as a store error
    (`BackendUnavailableError`, `StoreAuthenticationError`, `NgramCacheError`) whose message
    never holds the password.

    Args:
        config: a `CountsStoreConfig` whose url is redis://, rediss://, redis+cluster://,
            rediss+cluster://, redis+sentinel:// or rediss+sentinel://. With Sentinel every new
            connection asks the sentinels for the master, so a promoted replica is found
            without an operator (a connection to a demoted master is dropped on its READONLY).

    Raises:
        InvalidArgumentError: the config's URL is not a Redis URL.
        BackendUnavailableError: Redis could not be reached.
        StoreAuthenticationError: Redis refused the credentials.
    """

    def __init__(self, config: CountsStoreConfig) -> None:
        address = config.address
        if address.kind == "embedded":
            raise InvalidArgumentError("RedisCountsStore needs a redis URL")
        self._secret = address.password or ""
        self.cluster = address.kind == "cluster"
        self.where = address.redacted
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), config.retries)
        common: dict[str, Any] = {"username": address.username, "password": address.password,
                                  "socket_timeout": config.socket_timeout or None,
                                  "socket_connect_timeout": config.connect_timeout or None, "ssl": address.ssl}
        self._refresh_lock = threading.Lock()
        self._refreshed = 0.0
        self._min_replicas = config.min_replicas
        self._replica_timeout_ms = config.replica_timeout_ms
        with self.errors():
            if self.cluster:
                nodes = [ClusterNode(host, port) for host, port in address.hosts]  # type: ignore[no-untyped-call]
                self.client: Any = RedisCluster(startup_nodes=nodes, retry=retry, **common)
            elif address.kind == "sentinel":
                self.client = self._sentinel_master(config, retry, common)
                self.client.ping()
            else:
                (host, port), = address.hosts
                self.client = redis.Redis(host=host, port=port, db=address.db, retry=retry,
                                          retry_on_error=[rexc.ConnectionError, rexc.TimeoutError], **common)
                self.client.ping()
        log.debug("counts store connected to %s", self.where)

    @staticmethod
    def _sentinel_master(config: CountsStoreConfig, retry: Retry, common: dict[str, Any]) -> Any:
        """A client of the master the sentinels name (looked up again on every new connection)."""
        address = config.address
        sentinel_kwargs = {k: v for k, v in common.items() if k.startswith("socket_") or k == "ssl"}
        if config.sentinel_auth:
            sentinel_kwargs.update(username=address.username, password=address.password)
        sentinels = Sentinel(list(address.hosts), sentinel_kwargs=sentinel_kwargs, **common)
        return sentinels.master_for(address.master or "", db=address.db, retry=retry,
                                    retry_on_error=[rexc.ConnectionError, rexc.TimeoutError])

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """Translate redis-py errors into the store's errors, without credentials in the message."""
        try:
            yield
        except NgramCacheError:
            raise
        except (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError) as exc:
            raise StoreAuthenticationError(f"{self.where} refused the credentials ({self._scrub(exc)})") from None
        except MasterNotFoundError as exc:
            # redis-py's message holds the repr of a whole connection pool; its reason is the last part.
            message = self._scrub(exc)
            reason = message.rsplit(" - ", 1)[1] if " - " in message else "they know no master by that name"
            raise BackendUnavailableError(f"{self.where} is unavailable: no sentinel named a master ({reason})") from None
        except _UNAVAILABLE_ERRORS as exc:
            raise BackendUnavailableError(
                f"{self.where} is unavailable: {type(exc).__name__}: {self._scrub(exc)}") from None
        except rexc.ResponseError as exc:
            message = self._scrub(exc)
            if message.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise StoreAuthenticationError(f"{self.where} refused the credentials ({message})") from None
            if message.startswith(_UNAVAILABLE_PREFIXES):
                raise BackendUnavailableError(f"{self.where} is unavailable: {message}") from None
            raise NgramCacheError(f"{self.where} answered an error: {message}") from None
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            raise BackendUnavailableError(
                f"{self.where} is unavailable: {type(exc).__name__}: {self._scrub(exc)}") from None

    def _scrub(self, exc: BaseException) -> str:
        message = str(exc)
        return message.replace(self._secret, "***") if self._secret else message

    def _load_scripts(self, scripts: Iterable[Script]) -> None:
        for script in scripts:
            log.debug("loading Lua script %s (%s)", script.name, script.sha)
            if self.cluster:
                for node in self.client.get_primaries():
                    self.client.get_redis_connection(node).script_load(script.source)
            else:
                self.client.script_load(script.source)

    def run(self, calls: Sequence[Call]) -> list[Any]:
        """Run scripts pipelined (one round trip per node); NOSCRIPT loads and runs those again.

        Raises the first error other than NOSCRIPT, after every call was attempted.
        """
        return self.run_on(self.client, calls, load=self._load_scripts)[0]

    def run_on(self, client: Any, calls: Sequence[Call], then: Callable[[Any], int] | None = None,
               load: Callable[[Iterable[Script]], None] | None = None) -> tuple[list[Any], list[Any]]:
        """Run scripts pipelined on `client` (the store's, or one node's), followed in the same pipeline
        by the commands `then(pipe)` adds (it returns how many); NOSCRIPT loads the scripts missing
        (`load`, default: on `client`) and runs those calls, and `then`'s commands, again.

        Returns:
            (the calls' replies, the replies of `then`'s commands).

        Raises the first error other than NOSCRIPT, after every call was attempted.
        """
        results: list[Any] = [None] * len(calls)
        extra: list[Any] = []
        pending = list(range(len(calls)))
        for _attempt in range(2):
            with self.errors():
                pipe = client.pipeline(transaction=False)
                for i in pending:
                    script, keys, args = calls[i]
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                n_then = then(pipe) if then is not None else 0
                replies = pipe.execute(raise_on_error=False)
            extra = replies[len(pending):]
            assert len(extra) == n_then
            missing = []
            for i, reply in zip(pending, replies):
                results[i] = reply
                if isinstance(reply, rexc.NoScriptError):
                    missing.append(i)
            if not missing:
                break
            with self.errors():
                scripts = {calls[i][0] for i in missing}
                if load is not None:
                    load(scripts)
                else:
                    self.load_scripts_on(client, scripts)
            pending = missing
        for reply in [*results, *extra]:
            if isinstance(reply, BaseException):
                with self.errors():
                    raise reply
        return results, extra

    def run_one(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return self.run([(script, keys, args)])[0]

    # ----------------------------------------------------------------- writes acknowledged by replicas (WAIT)

    def for_counts(self, calls: Sequence[Call]) -> list[Any]:
        """Counts and history writes: acknowledged by ``min_replicas`` replicas (0: by the master alone).

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        if self._min_replicas == 0:
            return self.run(calls)
        return self._acked(calls, self._min_replicas)

    def for_leases(self, calls: Sequence[Call]) -> list[Any]:
        """Generation numbers, leases, fencing tokens: acknowledged by every connected replica.

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        return self._acked(calls, None)

    def settle(self, keys: Sequence[str]) -> None:
        """Plain commands this store wrote before on the masters of ``keys``: returns once every replica each of those
        masters has connected holds them (a marker in the slot of the master's first key, then WAIT).

        Raises:
            BackendUnavailableError: fewer replicas acknowledged within the timeout, or Redis failed.
        """
        by_node: dict[str, tuple[Any, str]] = {}
        for key in keys:
            name, client = self.node_of(key)
            by_node.setdefault(name, (client, key))
        try:
            for name, (client, key) in by_node.items():
                self._on_node(name, client, [], None, marker=key)
        except BackendUnavailableError:
            self.refresh_topology()
            raise

    def _acked(self, calls: Sequence[Call], required: int | None) -> list[Any]:
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (_script, keys, _args) in enumerate(calls):
            name, client = self.node_of(keys[0])
            by_node.setdefault(name, (client, []))[1].append(i)
        results: list[Any] = [None] * len(calls)
        try:
            for name, (client, indices) in by_node.items():
                replies = self._on_node(name, client, [calls[i] for i in indices], required)
                for i, reply in zip(indices, replies):
                    results[i] = reply
        except BackendUnavailableError:
            self.refresh_topology()
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
            pipe.execute_command("WAIT", need, self._replica_timeout_ms)
            return 2

        results, extra = self.run_on(client, calls, then)
        acked = extra[-1] if need else 0
        if int(acked) < need and not (required is None and int(acked) >= self._connected_replicas(client)):
            raise BackendUnavailableError(
                f"{self.where}: the write reached {int(acked)} of {need} replicas of {name} in "
                f"{self._replica_timeout_ms} ms; not acknowledged (it may be applied: a retry is safe)")
        return results

    def _connected_replicas(self, client: Any) -> int:
        """The replicas the master has connected now (INFO replication's connected_slaves)."""
        with self.errors():
            info = client.info("replication")
        if info.get("role") != "master":
            raise BackendUnavailableError(f"{self.where}: the node asked is a {info.get('role')}, not the master "
                                          "(a failover is under way)")
        return int(info.get("connected_slaves", 0))

    # ----------------------------------------------------------------- nodes

    def node_of(self, key: Any) -> tuple[str, Any]:
        """(name, client) of the master holding ``key``: on a Cluster its slot's, from the cached slot map."""
        if not self.cluster:
            return "master", self.client
        node = self.client.get_node_from_key(key)
        return node.name, self.client.get_redis_connection(node)

    def refresh_topology(self) -> None:
        """A Cluster: read the slot map again (after a node call failed; at most every 0.5 s). Never raises."""
        if not self.cluster:
            return
        with self._refresh_lock:
            if time.monotonic() - self._refreshed < _REFRESH_SECONDS:
                return
            self._refreshed = time.monotonic()
        with contextlib.suppress(Exception):
            self.client.nodes_manager.initialize()

    def load_scripts_on(self, node_client: Any, scripts: Iterable[Script]) -> None:
        """Load scripts on one node (its NOSCRIPT answers)."""
        for script in scripts:
            log.debug("loading Lua script %s (%s) on one node", script.name, script.sha)
            node_client.script_load(script.source)

    def node_clients(self) -> list[Any]:
        """A client per primary (a Cluster: each holds some of the keys), or the one client."""
        if self.cluster:
            return [self.client.get_redis_connection(node) for node in self.client.get_primaries()]
        return [self.client]

    @staticmethod
    def unlink(node_client: Any, keys: list[bytes]) -> None:
        if keys:
            pipe = node_client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            pipe.execute()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
