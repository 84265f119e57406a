"""The dynamic counts store: one interface, the delta format, the shared bucket layout and the backend factory.

Dynamic counts are (n-gram of 1..4 tokens, follower token) -> count, per cache namespace.
Two backends implement `CountsStore`:

* `cache_service.embedded_store.EmbeddedCountsStore`: in-process, optional snapshot file.
* `cache_service.redis_store.RedisCountsStore`: a standalone Redis or a Redis Cluster.

`open_counts_store(url)` chooses by URL:

==========================================  ==============================================
``None`` or ``""``                          embedded, in memory only (nothing persisted)
``embedded://PATH``                         embedded, snapshotted to PATH (``embedded:///abs``)
``redis://[[user]:pass@]host:port[/db]``    standalone Redis
``rediss://...``                            standalone Redis over TLS
``redis+cluster://[[user]:pass@]h:p[,h:p]`` Redis Cluster (any reachable nodes; TLS: ``rediss+cluster://``)
==========================================  ==============================================

Store options may ride in the query string (``?epoch_seconds=0.5&prefix=ngc``); see
`CountsStoreConfig`.

Logical layout shared by both backends (the Redis key names are in `redis_schema`):

* A namespace has ``buckets`` (a power of two) buckets. The bucket of an n-gram is
  ``mmh3.hash(ngram_bytes, HASH_SEED, signed=False) & (buckets - 1)``, so all followers of
  an n-gram share a bucket and `lookup` reads one bucket.
* A namespace has ``shards`` shards; bucket ``b`` belongs to shard ``b % shards`` and has
  local id ``b // shards`` inside it. A shard is the unit of atomicity (see `apply`).
* An entry's field is its n-gram tokens followed by its follower, each token written as
  ``token_width`` little-endian bytes (``token_width`` is the fewest bytes that hold
  ``vocab_size - 1``). So ``n = len(field) // token_width - 1`` and the n-gram bytes are
  the field's prefix.

Versions are integers: the server time in milliseconds at which an epoch opened, bumped by
at least one. A fresh history (a new namespace, an embedded store reloaded from its
snapshot) therefore starts above every version handed out before it, and an old version is
answered with `ResyncRequiredError` instead of a silently wrong mirror.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import mmh3
import numpy as np

from ngramcache.client.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    TokenizerMismatchError,
)

__all__ = [
    "ApplyResult",
    "BatchTooOldError",
    "ChangeSet",
    "CountsStore",
    "CountsStoreConfig",
    "DELTA_COLUMNS",
    "EncodedBatch",
    "HASH_SEED",
    "MAX_N",
    "NamespaceInfo",
    "NamespaceNotFoundError",
    "StoreAuthenticationError",
    "decode_fields",
    "encode_batch",
    "fields_and_buckets",
    "murmur3_32",
    "ngram_bucket",
    "normalize_fingerprint",
    "rows_from_matrix",
    "open_counts_store",
    "redact_url",
    "token_width",
    "validate_client_id",
    "validate_deltas",
    "validate_namespace",
    "validate_seq",
]

MAX_N = 4
"""Largest n-gram size stored (llama.cpp's LLAMA_NGRAM_MAX)."""

DELTA_COLUMNS = 7
"""A delta row is (n, t0, t1, t2, t3, follower, count)."""

HASH_SEED = 0
"""Seed of the mmh3 (MurmurHash3 x86_32) bucket hash. Changing it changes the layout."""

MAX_AGGREGATED_COUNT = 10**14
"""Largest summed increment for one entry in one batch (Redis Lua prints numbers exactly up to 1e14)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")
_MAX_SEQ = 2**53 - 1  # seqs travel through Lua numbers (doubles)
_MAX_VOCAB = 2**31 - 1  # tokens are int32


# --------------------------------------------------------------------------- errors


class NamespaceNotFoundError(InvalidArgumentError):
    """The namespace does not exist (never created, dropped, or its state was lost)."""


class BatchTooOldError(InvalidArgumentError):
    """A batch's seq fell out of the dedup window, so the store cannot tell whether it was applied.

    The unit it addressed was not applied. A sender that keeps at most ``dedup_window``
    batches unacknowledged never sees this error.
    """


class StoreAuthenticationError(BackendUnavailableError):
    """The store refused the credentials; retrying with the same ones cannot help."""

    retriable = False


# --------------------------------------------------------------------------- values


@dataclasses.dataclass(frozen=True)
class NamespaceInfo:
    """The immutable record of a namespace, fixed at creation.

    Attributes:
        name: the namespace name.
        fingerprint: tokenizer fingerprint, 64 lowercase hex digits (32 bytes).
        vocab_size: tokens and followers lie in [0, vocab_size).
        buckets: number of buckets, a power of two.
        shards: number of shards (units of atomicity); divides ``buckets``.
        instance: random id of this incarnation; a dropped and recreated namespace gets a new one.
    """

    name: str
    fingerprint: str
    vocab_size: int
    buckets: int
    shards: int
    instance: str

    @property
    def token_width(self) -> int:
        return token_width(self.vocab_size)


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What `CountsStore.apply` did with a batch.

    Attributes:
        units: units the batch touched (1 on standalone Redis and embedded; up to
            ``shards`` on a Cluster; 0 for an empty batch).
        applied: units applied by this call.
        duplicates: units already applied earlier (by a previous attempt of the same batch).
        entries: distinct (n-gram, follower) entries in the batch after summing repeats.
    """

    units: int
    applied: int
    duplicates: int
    entries: int

    @property
    def duplicate(self) -> bool:
        """True when every unit had already been applied: the whole call was a retry."""
        return self.units > 0 and self.duplicates == self.units


@dataclasses.dataclass(frozen=True)
class ChangeSet:
    """The answer of `CountsStore.changes_since`.

    Attributes:
        version: pass it to the next `changes_since` call.
        rows: int64 array (k, 7) of (n, t0, t1, t2, t3, follower, count): the current
            absolute counts of every entry in the changed buckets (unused token slots -1).
            Counts never decrease, so setting each entry of a mirror to its row's count
            (an upsert, not an addition) brings the mirror up to date.
        buckets: uint32 array of the changed bucket ids, sorted.
    """

    version: int
    rows: np.ndarray
    buckets: np.ndarray


# --------------------------------------------------------------------------- config


def _env_bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class CountsStoreConfig:
    """Options of a counts store. Build it with `from_url` or `from_env`; nothing is read at import.

    Attributes:
        url: backend URL (see the module docstring); never printed with its password.
        prefix: first component of every Redis key.
        max_batch_rows: largest batch `apply` accepts (a Lua unit blocks Redis ~1.5 us a row).
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

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={redact_url(self.url)!r}" if f.name == "url" else f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
        )
        return f"CountsStoreConfig({fields})"

    __str__ = __repr__

    @classmethod
    def from_url(cls, url: str | None, **overrides: Any) -> CountsStoreConfig:
        """Build a config from a backend URL; query parameters named like fields set them.

        Raises:
            InvalidArgumentError: unknown scheme, unknown or malformed option.
        """
        options: dict[str, Any] = {}
        if url:
            scheme = url.split("://", 1)[0].lower() if "://" in url else ""
            if scheme not in ("embedded", "redis", "rediss", "redis+cluster", "rediss+cluster"):
                raise InvalidArgumentError(
                    f"unsupported counts store URL {redact_url(url)!r}: use embedded://PATH, "
                    "redis://, rediss://, redis+cluster:// or rediss+cluster://")
            query = urllib.parse.urlsplit(url).query if scheme != "embedded" else url.partition("?")[2]
            for key, values in urllib.parse.parse_qs(query, keep_blank_values=True).items():
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


_CONFIG_FIELDS: dict[str, Any] = {
    "prefix": str,
    "max_batch_rows": _parse_int,
    "dedup_window": _parse_int,
    "dedup_ttl_seconds": _parse_float,
    "epoch_seconds": _parse_float,
    "history_epochs": _parse_int,
    "default_buckets": _parse_int,
    "default_shards": _parse_optional_int,
    "socket_timeout": _parse_float,
    "connect_timeout": _parse_float,
    "retries": _parse_int,
    "snapshot_seconds": _parse_float,
}


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


# --------------------------------------------------------------------------- validation


def validate_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is 1..64 characters of [A-Za-z0-9_.-], else raise InvalidArgumentError."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgumentError(f"namespace must be 1..64 characters of [A-Za-z0-9_.-], got {namespace!r}")
    return namespace


def validate_client_id(client_id: str) -> str:
    """Return ``client_id`` if it is 1..128 characters of [A-Za-z0-9_.:@/-], else raise InvalidArgumentError."""
    if not isinstance(client_id, str) or not _CLIENT_ID_RE.fullmatch(client_id):
        raise InvalidArgumentError(f"client_id must be 1..128 characters of [A-Za-z0-9_.:@/-], got {client_id!r}")
    return client_id


def validate_seq(seq: int) -> int:
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= int(seq) <= _MAX_SEQ:
        raise InvalidArgumentError(f"seq must be an integer in [0, 2**53), got {seq!r}")
    return int(seq)


def normalize_fingerprint(fingerprint: bytes | str) -> str:
    """A tokenizer fingerprint (32 bytes or 64 hex digits) as 64 lowercase hex digits."""
    if isinstance(fingerprint, (bytes, bytearray, memoryview)):
        raw = bytes(fingerprint)
        if len(raw) != 32:
            raise InvalidArgumentError(f"fingerprint must be 32 bytes, got {len(raw)}")
        return raw.hex()
    if isinstance(fingerprint, str) and re.fullmatch(r"[0-9a-fA-F]{64}", fingerprint):
        return fingerprint.lower()
    raise InvalidArgumentError("fingerprint must be 32 bytes or 64 hex digits")


def validate_vocab_size(vocab_size: int) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) \
            or not 1 <= int(vocab_size) <= _MAX_VOCAB:
        raise InvalidArgumentError(f"vocab_size must be in [1, 2**31), got {vocab_size!r}")
    return int(vocab_size)


def validate_layout(buckets: int, shards: int) -> tuple[int, int]:
    buckets, shards = int(buckets), int(shards)
    if buckets < 1 or buckets > 2**30 or buckets & (buckets - 1):
        raise InvalidArgumentError(f"buckets must be a power of two in [1, 2**30], got {buckets}")
    if shards < 1 or shards > 16384 or shards & (shards - 1) or shards > buckets:
        raise InvalidArgumentError(f"shards must be a power of two in [1, min(buckets, 16384)], got {shards}")
    return buckets, shards


def check_tokenizer(info: NamespaceInfo, fingerprint: bytes | str | None, vocab_size: int | None = None) -> None:
    """Raise TokenizerMismatchError when ``fingerprint``/``vocab_size`` differ from the namespace's."""
    if fingerprint is not None and normalize_fingerprint(fingerprint) != info.fingerprint:
        raise TokenizerMismatchError(
            f"namespace {info.name!r} is bound to tokenizer {info.fingerprint[:16]}..., "
            f"not {normalize_fingerprint(fingerprint)[:16]}...")
    if vocab_size is not None and int(vocab_size) != info.vocab_size:
        raise TokenizerMismatchError(
            f"namespace {info.name!r} has vocab_size {info.vocab_size}, not {int(vocab_size)}")


def token_width(vocab_size: int) -> int:
    """Bytes per token in a field: the fewest that hold ``vocab_size - 1``."""
    return max(1, (max(vocab_size - 1, 0).bit_length() + 7) // 8)


_ROW_PROBLEMS = (
    "n must be in 1..4",
    "a token of the n-gram is outside [0, vocab_size)",
    "an unused token slot (t{n}..t3) is not -1",
    "follower is outside [0, vocab_size)",
    "count must be > 0",
)


def validate_deltas(deltas: Any, vocab_size: int, max_rows: int) -> np.ndarray:
    """Check a delta batch whole; return it unchanged if valid.

    Args:
        deltas: C-contiguous int32 array of shape (m, 7), rows (n, t0, t1, t2, t3, follower, count).
        vocab_size: the namespace's vocabulary size.
        max_rows: the largest m accepted.

    Raises:
        InvalidArgumentError: naming the first bad row and what is wrong with it.
    """
    if not isinstance(deltas, np.ndarray):
        raise InvalidArgumentError(f"deltas must be a numpy array, got {type(deltas).__name__}")
    if deltas.dtype != np.int32:
        raise InvalidArgumentError(f"deltas must have dtype int32, got {deltas.dtype}")
    if deltas.ndim != 2 or deltas.shape[1] != DELTA_COLUMNS:
        raise InvalidArgumentError(f"deltas must have shape (m, 7), got {deltas.shape}")
    if not deltas.flags.c_contiguous:
        raise InvalidArgumentError("deltas must be C-contiguous")
    m = deltas.shape[0]
    if m > max_rows:
        raise InvalidArgumentError(f"batch has {m} rows, more than max_batch_rows={max_rows}")
    if m == 0:
        return deltas
    n = deltas[:, 0]
    toks = deltas[:, 1:5]
    follower = deltas[:, 5]
    count = deltas[:, 6]
    bad_n = (n < 1) | (n > MAX_N)
    used = np.arange(MAX_N)[None, :] < n[:, None]
    bad_tok = (used & ((toks < 0) | (toks >= vocab_size))).any(axis=1)
    bad_pad = (~used & (toks != -1)).any(axis=1) & ~bad_n
    bad_follower = (follower < 0) | (follower >= vocab_size)
    bad_count = count <= 0
    problems = np.stack([bad_n, bad_tok & ~bad_n, bad_pad, bad_follower, bad_count])
    if problems.any():
        row = int(np.flatnonzero(problems.any(axis=0))[0])
        what = _ROW_PROBLEMS[int(np.flatnonzero(problems[:, row])[0])]
        raise InvalidArgumentError(
            f"bad delta batch, refused whole: row {row} {deltas[row].tolist()}: {what} "
            f"(vocab_size={vocab_size})")
    return deltas


# --------------------------------------------------------------------------- layout codec


def _token_bytes(values: np.ndarray, width: int) -> np.ndarray:
    """uint8 (k, c*width): each int of ``values`` (k, c) as ``width`` little-endian bytes."""
    k, c = values.shape
    le = np.ascontiguousarray(values, dtype="<u4").view(np.uint8).reshape(k, c, 4)
    return np.ascontiguousarray(le[:, :, :width]).reshape(k, c * width)


_U32 = np.uint32


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


def murmur3_32(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """MurmurHash3 x86_32 of each row of a uint8 matrix (k, L): ``mmh3.hash(row, seed, signed=False)``, vectorized.

    The unit tests compare it with mmh3 for every length; `ngram_bucket` uses mmh3 itself.
    """
    k, length = keys.shape
    c1, c2 = _U32(0xCC9E2D51), _U32(0x1B873593)
    h = np.full(k, seed, dtype=np.uint32)
    nblocks = length // 4
    if nblocks:
        blocks = np.ascontiguousarray(keys[:, :nblocks * 4]).view("<u4").reshape(k, nblocks)
        for i in range(nblocks):
            k1 = _rotl(blocks[:, i] * c1, 15) * c2
            h = _rotl(h ^ k1, 13) * _U32(5) + _U32(0xE6546B64)
    tail = length & 3
    if tail:
        k1 = np.zeros(k, dtype=np.uint32)
        for j in range(tail - 1, -1, -1):
            k1 = (k1 << _U32(8)) | keys[:, nblocks * 4 + j].astype(np.uint32)
        h ^= _rotl(k1 * c1, 15) * c2
    h ^= _U32(length)
    h ^= h >> _U32(16)
    h *= _U32(0x85EBCA6B)
    h ^= h >> _U32(13)
    h *= _U32(0xC2B2AE35)
    h ^= h >> _U32(16)
    return h


def ngram_bucket(ngram: Sequence[int], info: NamespaceInfo) -> int:
    """The bucket of one n-gram (validated against the namespace's vocabulary)."""
    tokens = [int(t) for t in ngram]
    if not 1 <= len(tokens) <= MAX_N:
        raise InvalidArgumentError(f"an n-gram has 1..4 tokens, got {len(tokens)}")
    if any(not 0 <= t < info.vocab_size for t in tokens):
        raise InvalidArgumentError(f"n-gram token outside [0, {info.vocab_size})")
    key = _token_bytes(np.array([tokens], dtype=np.int64), info.token_width).tobytes()
    return mmh3.hash(key, HASH_SEED, signed=False) & (info.buckets - 1)


def ngram_key(ngram: Sequence[int], info: NamespaceInfo) -> bytes:
    return _token_bytes(np.array([[int(t) for t in ngram]], dtype=np.int64), info.token_width).tobytes()


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """A validated batch, summed and laid out by bucket: what a backend writes.

    Entries are sorted by (shard, bucket). ``shard_bounds[s]:shard_bounds[s+1]`` are the
    entries of shard s; ``fields[i]`` is the field of entry i (see the module docstring),
    ``counts[i]`` its summed increment.
    """

    buckets: np.ndarray  # int64 (k,) global bucket id per entry
    counts: np.ndarray  # int64 (k,)
    lengths: np.ndarray  # int64 (k,) len(fields[i])
    field_matrix: np.ndarray  # uint8 (k, 5*width), field i = field_matrix[i, :lengths[i]]
    shard_bounds: np.ndarray  # int64 (shards+1,)

    @property
    def entries(self) -> int:
        return len(self.counts)

    def field_list(self) -> list[bytes]:
        """The fields as bytes objects (the embedded backend's dict keys)."""
        out = np.empty(len(self.lengths), dtype=object)
        for length in np.unique(self.lengths).tolist():  # a void view turns rows into bytes in C
            idx = np.flatnonzero(self.lengths == length)
            rows = np.ascontiguousarray(self.field_matrix[idx, :length])
            out[idx] = rows.view(f"V{length}").ravel().tolist()
        return out.tolist()


def fields_and_buckets(rows: np.ndarray, info: NamespaceInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Field matrix, field lengths and bucket of each validated row (n, t0..t3, follower, ...), in row order.

    Returns:
        (matrix uint8 (m, 5*width), lengths int64 (m,), buckets int64 (m,)); row i's field
        is ``matrix[i, :lengths[i]]``.
    """
    m = rows.shape[0]
    w = info.token_width
    n = rows[:, 0].astype(np.int64)
    seq5 = np.zeros((m, MAX_N + 1), dtype=np.int64)
    seq5[:, :MAX_N] = np.maximum(rows[:, 1:5], 0)
    seq5[np.arange(m), n] = rows[:, 5]
    matrix = _token_bytes(seq5, w)
    buckets = np.zeros(m, dtype=np.int64)
    mask = info.buckets - 1
    for size in range(1, MAX_N + 1):
        idx = np.flatnonzero(n == size)
        if idx.size == 0:
            continue
        buckets[idx] = murmur3_32(matrix[idx, :size * w], HASH_SEED).astype(np.int64) & mask
    return matrix, (n + 1) * w, buckets


def encode_batch(deltas: np.ndarray, info: NamespaceInfo) -> EncodedBatch:
    """Sum repeated keys of a validated batch and lay it out by (shard, bucket, field).

    Raises:
        InvalidArgumentError: when one entry's summed increment exceeds 10**14.
    """
    m = deltas.shape[0]
    matrix, lengths, buckets = fields_and_buckets(deltas, info)
    shards = info.shards
    shard = buckets % shards
    # Sort by (shard, bucket, t0, t1, t2, t3, n, follower): repeats become adjacent, units
    # contiguous. Pairs of int32 columns (+1 so -1 sorts first) share one int64 sort key.
    k = deltas[:, :6].astype(np.int64) + 1
    order = np.lexsort([(k[:, 0] << 32) | k[:, 5], (k[:, 3] << 32) | k[:, 4], (k[:, 1] << 32) | k[:, 2],
                        (shard << 32) | buckets])
    sorted_keys = deltas[order, :6]
    new = np.ones(m, dtype=bool)
    if m > 1:
        new[1:] = (sorted_keys[1:] != sorted_keys[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    counts = np.add.reduceat(deltas[order, 6].astype(np.int64), starts) if m else np.zeros(0, np.int64)
    if counts.size and int(counts.max()) > MAX_AGGREGATED_COUNT:
        raise InvalidArgumentError("bad delta batch, refused whole: one entry's summed count exceeds 10**14")
    pick = order[starts]
    shard_bounds = np.searchsorted(shard[pick], np.arange(shards + 1), side="left").astype(np.int64)
    return EncodedBatch(buckets[pick], counts, lengths[pick], matrix[pick], shard_bounds)


def rows_from_matrix(lengths: np.ndarray, matrix: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """Rows (k, 7) int64 from fields laid out as a uint8 matrix (k, >= 5*width) plus their lengths.

    Raises:
        InvalidArgumentError: a field length that no entry has (the store holds foreign data).
    """
    k = len(lengths)
    out = np.full((k, DELTA_COLUMNS), -1, dtype=np.int64)
    if k == 0:
        return out
    tokens = lengths // width
    if ((lengths % width) != 0).any() or (tokens < 2).any() or (tokens > MAX_N + 1).any():
        raise InvalidArgumentError("the store holds a field that is not a valid entry")
    raw = matrix[:, :(MAX_N + 1) * width].reshape(k, MAX_N + 1, width).astype(np.int64)
    values = np.zeros((k, MAX_N + 1), dtype=np.int64)
    for byte in range(width):
        values |= raw[:, :, byte] << (8 * byte)
    n = tokens - 1
    out[:, 0] = n
    used = np.arange(MAX_N)[None, :] < n[:, None]
    out[:, 1:5] = np.where(used, values[:, :MAX_N], -1)
    out[:, 5] = values[np.arange(k), n]
    out[:, 6] = counts
    return out


def decode_fields(fields: Sequence[bytes], counts: Sequence[int], width: int) -> np.ndarray:
    """Rows (k, 7) int64 from a list of fields and their counts (see `rows_from_matrix`)."""
    size = (MAX_N + 1) * width
    lengths = np.fromiter(map(len, fields), dtype=np.int64, count=len(fields))
    if (lengths > size).any():
        raise InvalidArgumentError("the store holds a field that is not a valid entry")
    matrix = np.frombuffer(b"".join(f.ljust(size, b"\0") for f in fields), dtype=np.uint8).reshape(-1, size)
    return rows_from_matrix(lengths, matrix, np.asarray(counts, dtype=np.int64), width)


# --------------------------------------------------------------------------- interface


class CountsStore(abc.ABC):
    """Dynamic n-gram counts for many namespaces, each bound to one tokenizer.

    Every implementation is safe to share between threads. Use it as a context manager or
    call `close()`.
    """

    @abc.abstractmethod
    def create_namespace(self, namespace: str, fingerprint: bytes | str, vocab_size: int, *,
                         buckets: int | None = None, shards: int | None = None) -> NamespaceInfo:
        """Create a namespace bound to a tokenizer, or return it if it already exists with that tokenizer.

        Args:
            namespace: 1..64 characters of [A-Za-z0-9_.-].
            fingerprint: the tokenizer fingerprint, 32 bytes or 64 hex digits.
            vocab_size: tokens lie in [0, vocab_size).
            buckets: power of two; default ``config.default_buckets``. Ignored if it exists.
            shards: power of two; default 1 (standalone, embedded) or 64 (Cluster).

        Raises:
            TokenizerMismatchError: the namespace exists with another fingerprint or vocab size.
            InvalidArgumentError: a malformed argument.
            BackendUnavailableError: the store could not be reached (retriable).
        """

    @abc.abstractmethod
    def namespace_info(self, namespace: str) -> NamespaceInfo:
        """The namespace's record. Raises NamespaceNotFoundError."""

    @abc.abstractmethod
    def drop_namespace(self, namespace: str) -> bool:
        """Delete a namespace and all its counts; return whether it existed."""

    @abc.abstractmethod
    def apply(self, namespace: str, client_id: str, seq: int, deltas: np.ndarray, *,
              fingerprint: bytes | str | None = None) -> ApplyResult:
        """Add a batch of deltas, exactly once per (client_id, seq).

        Repeated keys in the batch are summed. The batch is validated whole before anything
        is written: a bad batch raises and changes nothing. Each unit of the batch (the whole
        batch on standalone Redis and embedded, the part in one shard on a Cluster) is
        applied atomically together with its dedup record, so retrying a batch after a lost
        reply, a timeout, a reconnect or a server restart never counts a unit twice.

        A sender MUST use a client_id of its own (e.g. a UUID per process), increasing seqs,
        and keep at most ``config.dedup_window`` batches unacknowledged.

        Args:
            namespace: an existing namespace.
            client_id: the sender, 1..128 characters of [A-Za-z0-9_.:@/-].
            seq: the batch number of this sender, in [0, 2**53).
            deltas: see `validate_deltas`.
            fingerprint: when given, must match the namespace's tokenizer.

        Raises:
            InvalidArgumentError: a bad batch (nothing applied).
            TokenizerMismatchError: ``fingerprint`` differs from the namespace's.
            NamespaceNotFoundError: no such namespace.
            BatchTooOldError: ``seq`` is older than the dedup window.
            BackendUnavailableError: retriable; retry the same (client_id, seq, deltas).
        """

    def apply_many(self, namespace: str, client_id: str, batches: Iterable[tuple[int, np.ndarray]], *,
                   fingerprint: bytes | str | None = None) -> list[ApplyResult]:
        """Apply several (seq, deltas) batches; backends may pipeline them. Same guarantees as `apply`."""
        return [self.apply(namespace, client_id, seq, deltas, fingerprint=fingerprint) for seq, deltas in batches]

    @abc.abstractmethod
    def lookup(self, namespace: str, ngram: Sequence[int]) -> dict[int, int]:
        """Followers of one n-gram (1..4 tokens) and their counts."""

    @abc.abstractmethod
    def version(self, namespace: str) -> int:
        """The current version: take it BEFORE `export` to mirror with `changes_since` afterwards."""

    @abc.abstractmethod
    def changes_since(self, namespace: str, version: int) -> ChangeSet:
        """Current counts of every bucket changed since ``version``, and the new version.

        Raises:
            ResyncRequiredError: ``version`` is older than the history kept (or from another
                incarnation of the namespace); start over from `version` + `export`.
        """

    @abc.abstractmethod
    def export(self, namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        """Every count, as int64 arrays (k, 7) of at most about ``chunk_rows`` rows.

        Each bucket is read atomically; the export is not one point-in-time snapshot, which
        is why a mirror takes `version` first and then catches up with `changes_since`.
        """

    def close(self) -> None:
        """Release connections (and, embedded, write a last snapshot)."""

    def __enter__(self) -> CountsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_counts_store(url_or_config: str | CountsStoreConfig | None = None, **options: Any) -> CountsStore:
    """Open the backend named by a URL (see the module docstring) or a `CountsStoreConfig`.

    Args:
        url_or_config: None/"" (embedded in memory), ``embedded://PATH``, ``redis://...``,
            ``rediss://...``, ``redis+cluster://h:p[,h:p]``, or a config.
        **options: `CountsStoreConfig` fields, overriding the URL's query options.

    Raises:
        InvalidArgumentError: a malformed URL or option.
        BackendUnavailableError: Redis could not be reached.
    """
    if isinstance(url_or_config, CountsStoreConfig):
        config = dataclasses.replace(url_or_config, **options) if options else url_or_config
    else:
        config = CountsStoreConfig.from_url(url_or_config, **options)
    url = config.url or ""
    if url == "" or url.lower().startswith("embedded://"):
        from ngramcache.cache_service.embedded_store import EmbeddedCountsStore

        return EmbeddedCountsStore(config)
    from ngramcache.cache_service.redis_store import RedisCountsStore

    return RedisCountsStore(config)

