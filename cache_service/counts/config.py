"""Counts store configuration: `CountsStoreConfig`, its backend URL parsed once into a `StoreAddress`, and `redact_url`.

==========================================  ==============================================
``None`` or ``""``                          embedded, in memory only (nothing persisted)
``embedded://PATH``                         embedded, snapshotted to PATH (``embedded:///abs``)
``redis://[[user]:pass@]host:port[/db]``    standalone Redis
``rediss://...``                            standalone Redis over TLS
``redis+cluster://[[user]:pass@]h:p[,h:p]`` Redis Cluster (any reachable nodes; TLS: ``rediss+cluster://``)
``redis+sentinel://[[user]:pass@]h:p[,h:p]``  a primary and replicas under Sentinel: the sentinels'
``/MASTER-NAME[/db]``                       addresses (port 26379 by default), the master's name;
                                            TLS: ``rediss+sentinel://``
==========================================  ==============================================

The credentials and TLS of a Sentinel URL are the master's (and its replicas'); the
sentinels get them too only with ``sentinel_auth=1``.

Store options may ride in the query string (``?epoch_seconds=0.5&prefix=ngc``). Nothing
is read at import time: build a config with `CountsStoreConfig.from_url` or `from_env`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ngramcache.client.kernel.errors import InvalidArgumentError

from .history import HistoryBudget, validate_partitions

__all__ = ["CountsStoreConfig", "StoreAddress", "parse_url", "redact_url"]

_SCHEMES = ("embedded", "redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
_DEFAULT_REDIS_PORT = 6379
_DEFAULT_SENTINEL_PORT = 26379
_SENTINEL_FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER-NAME[/DB]"


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """A backend URL, parsed (credentials percent-decoded). Its repr never shows the password.

    Attributes:
        kind: "embedded", "redis" (one standalone server), "cluster" or "sentinel".
        path: embedded snapshot file (None: memory only).
        hosts: Redis (host, port) pairs; one for standalone Redis; the sentinels' for Sentinel.
        db: standalone (or Sentinel-managed) Redis database number.
        master: the name the sentinels monitor the master under (Sentinel only).
        username: Redis ACL user, or None.
        password: Redis password, or None.
        ssl: TLS (rediss://, rediss+cluster:// and rediss+sentinel://).
        query: the raw query string (store options).
        redacted: the URL without its query and with the password replaced by ``***``.
    """

    kind: Literal["embedded", "redis", "cluster", "sentinel"]
    path: str | None = None
    hosts: tuple[tuple[str, int], ...] = ()
    db: int = 0
    master: str | None = None
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    ssl: bool = False
    query: str = ""
    redacted: str = ""


def parse_url(url: str | None) -> StoreAddress:
    """Parse a counts store URL (see the module docstring).

    Raises:
        InvalidArgumentError: unknown scheme, bad host, port or database number, no master name.
    """
    if not url:
        return StoreAddress("embedded")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower() if sep else ""
    if scheme not in _SCHEMES:
        raise InvalidArgumentError(
            f"unsupported counts store URL {redact_url(url)!r}: use embedded://PATH, "
            "redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://")
    if scheme == "embedded":
        raw_path, _, query = rest.partition("?")
        path = urllib.parse.unquote(raw_path)
        return StoreAddress("embedded", path=path or None, query=query, redacted=f"embedded://{raw_path}")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    path = rest[len(netloc):].split("?", 1)[0].lstrip("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        if ":" in userinfo:
            user, _, pw = userinfo.partition(":")
            username = urllib.parse.unquote(user) or None
            password = urllib.parse.unquote(pw)
        else:
            password = urllib.parse.unquote(userinfo)
    sentinel = scheme.endswith("+sentinel")
    default_port = _DEFAULT_SENTINEL_PORT if sentinel else _DEFAULT_REDIS_PORT
    hosts = []
    for item in hostlist.split(","):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        host = host.strip("[]")
        try:
            hosts.append((host, int(port)))
        except ValueError:
            raise InvalidArgumentError(f"bad port in counts store URL {redact_url(url)!r}") from None
    if not hosts:
        raise InvalidArgumentError(f"no host in counts store URL {redact_url(url)!r}"
                                   + (f": use {_SENTINEL_FORM}" if sentinel else ""))
    cluster = scheme.endswith("+cluster")
    master = None
    if sentinel:
        master, _, path = path.partition("/")
        if not master:
            raise InvalidArgumentError(f"no master name in counts store URL {redact_url(url)!r}: use {_SENTINEL_FORM}")
    db = 0
    if path and not cluster:
        try:
            db = int(path)
        except ValueError:
            raise InvalidArgumentError(f"bad database number in {redact_url(url)!r}") from None
    if not cluster and not sentinel and len(hosts) != 1:
        raise InvalidArgumentError("a standalone redis:// URL names one host; use redis+cluster:// for several")
    kind: Literal["redis", "cluster", "sentinel"] = "cluster" if cluster else "sentinel" if sentinel else "redis"
    return StoreAddress(kind, hosts=tuple(hosts), db=db, master=master and urllib.parse.unquote(master),
                        username=username, password=password, ssl=scheme.startswith("rediss"),
                        query=urllib.parse.urlsplit(url).query, redacted=redact_url(url.split("?", 1)[0]) or "")


def redact_url(url: str | None) -> str | None:
    """The URL with any password replaced by ``***`` (safe for logs, reprs and errors)."""
    if not url or "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***"
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return url
    user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
    if ":" not in userinfo:  # redis://password@host is a password-only form
        return f"{scheme}://***@{hostpart}"
    return f"{scheme}://{user}:***@{hostpart}"


@dataclasses.dataclass(frozen=True)
class CountsStoreConfig:
    """Options of a counts store. Build it with `from_url` or `from_env`; nothing is read at import.

    Attributes:
        url: backend URL (see the module docstring); never printed with its password.
        prefix: first component of every Redis key.
        max_batch_rows: largest batch `apply_group` accepts in an item (a Lua unit blocks Redis ~1.5 us a row).
        dedup_window: a client may have at most this many batches unacknowledged; a seq
            this far behind the newest seq applied is refused with `BatchTooOldError`.
        dedup_ttl_seconds: dedup records of a silent client expire after this long.
        epoch_seconds: versions advance at most once per this interval however many
            readers poll (0: at most once per millisecond).
        history_epochs: `changes_since` reaches back this many epochs; older versions get
            `ResyncRequiredError`.
        default_buckets: buckets of a new namespace; aim for (expected entries) / 64 so
            buckets stay in Redis's compact listpack encoding (<= 128 entries).
        default_shards: shards of a new namespace; None = 1 on standalone Redis and
            embedded (a batch is atomic whole), 64 on a Cluster.
        socket_timeout: seconds to wait for a Redis reply.
        connect_timeout: seconds to wait for a Redis connection.
        retries: bounded reconnect attempts per Redis call (exponential backoff).
        snapshot_seconds: embedded store: seconds between snapshots (0: only on close/snapshot()).
        history_max_bytes: the fleet history's byte budget per namespace (4 bytes a stored
            token); the oldest records are dropped beyond it.
        history_max_age: seconds a fleet history record is kept at most.
        history_partitions: partitions of a new namespace's fleet history (1..64), fixed at its
            creation; None = 1 on standalone Redis, 12 on a Cluster (even over 1, 2, 3, 4, 6
            or 12 masters). The embedded store keeps one.
        min_replicas: counts and history writes are acknowledged only once this many replicas
            of their master hold them (Redis WAIT); 0: as soon as the master applied them
            (Redis replicates asynchronously: a failover may lose the last ones). Generation
            numbers, leases and fencing tokens always wait for every connected replica.
        replica_timeout: seconds a write waits for its replicas (at most half of socket_timeout);
            fewer within it: the call fails with a retriable `BackendUnavailableError` (the write
            may be applied; a retry is safe, as every write is exactly once).
        sentinel_auth: the sentinels of a redis+sentinel:// URL take its credentials too
            (default: they are sent only to the master and its replicas).
        address: ``url`` parsed (derived; not an argument).
    """

    url: str | None = None
    prefix: str = "ngc"
    max_batch_rows: int = 65536
    dedup_window: int = 128
    dedup_ttl_seconds: float = 7 * 24 * 3600.0
    epoch_seconds: float = 1.0
    history_epochs: int = 3600
    default_buckets: int = 65536
    default_shards: int | None = None
    socket_timeout: float = 5.0
    connect_timeout: float = 2.0
    retries: int = 2
    snapshot_seconds: float = 30.0
    history_max_bytes: int = 64 << 20
    history_max_age: float = 3600.0
    history_partitions: int | None = None
    min_replicas: int = 0
    replica_timeout: float = 1.0
    sentinel_auth: bool = False
    address: StoreAddress = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", self.prefix):
            raise InvalidArgumentError("prefix must be 1..32 characters of [A-Za-z0-9_.-]")
        for name in ("max_batch_rows", "dedup_window", "history_epochs", "default_buckets"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1")
        if self.default_buckets & (self.default_buckets - 1):
            raise InvalidArgumentError("default_buckets must be a power of two")
        for name in ("dedup_ttl_seconds", "epoch_seconds", "snapshot_seconds", "socket_timeout",
                     "connect_timeout"):
            if float(getattr(self, name)) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")
        if self.retries < 0:
            raise InvalidArgumentError("retries must be >= 0")
        if not 0 <= self.min_replicas <= 64:
            raise InvalidArgumentError(f"min_replicas must be in 0..64, got {self.min_replicas!r}")
        if not 0 < self.replica_timeout <= 60:
            raise InvalidArgumentError(f"replica_timeout must be a number of seconds in (0, 60], got {self.replica_timeout!r}")
        self.history_budget  # noqa: B018 - checks history_max_bytes and history_max_age
        if self.history_partitions is not None:
            validate_partitions(self.history_partitions)
        object.__setattr__(self, "address", parse_url(self.url))

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={redact_url(self.url)!r}" if f.name == "url" else f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self) if f.init
        )
        return f"CountsStoreConfig({fields})"

    __str__ = __repr__

    @property
    def history_budget(self) -> HistoryBudget:
        """The fleet history's budget per namespace (``history_max_bytes``, ``history_max_age``)."""
        return HistoryBudget(self.history_max_bytes, self.history_max_age)

    @property
    def replica_timeout_ms(self) -> int:
        """WAIT's timeout: ``replica_timeout`` in whole milliseconds, at most half of ``socket_timeout`` (the reply
        must come before the socket gives up), at least 1."""
        seconds = min(self.replica_timeout, self.socket_timeout / 2) if self.socket_timeout else self.replica_timeout
        return max(1, int(seconds * 1000))

    @property
    def epoch_ms(self) -> int:
        """``epoch_seconds`` in whole milliseconds (versions are milliseconds)."""
        return int(self.epoch_seconds * 1000)

    @property
    def dedup_ttl_ms(self) -> int:
        """``dedup_ttl_seconds`` in whole milliseconds, at least 1."""
        return max(1, int(self.dedup_ttl_seconds * 1000))

    @classmethod
    def from_url(cls, url: str | None, **overrides: Any) -> CountsStoreConfig:
        """Build a config from a backend URL; query parameters named like fields set them.

        Raises:
            InvalidArgumentError: unknown scheme, malformed URL, unknown or malformed option.
        """
        options: dict[str, Any] = {}
        for key, values in urllib.parse.parse_qs(parse_url(url).query, keep_blank_values=True).items():
            if key in _CONFIG_FIELDS:
                options[key] = _CONFIG_FIELDS[key](values[-1])
        options.update(overrides)
        unknown = set(options) - set(_CONFIG_FIELDS)
        if unknown:
            raise InvalidArgumentError(f"unknown counts store option(s): {sorted(unknown)}")
        return cls(url=url or None, **options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CountsStoreConfig:
        """Build a config from NGC_COUNTS_URL and NGC_COUNTS_<FIELD> variables (e.g. NGC_COUNTS_PREFIX)."""
        env = os.environ if environ is None else environ
        overrides: dict[str, Any] = {}
        for name, parse in _CONFIG_FIELDS.items():
            raw = env.get("NGC_COUNTS_" + name.upper())
            if raw is not None and raw != "":
                overrides[name] = parse(raw)
        return cls.from_url(env.get("NGC_COUNTS_URL") or None, **overrides)


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"expected an integer, got {raw!r}") from None


def _parse_float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgumentError(f"expected a number, got {raw!r}") from None


def _parse_optional_int(raw: str) -> int | None:
    return None if raw.strip().lower() in ("", "none") else _parse_int(raw)


def _parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(f"expected a boolean (1/0, true/false), got {raw!r}")


_CONFIG_FIELDS: dict[str, Callable[[str], Any]] = {
    "prefix": str,
    "max_batch_rows": _parse_int,
    "dedup_window": _parse_int,
    "dedup_ttl_seconds": _parse_float,
    "epoch_seconds": _parse_float,
    "history_epochs": _parse_int,
    "default_buckets": _parse_int,
    "default_shards": _parse_optional_int,
    "history_partitions": _parse_optional_int,
    "socket_timeout": _parse_float,
    "connect_timeout": _parse_float,
    "retries": _parse_int,
    "snapshot_seconds": _parse_float,
    "history_max_bytes": _parse_int,
    "history_max_age": _parse_float,
    "min_replicas": _parse_int,
    "replica_timeout": _parse_float,
    "sentinel_auth": _parse_bool,
}
