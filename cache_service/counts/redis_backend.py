"""The Redis backend of the counts store, for a standalone Redis or a Redis Cluster.

Every write is a Lua script over keys of one shard (see `schema`), so it runs
atomically on the shard's node:

* APPLY adds one unit of a batch (the batch's entries in one shard) and records
  (client_id, seq) in the shard's dedup set in the same script; a unit already recorded is
  skipped. For `apply_group` a unit is the sum of several batches (of any clients) in one
  shard: the script checks every (client_id, seq) first and writes the summed increments
  and every dedup record only if none was recorded before; otherwise it writes nothing
  and says which were, and the unit is sent again without them. A reply lost to a
  timeout, a dropped connection or a server restart (with ``appendonly yes``, which logs
  a script's effects as one MULTI/EXEC) is therefore retried safely, and every script here is idempotent, so redis-py's bounded reconnect
  retries and the NOSCRIPT fallback (load, then run again) are safe as well.
* TICK advances the namespace's version at most once per ``epoch_seconds`` (the rule of
  `store.EpochClock`); APPLY's dedup check is the rule of `store.DedupWindow`.
* ROLL closes a shard's open change piece when the version moved, trims history below the
  floor and returns the pieces a reader needs; SEAL rewrites a closed piece as the union of
  its roaring bitmaps; READ returns bucket contents packed for numpy.

A version is handed out only after every shard's open piece started at or after it, so
every write after the hand-out lands in a piece ``changes_since`` will read.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import pyroaring
import redis
import redis.exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from ngramcache.client.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    NgramCacheError,
    StoreAuthenticationError,
)
from ngramcache.client.rows import COUNT, FOLLOWER, TOKENS, N, empty_counts

from . import schema
from .config import CountsStoreConfig
from .layout import (
    FIELD_TOKENS,
    EncodedBatch,
    encode_batch,
    encode_group,
    ngram_bucket,
    ngram_key,
    rows_from_matrix,
)
from .namespace import NamespaceInfo, validate_namespace
from .store import (
    ApplyResult,
    ChangeSet,
    CommittedGeneration,
    CountsStore,
    GroupItem,
    ItemOutcome,
    Lease,
    batch_too_old,
    check_lease_args,
    check_ttl,
    check_version,
    history_lost,
    lease_held,
    lease_lost,
    namespace_changed,
    no_such_namespace,
    not_newer,
)

__all__ = ["RedisCountsStore"]

log = logging.getLogger(__name__)

_CLUSTER_DEFAULT_SHARDS: Final = 64
_READ_KEYS_PER_CALL: Final = 512  # buckets per READ call: bounds how long one call blocks Redis
_PIPELINE_ROWS: Final = 1 << 16  # rows per pipelined round trip in apply_many (encoding overlaps the previous one)

_T = TypeVar("_T")


class _Script:
    """A Lua script run by EVALSHA; `RedisCountsStore._run` loads it on NOSCRIPT and runs it again."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_Call = tuple[_Script, Sequence[Any], Sequence[Any]]  # (script, keys, args) of one EVALSHA


