"""The Redis backend's connection: one redis-py client (standalone, Cluster or Sentinel-managed) with bounded retries, errors translated, scripts run pipelined."""

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

from ngramcache.client.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NgramCacheError,
    StoreAuthenticationError,
)

from .config import CountsStoreConfig
from .redis_scripts import Call, Script

__all__ = ["RedisConnection"]

log = logging.getLogger(__name__)

# Server states that pass (failover, loading, resharding, memory pressure): retrying can help.
_UNAVAILABLE_ERRORS = (rexc.ClusterDownError, rexc.ClusterError, rexc.TryAgainError, rexc.MasterDownError,
                       rexc.MovedError, rexc.AskError, rexc.SlotNotCoveredError, rexc.ReadOnlyError,
                       rexc.BusyLoadingError, rexc.OutOfMemoryError)
_UNAVAILABLE_PREFIXES = ("OOM", "BUSY", "LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY",
                         "MOVED", "ASK")
_REFRESH_SECONDS = 0.5  # a Cluster's slot map is read again at most this often after a failed node call


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
