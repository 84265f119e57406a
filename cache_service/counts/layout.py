"""The bucket layout both backends store: bucket hash, field codec, and batches encoded by (shard, bucket).

* A namespace has ``buckets`` (a power of two) buckets. The bucket of an n-gram is
  ``mmh3.hash(ngram_bytes, HASH_SEED, signed=False) & (buckets - 1)``, so all followers of
  an n-gram share a bucket and `lookup` reads one bucket.
* A namespace has ``shards`` shards; bucket ``b`` belongs to shard ``b % shards`` and has
  local id ``b // shards`` inside it. A shard is the unit of atomicity of `apply_group`.
* An entry's field is its n-gram tokens followed by its follower, each token written as
  ``token_width`` little-endian bytes (``token_width`` is the fewest bytes that hold
  ``vocab_size - 1``). So ``n = len(field) // token_width - 1`` and the n-gram bytes are
  the field's prefix; a field holds at most ``FIELD_TOKENS`` tokens.

The Redis key names are in `schema`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import mmh3
import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.rows import (
    COUNT,
    FOLLOWER,
    KEY_WIDTH,
    NGRAM_MAX,
    TOKENS,
    N,
    empty_counts,
)

from .namespace import NamespaceRecord

__all__ = [
    "FIELD_TOKENS",
    "HASH_SEED",
    "MAX_AGGREGATED_COUNT",
    "EncodedBatch",
    "EncodedGroup",
    "decode_fields",
    "encode_batch",
    "encode_group",
    "fields_and_buckets",
    "murmur3_32",
    "ngram_bucket",
    "ngram_key",
    "rows_from_matrix",
]

HASH_SEED: Final = 0
"""Seed of the mmh3 (MurmurHash3 x86_32) bucket hash. Changing it changes the layout."""

MAX_AGGREGATED_COUNT: Final = 10**14
"""Largest summed increment for one entry in one batch (Redis Lua prints numbers exactly up to 1e14)."""

FIELD_TOKENS: Final = NGRAM_MAX + 1
"""Most tokens in a field: the longest n-gram plus its follower."""


def _token_bytes(values: np.ndarray, width: int) -> np.ndarray:
    """uint8 (k, c*width): each int of ``values`` (k, c) as ``width`` little-endian bytes."""
    k, c = values.shape
    le = np.ascontiguousarray(values, dtype="<u4").view(np.uint8).reshape(k, c, 4)
    return np.ascontiguousarray(le[:, :, :width]).reshape(k, c * width)


_U32 = np.uint32


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    rotated: np.ndarray = (x << _U32(r)) | (x >> _U32(32 - r))
    return rotated


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


def ngram_bucket(ngram: Sequence[int], info: NamespaceRecord) -> int:
    """The bucket of one n-gram (validated against the namespace's vocabulary)."""
    tokens = [int(t) for t in ngram]
    if not 1 <= len(tokens) <= NGRAM_MAX:
        raise InvalidArgumentError(f"an n-gram has 1..{NGRAM_MAX} tokens, got {len(tokens)}")
    if any(not 0 <= t < info.vocab_size for t in tokens):
        raise InvalidArgumentError(f"n-gram token outside [0, {info.vocab_size})")
    key = _token_bytes(np.array([tokens], dtype=np.int64), info.token_width).tobytes()
    bucket: int = mmh3.hash(key, HASH_SEED, signed=False) & (info.buckets - 1)
    return bucket


def ngram_key(ngram: Sequence[int], info: NamespaceRecord) -> bytes:
    """The field prefix of an n-gram: its tokens, ``token_width`` bytes each (not validated)."""
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
    field_matrix: np.ndarray  # uint8 (k, FIELD_TOKENS*width), field i = field_matrix[i, :lengths[i]]
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
        fields: list[bytes] = out.tolist()
        return fields


def fields_and_buckets(rows: np.ndarray, info: NamespaceRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Field matrix, field lengths and bucket of each validated row (n, t0..t3, follower, ...), in row order.

    Returns:
        (matrix uint8 (m, FIELD_TOKENS*width), lengths int64 (m,), buckets int64 (m,)); row
        i's field is ``matrix[i, :lengths[i]]``.
    """
    m = rows.shape[0]
    w = info.token_width
    n = rows[:, N].astype(np.int64)
    seq = np.zeros((m, FIELD_TOKENS), dtype=np.int64)
    seq[:, :NGRAM_MAX] = np.maximum(rows[:, TOKENS], 0)
    seq[np.arange(m), n] = rows[:, FOLLOWER]
    matrix = _token_bytes(seq, w)
    buckets = np.zeros(m, dtype=np.int64)
    mask = info.buckets - 1
    for size in range(1, NGRAM_MAX + 1):
        idx = np.flatnonzero(n == size)
        if idx.size == 0:
            continue
        buckets[idx] = murmur3_32(matrix[idx, :size * w], HASH_SEED).astype(np.int64) & mask
    return matrix, (n + 1) * w, buckets


def _sort_rows(deltas: np.ndarray, info: NamespaceRecord,
               item: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fields of validated rows and their order by (shard, bucket, key[, item]).

    Returns:
        (order, new: bool per sorted row, True where its key differs from the previous
        one's, field matrix, lengths, buckets, shard of each row), the last four in row order.
    """
    m = deltas.shape[0]
    matrix, lengths, buckets = fields_and_buckets(deltas, info)
    shard = buckets % info.shards
    # Sort by (shard, bucket, t0, t1, t2, t3, n, follower[, item]): repeats become adjacent, units
    # contiguous. Pairs of int32 columns (+1 so -1 sorts first) share one int64 sort key.
    k = deltas[:, :KEY_WIDTH].astype(np.int64) + 1
    t0, t1, t2, t3 = (k[:, c] for c in range(TOKENS.start, TOKENS.stop))
    keys = [(k[:, N] << 32) | k[:, FOLLOWER], (t2 << 32) | t3, (t0 << 32) | t1, (shard << 32) | buckets]
    order = np.lexsort(keys if item is None else [item, *keys])
    sorted_keys = deltas[order, :KEY_WIDTH]
    new = np.ones(m, dtype=bool)
    if m > 1:
        new[1:] = (sorted_keys[1:] != sorted_keys[:-1]).any(axis=1)
    return order, new, matrix, lengths, buckets, shard


def _summed(deltas: np.ndarray, info: NamespaceRecord, order: np.ndarray, new: np.ndarray, matrix: np.ndarray,
            lengths: np.ndarray, buckets: np.ndarray, shard: np.ndarray) -> EncodedBatch:
    """The entries of sorted rows with their repeats summed (see `_sort_rows`)."""
    m = deltas.shape[0]
    starts = np.flatnonzero(new)
    counts = np.add.reduceat(deltas[order, COUNT].astype(np.int64), starts) if m else np.zeros(0, np.int64)
    if counts.size and int(counts.max()) > MAX_AGGREGATED_COUNT:
        raise InvalidArgumentError("bad delta batch, refused whole: one entry's summed count exceeds 10**14")
    pick = order[starts]
    shard_bounds = np.searchsorted(shard[pick], np.arange(info.shards + 1), side="left").astype(np.int64)
    return EncodedBatch(buckets[pick], counts, lengths[pick], matrix[pick], shard_bounds)


def encode_batch(deltas: np.ndarray, info: NamespaceRecord) -> EncodedBatch:
    """Sum repeated keys of a validated batch and lay it out by (shard, bucket, field).

    Raises:
        InvalidArgumentError: when one entry's summed increment exceeds MAX_AGGREGATED_COUNT.
    """
    order, new, matrix, lengths, buckets, shard = _sort_rows(deltas, info, None)
    return _summed(deltas, info, order, new, matrix, lengths, buckets, shard)


@dataclasses.dataclass(frozen=True)
class EncodedGroup:
    """Several validated batches (items) summed together: what one aggregated unit per shard writes.

    ``batch`` holds every item's entries summed across the items (an n-gram pushed by ten
    clients is one entry); ``item_entries[i]`` is the number of distinct entries of item i
    alone, and ``item_shards[i, s]`` says whether item i has an entry in shard s (the units
    it touches).
    """

    batch: EncodedBatch
    item_entries: np.ndarray  # int64 (k,)
    item_shards: np.ndarray  # bool (k, shards)


def encode_group(batches: Sequence[np.ndarray], info: NamespaceRecord) -> EncodedGroup:
    """Sum repeated keys within and across validated batches and lay them out by (shard, bucket, field).

    Raises:
        InvalidArgumentError: when one entry's increment summed over every batch exceeds
            MAX_AGGREGATED_COUNT (the caller splits the group; for one batch it is a bad batch).
    """
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    deltas = np.concatenate(batches) if len(batches) > 1 else batches[0]
    item = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    order, new, matrix, lengths, buckets, shard = _sort_rows(deltas, info, item)
    encoded = _summed(deltas, info, order, new, matrix, lengths, buckets, shard)
    # A (key, item) pair starts where the key or the item changes (the item is the last sort key).
    sorted_item = item[order]
    pair = new.copy()
    if len(pair) > 1:
        pair[1:] |= sorted_item[1:] != sorted_item[:-1]
    owners = sorted_item[pair]
    item_entries = np.bincount(owners, minlength=len(batches)).astype(np.int64)
    item_shards = np.zeros((len(batches), info.shards), dtype=bool)
    item_shards[owners, shard[order][pair]] = True
    return EncodedGroup(encoded, item_entries, item_shards)


def rows_from_matrix(lengths: np.ndarray, matrix: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """Count rows (k, ROW_WIDTH) int64 from fields laid out as a uint8 matrix (k, >= FIELD_TOKENS*width) plus their lengths.

    Raises:
        InvalidArgumentError: a field length that no entry has (the store holds foreign data).
    """
    k = len(lengths)
    out: np.ndarray = empty_counts(k)
    if k == 0:
        return out
    tokens = lengths // width
    if ((lengths % width) != 0).any() or (tokens < 2).any() or (tokens > FIELD_TOKENS).any():
        raise InvalidArgumentError("the store holds a field that is not a valid entry")
    raw = matrix[:, :FIELD_TOKENS * width].reshape(k, FIELD_TOKENS, width).astype(np.int64)
    values = np.zeros((k, FIELD_TOKENS), dtype=np.int64)
    for byte in range(width):
        values |= raw[:, :, byte] << (8 * byte)
    n = tokens - 1
    out[:, N] = n
    used = np.arange(NGRAM_MAX)[None, :] < n[:, None]
    out[:, TOKENS] = np.where(used, values[:, :NGRAM_MAX], -1)
    out[:, FOLLOWER] = values[np.arange(k), n]
    out[:, COUNT] = counts
    return out


def decode_fields(fields: Sequence[bytes], counts: Sequence[int], width: int) -> np.ndarray:
    """Count rows (k, ROW_WIDTH) int64 from a list of fields and their counts (see `rows_from_matrix`)."""
    size = FIELD_TOKENS * width
    lengths = np.fromiter(map(len, fields), dtype=np.int64, count=len(fields))
    if (lengths > size).any():
        raise InvalidArgumentError("the store holds a field that is not a valid entry")
    matrix = np.frombuffer(b"".join(f.ljust(size, b"\0") for f in fields), dtype=np.uint8).reshape(-1, size)
    return rows_from_matrix(lengths, matrix, np.asarray(counts, dtype=np.int64), width)