# One unit: the entries of one shard of a batch, or of a group of batches summed together.
# KEYS: state, changes, dedup keys (one per client in the unit, nd of them), bucket...
# ARGV: instance, window, ttl_ms, changed (portable roaring bitmap of the unit's local bucket
# ids), sizes ('<I4' entries per bucket, in KEYS order), entries (one packed string of
# fixed-size records: u8 field length, the field zero-padded to `width` bytes, '<i8'
# increment), width, nd, then per batch: its dedup key's index (1..nd) and its seq. One
# string instead of two arguments a delta keeps argument parsing (in Redis) and command
# packing (in the client) off the per-delta path.
# Every (client, seq) is checked first; only if none was applied before and none is older
# than the window are the increments, the change record and every dedup record written.
# Returns {1} (written), {-1} (another instance), or {0, status, hwm, status, hwm, ...}
# (nothing written): per batch 1 new, 0 applied before, -2 too old (hwm: that client's
# highest seq).
_APPLY = _Script("apply", """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local window = tonumber(ARGV[2])
local nd = tonumber(ARGV[8])
local top, hwm = {}, {}
for d = 1, nd do
  local t = redis.call('ZRANGE', KEYS[2 + d], -1, -1, 'WITHSCORES')
  top[d] = t[2] or '-1'
  hwm[d] = tonumber(top[d])
end
local out, clean = {0}, true
for a = 9, #ARGV, 2 do
  local d, seq = tonumber(ARGV[a]), ARGV[a + 1]
  if tonumber(seq) <= hwm[d] - window then
    out[#out + 1] = -2
    out[#out + 1] = top[d]
    clean = false
  elseif redis.call('ZSCORE', KEYS[2 + d], seq) then
    out[#out + 1] = 0
    out[#out + 1] = ''
    clean = false
  else
    out[#out + 1] = 1
    out[#out + 1] = ''
  end
end
if not clean then return out end
local sizes, entries = ARGV[5], ARGV[6]
local width = tonumber(ARGV[7])
local record = width + 9
local pos, p = 1, 1
for k = 3 + nd, #KEYS do
  local key, nf = KEYS[k]
  nf, pos = struct.unpack('<I4', sizes, pos)
  for _ = 1, nf do
    local field = string.sub(entries, p + 1, p + string.byte(entries, p))
    local inc = struct.unpack('<l', entries, p + 1 + width)
    if inc >= 1e13 then inc = string.format('%d', inc) end  -- beyond %.14g's exact integers
    redis.call('HINCRBY', key, field, inc)
    p = p + record
  end
end
redis.call('RPUSH', KEYS[2], ARGV[4])
for a = 9, #ARGV, 2 do
  local d, seq = tonumber(ARGV[a]), ARGV[a + 1]
  redis.call('ZADD', KEYS[2 + d], seq, seq)
  if tonumber(seq) > hwm[d] then hwm[d] = tonumber(seq) end
end
for d = 1, nd do
  redis.call('ZREMRANGEBYSCORE', KEYS[2 + d], '-inf', hwm[d] - window)
  redis.call('PEXPIRE', KEYS[2 + d], ARGV[3])
end
return {1}
""")

# KEYS: clock, epochs. ARGV: instance, epoch_ms, history_epochs. Returns {cur, floor}.
_TICK = _Script("tick", """
local c = redis.call('HMGET', KEYS[1], 'instance', 'cur', 't', 'floor')
if c[1] ~= ARGV[1] then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local opened = tonumber(c[3])
if now > opened and now - opened >= tonumber(ARGV[2]) then
  local cur = string.format('%d', math.max(tonumber(c[2]) + 1, now))
  redis.call('LPUSH', KEYS[2], cur)
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[3]))
  local floor = redis.call('LINDEX', KEYS[2], -1)
  redis.call('HSET', KEYS[1], 'cur', cur, 't', string.format('%d', now), 'floor', floor)
  return {cur, floor}
end
return {c[2], c[4]}
""")

# KEYS: state, changes, history, index. ARGV: instance, cur, floor, since ('' = no read).
# Returns {1} or {1, open piece, piece name, piece, ...}; {-1} wrong instance; {-3} since < trim floor.
# A piece is b"L" + ('<I4' length, roaring bitmap)... or, once sealed, b"R" + one roaring bitmap.
_ROLL = _Script("roll", """
local function joined(parts)
  local out = {'L'}
  for i = 1, #parts do out[#out + 1] = struct.pack('<I4', #parts[i]) .. parts[i] end
  return table.concat(out)
end
local st = redis.call('HMGET', KEYS[1], 'instance', 'e', 'f')
if st[1] ~= ARGV[1] then return {-1} end
if tonumber(st[2]) < tonumber(ARGV[2]) then
  local parts = redis.call('LRANGE', KEYS[2], 0, -1)
  if #parts > 0 then
    local piece = st[2] .. ':' .. ARGV[2]
    redis.call('HSET', KEYS[3], piece, joined(parts))
    redis.call('ZADD', KEYS[4], ARGV[2], piece)
    redis.call('DEL', KEYS[2])
  end
  redis.call('HSET', KEYS[1], 'e', ARGV[2])
end
local f = tonumber(st[3])
if tonumber(ARGV[3]) > f then
  local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
  for i = 1, #old do redis.call('HDEL', KEYS[3], old[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
  redis.call('HSET', KEYS[1], 'f', ARGV[3])
  f = tonumber(ARGV[3])
end
if ARGV[4] == '' then return {1} end
if tonumber(ARGV[4]) < f then return {-3} end
local out = {1, joined(redis.call('LRANGE', KEYS[2], 0, -1))}
local pieces = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. ARGV[4], '+inf')
for i = 1, #pieces do
  out[#out + 1] = pieces[i]
  out[#out + 1] = redis.call('HGET', KEYS[3], pieces[i]) or ''
end
return out
""")

# KEYS: state, history. ARGV: instance, piece, roaring bytes.
_SEAL = _Script("seal", """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return -1 end
local v = redis.call('HGET', KEYS[2], ARGV[2])
if v and string.sub(v, 1, 1) == 'L' then
  redis.call('HSET', KEYS[2], ARGV[2], 'R' .. ARGV[3])
  return 1
end
return 0
""")

# KEYS: state, bucket... ARGV: instance, 5 * token_width.
# Returns {1, fields, counts}: each field as a length byte plus the field zero-padded to
# 5 * token_width bytes; counts as decimal text joined by ','.
_READ = _Script("read", """#!lua flags=no-writes
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local size = tonumber(ARGV[2])
local pad = {}
for l = 0, size do pad[l] = string.rep('\\0', size - l) end
local fields, counts = {}, {}
for k = 2, #KEYS do
  local h = redis.call('HGETALL', KEYS[k])
  for i = 1, #h, 2 do
    local f = h[i]
    fields[#fields + 1] = string.char(#f) .. f .. pad[#f]
    counts[#counts + 1] = h[i + 1]
  end
end
return {1, table.concat(fields), table.concat(counts, ',')}
""")

# KEYS: meta, clock, epochs. ARGV: instance, fingerprint, vocab_size, buckets, shards, schema.
# Returns {} when created, else the existing meta as a flat field/value list.
_CREATE = _Script("create", """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HSET', KEYS[1], 'instance', ARGV[1], 'fingerprint', ARGV[2], 'vocab_size', ARGV[3],
           'buckets', ARGV[4], 'shards', ARGV[5], 'schema', ARGV[6])
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], now)
redis.call('HSET', KEYS[2], 'instance', ARGV[1], 'cur', now, 't', now, 'floor', now)
return {}
""")

_SCRIPTS = (_APPLY, _TICK, _ROLL, _SEAL, _READ, _CREATE)

# Server states that pass (failover, loading, resharding, memory pressure): retrying can help.
_UNAVAILABLE_ERRORS = (rexc.ClusterDownError, rexc.ClusterError, rexc.TryAgainError, rexc.MasterDownError,
                       rexc.MovedError, rexc.AskError, rexc.SlotNotCoveredError, rexc.ReadOnlyError,
                       rexc.BusyLoadingError, rexc.OutOfMemoryError)
_UNAVAILABLE_PREFIXES = ("OOM", "BUSY", "LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY",
                         "MOVED", "ASK")


class _Handle:
    """A namespace's immutable record and its key names (cached; dropped on a stale instance)."""

    __slots__ = ("clock", "epochs", "info", "meta", "shards")

    def __init__(self, prefix: str, info: NamespaceInfo) -> None:
        self.info = info
        self.shards = schema.shard_keys(prefix, info.name, info.instance, info.shards)
        self.meta = schema.meta_key(prefix, info.name)
        self.clock = schema.clock_key(prefix, info.name)
        self.epochs = schema.epochs_key(prefix, info.name)


class _StaleHandle(Exception):
    """A script saw another instance id: the namespace was dropped or recreated meanwhile."""


# Rebuild leases (KEYS: lease, fence[, gen] of one namespace, one slot). A lease is the
# string "<holder>|<token>" with a PX expiry; the token comes from INCR on the fence key.
_ACQUIRE = _Script("acquire_lease", """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.match(cur, '^(.*)|%d+$')
  if holder ~= ARGV[1] then return {0, holder or cur, redis.call('PTTL', KEYS[1])} end
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {token, '', 0}
""")
_RENEW = _Script("renew_lease", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")
_RELEASE = _Script("release_lease", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
""")
# KEYS: lease, gen. ARGV: "<holder>|<token>", generation, location, token, kind.
_COMMIT = _Script("commit_generation", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 'lease'} end
local g = tonumber(redis.call('HGET', KEYS[2], 'generation') or '0')
if tonumber(ARGV[2]) <= g then return {0, tostring(g)} end
redis.call('HSET', KEYS[2], 'generation', ARGV[2], 'location', ARGV[3], 'token', ARGV[4], 'kind', ARGV[5])
return {1, ''}
""")


class RedisCountsStore(CountsStore):
    """Counts in a standalone Redis or a Redis Cluster. Thread-safe; share one per process.

    Args:
        config: a `CountsStoreConfig` whose url is redis://, rediss://, redis+cluster:// or
            rediss+cluster://.

    Raises:
        BackendUnavailableError: Redis could not be reached.
        StoreAuthenticationError: Redis refused the credentials.
    """

    def __init__(self, config: CountsStoreConfig) -> None:
        address = config.address
        if address.kind == "embedded":
            raise InvalidArgumentError("RedisCountsStore needs a redis URL")
        self.config = config
        self._secret = address.password or ""
        self._cluster = address.kind == "cluster"
        self._where = address.redacted
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), config.retries)
        common: dict[str, Any] = {"username": address.username, "password": address.password,
                                  "socket_timeout": config.socket_timeout or None,
                                  "socket_connect_timeout": config.connect_timeout or None, "ssl": address.ssl}
        self._handles: dict[str, _Handle] = {}
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        with self._errors():
            if self._cluster:
                nodes = [ClusterNode(host, port) for host, port in address.hosts]  # type: ignore[no-untyped-call]
                self._client: Any = RedisCluster(startup_nodes=nodes, retry=retry, **common)
            else:
                (host, port), = address.hosts
                self._client = redis.Redis(host=host, port=port, db=address.db, retry=retry,
                                           retry_on_error=[rexc.ConnectionError, rexc.TimeoutError], **common)
                self._client.ping()
        log.debug("counts store connected to %s", self._where)

    def __repr__(self) -> str:
        return f"RedisCountsStore({self._where!r}, cluster={self._cluster})"

    # ----------------------------------------------------------------- plumbing

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Translate redis-py errors into the store's errors, without credentials in the message."""
        try:
            yield
        except NgramCacheError:
            raise
        except (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError) as exc:
            raise StoreAuthenticationError(f"{self._where} refused the credentials ({self._scrub(exc)})") from None
        except _UNAVAILABLE_ERRORS as exc:
            raise BackendUnavailableError(
                f"{self._where} is unavailable: {type(exc).__name__}: {self._scrub(exc)}") from None
        except rexc.ResponseError as exc:
            message = self._scrub(exc)
            if message.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise StoreAuthenticationError(f"{self._where} refused the credentials ({message})") from None
            if message.startswith(_UNAVAILABLE_PREFIXES):
                raise BackendUnavailableError(f"{self._where} is unavailable: {message}") from None
            raise NgramCacheError(f"{self._where} answered an error: {message}") from None
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            raise BackendUnavailableError(
                f"{self._where} is unavailable: {type(exc).__name__}: {self._scrub(exc)}") from None

    def _scrub(self, exc: BaseException) -> str:
        message = str(exc)
        return message.replace(self._secret, "***") if self._secret else message

    def _load_scripts(self, scripts: Iterable[_Script]) -> None:
        for script in scripts:
            log.debug("loading Lua script %s (%s)", script.name, script.sha)
            if self._cluster:
                for node in self._client.get_primaries():
                    self._client.get_redis_connection(node).script_load(script.source)
            else:
                self._client.script_load(script.source)

    def _run(self, calls: Sequence[tuple[_Script, Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """Run scripts pipelined (one round trip per node); NOSCRIPT loads and runs those again.

        Raises the first error other than NOSCRIPT, after every call was attempted.
        """
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for _attempt in range(2):
            with self._errors():
                pipe = self._client.pipeline(transaction=False)
                for i in pending:
                    script, keys, args = calls[i]
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                replies = pipe.execute(raise_on_error=False)
            missing = []
            for i, reply in zip(pending, replies):
                results[i] = reply
                if isinstance(reply, rexc.NoScriptError):
                    missing.append(i)
            if not missing:
                break
            with self._errors():
                self._load_scripts({calls[i][0] for i in missing})
            pending = missing
        for reply in results:
            if isinstance(reply, BaseException):
                with self._errors():
                    raise reply
        return results

    def _run_one(self, script: _Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return self._run([(script, keys, args)])[0]

    def _handle(self, namespace: str, *, refresh: bool = False) -> _Handle:
        validate_namespace(namespace)
        if not refresh:
            with self._lock:
                handle = self._handles.get(namespace)
            if handle is not None:
                return handle
        with self._errors():
            raw = self._client.hgetall(schema.meta_key(self.config.prefix, namespace))
        if not raw:
            with self._lock:
                self._handles.pop(namespace, None)
            raise no_such_namespace(namespace)
        handle = _Handle(self.config.prefix, self._info_from_meta(namespace, raw))
        with self._lock:
            self._handles[namespace] = handle
        return handle

    @staticmethod
    def _info_from_meta(namespace: str, raw: dict[Any, Any]) -> NamespaceInfo:
        meta = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}
        if int(meta.get("schema", 0)) != schema.SCHEMA_VERSION:
            raise NgramCacheError(f"namespace {namespace!r} uses key schema {meta.get('schema')}, "
                                  f"this code reads schema {schema.SCHEMA_VERSION}")
        return NamespaceInfo(namespace, meta["fingerprint"], int(meta["vocab_size"]), int(meta["buckets"]),
                             int(meta["shards"]), meta["instance"])

    def _with_handle(self, namespace: str, action: Callable[[_Handle], _T]) -> _T:
        """Run ``action(handle)``; when a script saw another instance, refresh the handle once and rerun."""
        handle = self._handle(namespace)
        try:
            return action(handle)
        except _StaleHandle:
            log.debug("namespace %s changed instance; reloading its record", namespace)
            fresh = self._handle(namespace, refresh=True)
            if fresh.info.instance == handle.info.instance:
                raise NamespaceNotFoundError(
                    f"namespace {namespace!r} lost its shard state (a Redis node restarted without "
                    "persistence?); drop and recreate it") from None
            try:
                return action(fresh)
            except _StaleHandle:
                raise namespace_changed(namespace, "the call") from None

    # ----------------------------------------------------------------- rebuild leases

    def acquire_lease(self, namespace: str, holder: str, ttl_ms: int) -> Lease:
        check_lease_args(namespace, holder, ttl_ms)
        lease, fence, _ = schema.lease_keys(self.config.prefix, namespace)
        token, other, left = self._run_one(_ACQUIRE, [lease, fence], [holder, ttl_ms])
        if int(token) == 0:
            raise lease_held(namespace, other.decode() if isinstance(other, bytes) else str(other), int(left))
        return Lease(namespace, holder, int(token))

    def renew_lease(self, lease: Lease, ttl_ms: int) -> bool:
        check_ttl(ttl_ms)
        key = schema.lease_keys(self.config.prefix, lease.namespace)[0]
        return bool(self._run_one(_RENEW, [key], [f"{lease.holder}|{lease.token}", ttl_ms]))

    def release_lease(self, lease: Lease) -> bool:
        key = schema.lease_keys(self.config.prefix, lease.namespace)[0]
        return bool(self._run_one(_RELEASE, [key], [f"{lease.holder}|{lease.token}"]))

    def commit_generation(self, lease: Lease, generation: int, location: str, kind: str = "rebuild") -> None:
        key, _, gen = schema.lease_keys(self.config.prefix, lease.namespace)
        ok, why = self._run_one(_COMMIT, [key, gen], [f"{lease.holder}|{lease.token}", generation, location,
                                                      lease.token, kind])
        if int(ok) == 0:
            why = why.decode() if isinstance(why, bytes) else str(why)
            if why == "lease":
                raise lease_lost(lease)
            raise not_newer(lease.namespace, generation, int(why))

    def committed_generation(self, namespace: str) -> CommittedGeneration:
        validate_namespace(namespace)
        gen = schema.lease_keys(self.config.prefix, namespace)[2]
        with self._errors():
            raw = self._client.hgetall(gen)
        if not raw:
            return CommittedGeneration(0, "", 0)
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        return CommittedGeneration(int(d["generation"]), d.get("location", ""), int(d.get("token", 0)),
                                   d.get("kind", "rebuild"))

    # ----------------------------------------------------------------- namespaces

    def _default_shards(self) -> int:
        return _CLUSTER_DEFAULT_SHARDS if self._cluster else 1

    def _find_namespace(self, namespace: str) -> NamespaceInfo | None:
        try:
            return self._handle(namespace, refresh=True).info
        except NamespaceNotFoundError:
            return None

    def _namespace_names(self) -> list[str]:
        prefix = self.config.prefix
        names: list[str] = []
        with self._errors():
            for node_client in self._node_clients():  # a Cluster: every primary holds some records
                for key in node_client.scan_iter(match=schema.meta_match(prefix), count=1000):
                    name = schema.namespace_of_meta_key(prefix, key)
                    if name is not None:
                        names.append(name)
        return names

    def _insert_namespace(self, info: NamespaceInfo) -> NamespaceInfo | None:
        handle = _Handle(self.config.prefix, info)
        # Shard state first: the namespace becomes visible (meta) only once every shard can take writes.
        with self._errors():
            pipe = self._client.pipeline(transaction=False)
            for sk in handle.shards:
                pipe.hset(sk.state, mapping={"instance": info.instance, "e": 0, "f": 0})
            pipe.execute()
        existing = self._run_one(_CREATE, [handle.meta, handle.clock, handle.epochs],
                                 [info.instance, info.fingerprint, info.vocab_size, info.buckets, info.shards,
                                  schema.SCHEMA_VERSION])
        if existing:  # lost a creation race: forget our shard state, bind to the winner
            with self._errors():
                pipe = self._client.pipeline(transaction=False)
                for sk in handle.shards:
                    pipe.delete(sk.state)
                pipe.execute()
            return self._handle(info.name, refresh=True).info
        with self._lock:
            self._handles[info.name] = handle
        log.debug("created counts namespace %s (%d buckets, %d shards)", info.name, info.buckets, info.shards)
        return None

    def namespace_info(self, namespace: str) -> NamespaceInfo:
        return self._handle(namespace, refresh=True).info

    def drop_namespace(self, namespace: str) -> bool:
        validate_namespace(namespace)
        prefix = self.config.prefix
        try:
            handle: _Handle | None = self._handle(namespace, refresh=True)
        except NamespaceNotFoundError:
            handle = None
        with self._errors():
            if handle is not None:
                # Shard state first: from here on no APPLY of this instance succeeds.
                pipe = self._client.pipeline(transaction=False)
                for sk in handle.shards:
                    pipe.delete(sk.state)
                pipe.execute()
                self._client.delete(handle.meta, handle.clock, handle.epochs)
            with self._lock:
                self._handles.pop(namespace, None)
            pattern = schema.instance_match(prefix, namespace)
            for node_client in self._node_clients():
                batch: list[bytes] = []
                for key in node_client.scan_iter(match=pattern, count=1000):
                    batch.append(key)
                    if len(batch) >= 1000:
                        self._unlink(node_client, batch)
                        batch = []
                self._unlink(node_client, batch)
        return handle is not None

    @staticmethod
    def _unlink(node_client: Any, keys: list[bytes]) -> None:
        if keys:
            pipe = node_client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            pipe.execute()

    def _node_clients(self) -> list[Any]:
        if self._cluster:
            return [self._client.get_redis_connection(node) for node in self._client.get_primaries()]
        return [self._client]

    # ----------------------------------------------------------------- writes

    def _apply_batches(self, namespace: str, client_id: str, batches: list[tuple[int, np.ndarray]],
                       fingerprint: bytes | str | None) -> list[ApplyResult]:
        """Apply batches pipelined: encoding the next round trip overlaps the current one."""

        def run(handle: _Handle) -> list[ApplyResult]:
            self._check_batches(handle.info, fingerprint, batches)
            return self._apply_pipelined(handle, client_id, batches)

        return self._with_handle(namespace, run)

    def _apply_pipelined(self, handle: _Handle, client_id: str,
                         batches: list[tuple[int, np.ndarray]]) -> list[ApplyResult]:
        """Up to two round trips in flight on two connections, so Redis works while we encode the next."""
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

    def _apply_calls(self, handle: _Handle, client_id: str,
                     group: list[tuple[int, EncodedBatch]]) -> list[_Call]:
        calls: list[_Call] = []
        for seq, enc in group:
            bounds = enc.shard_bounds.tolist()
            for s in range(handle.info.shards):
                if bounds[s] != bounds[s + 1]:
                    calls.append(self._unit_call(handle, s, enc, [(client_id, seq)]))
        return calls

    def _unit_call(self, handle: _Handle, shard: int, enc: EncodedBatch, batches: Sequence[tuple[str, int]]) -> _Call:
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
        return (_APPLY, keys, [info.instance, self.config.dedup_window, self.config.dedup_ttl_ms, *args,
                               len(clients), *pairs])

    def _finish_apply(self, calls: list[_Call], group: list[tuple[int, EncodedBatch]]) -> list[ApplyResult]:
        replies = self._run(calls)
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
                    raise _StaleHandle()
                elif int(reply[1]) == 0:
                    duplicates += 1
                else:
                    too_old = (seq, int(float(reply[2])))
            position += units
            results.append(ApplyResult(units, applied, duplicates, enc.entries))
        if too_old is not None:
            raise batch_too_old(*too_old, self.config.dedup_window)
        return results

    def _apply_group(self, namespace: str, items: list[GroupItem]) -> list[ItemOutcome]:
        def run(handle: _Handle) -> list[ItemOutcome]:
            outcomes, parts = self._check_group(handle.info, items)
            for part in parts:
                for i, outcome in zip(part, self._apply_part(handle, [items[i] for i in part])):
                    outcomes[i] = outcome
            return self._complete(outcomes)

        return self._with_handle(namespace, run)

    def _apply_part(self, handle: _Handle, items: list[GroupItem]) -> list[ItemOutcome]:
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
            calls: list[_Call] = []
            for s, alive in pending.items():
                enc = group.batch if first_round else encodings.get(alive)
                if enc is None:
                    enc = encodings[alive] = encode_group([items[i].deltas for i in alive], info).batch
                calls.append(self._unit_call(handle, s, enc, [(items[i].client_id, items[i].seq) for i in alive]))
            first_round = False
            again: dict[int, tuple[int, ...]] = {}
            for (s, alive), reply in zip(pending.items(), self._run(calls)):
                code = int(reply[0])
                if code == 1:
                    for i in alive:
                        applied[i] += 1
                    continue
                if code == -1:
                    raise _StaleHandle()
                fresh = []
                for j, i in enumerate(alive):
                    status = int(reply[1 + 2 * j])
                    if status == 1:
                        fresh.append(i)
                    elif status == 0:
                        duplicates[i] += 1
                    else:
                        too_old[i] = batch_too_old(items[i].seq, int(float(reply[2 + 2 * j])),
                                                   self.config.dedup_window)
                if fresh:
                    again[s] = tuple(fresh)
            pending = again
        units = group.item_shards.sum(axis=1).tolist()
        entries = group.item_entries.tolist()
        return [too_old.get(i) or ApplyResult(units[i], applied[i], duplicates[i], entries[i]) for i in range(k)]

    # ----------------------------------------------------------------- reads

    def lookup(self, namespace: str, ngram: Sequence[int]) -> dict[int, int]:
        def run(handle: _Handle) -> dict[int, int]:
            info = handle.info
            bucket = ngram_bucket(ngram, info)
            rows = self._read_buckets(handle, [bucket])
            key = ngram_key(ngram, info)
            n = len(key) // info.token_width
            tokens = np.array(list(ngram), dtype=np.int64)
            tokens_of = rows[:, TOKENS][:, :n]
            hit = (rows[:, N] == n) & (tokens_of == tokens[None, :]).all(axis=1)
            return {int(f): int(c) for f, c in zip(rows[hit, FOLLOWER].tolist(), rows[hit, COUNT].tolist())}

        return self._with_handle(namespace, run)

    def _read_buckets(self, handle: _Handle, buckets: Iterable[int]) -> np.ndarray:
        """Rows of the given buckets, read atomically bucket by bucket (one READ call per shard slice)."""
        info = handle.info
        by_shard: dict[int, list[int]] = {}
        for b in buckets:
            by_shard.setdefault(b % info.shards, []).append(b)
        calls: list[_Call] = []
        for s, ids in by_shard.items():
            sk = handle.shards[s]
            for i in range(0, len(ids), _READ_KEYS_PER_CALL):
                keys = [sk.state] + [sk.base + str(b) for b in ids[i:i + _READ_KEYS_PER_CALL]]
                calls.append((_READ, keys, [info.instance, FIELD_TOKENS * info.token_width]))
        parts = []
        for reply in self._run(calls):
            if int(reply[0]) == -1:
                raise _StaleHandle()
            parts.append(_rows_from_read(reply, info.token_width))
        return np.concatenate(parts) if parts else empty_counts()

    def _tick(self, handle: _Handle) -> tuple[int, int]:
        reply = self._run_one(_TICK, [handle.clock, handle.epochs],
                              [handle.info.instance, self.config.epoch_ms, self.config.history_epochs])
        if int(reply[0]) == -1:
            raise _StaleHandle()
        return int(reply[0]), int(reply[1])

    def _roll(self, handle: _Handle, cur: int, floor: int, since: int | None) -> list[Any]:
        calls: list[_Call] = [(_ROLL, [sk.state, sk.changes, sk.history, sk.index],
                  [handle.info.instance, cur, floor, "" if since is None else since])
                 for sk in handle.shards]
        replies = self._run(calls)
        for reply in replies:
            if int(reply[0]) == -1:
                raise _StaleHandle()
        return replies

    def version(self, namespace: str) -> int:
        def run(handle: _Handle) -> int:
            cur, floor = self._tick(handle)
            self._roll(handle, cur, floor, None)
            return cur

        return self._with_handle(namespace, run)

    def changes_since(self, namespace: str, version: int) -> ChangeSet:
        since = int(version)

        def run(handle: _Handle) -> ChangeSet:
            info = handle.info
            cur, floor = self._tick(handle)
            check_version(namespace, since, floor, cur)
            replies = self._roll(handle, cur, floor, since)
            changed = pyroaring.BitMap()
            seals: list[_Call] = []
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
                        seals.append((_SEAL, [sk.state, sk.history], [info.instance, piece, bits.serialize()]))
                if local:
                    ids = np.fromiter(local, dtype=np.int64, count=len(local))
                    changed.update((ids * info.shards + s).tolist())
            if seals:
                self._run(seals)
            buckets = np.array(changed, dtype=np.uint32) if changed else np.zeros(0, dtype=np.uint32)
            rows = self._read_buckets(handle, buckets.tolist())
            return ChangeSet(cur, rows, buckets)

        return self._with_handle(namespace, run)

    def export(self, namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        handle = self._handle(namespace, refresh=True)
        info = handle.info
        pattern = schema.bucket_match(self.config.prefix, namespace, info.instance)
        seen = pyroaring.BitMap()
        per_read = max(1, min(_READ_KEYS_PER_CALL, chunk_rows // 16))  # ~16+ entries a bucket
        pending: list[int] = []
        out: list[np.ndarray] = []
        out_rows = 0
        for node_client in self._node_clients():
            with self._errors():
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

    def _read_export(self, handle: _Handle, buckets: list[int]) -> np.ndarray:
        try:
            return self._read_buckets(handle, buckets)
        except _StaleHandle:
            raise namespace_changed(handle.info.name, "export") from None

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self._client.close()


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
