"""The Redis key schema of the counts store: every key name is built here and nowhere else.

``P`` is ``config.prefix`` (default ``ngc``), ``NS`` the namespace, ``I`` its instance id
(random, new each time the namespace is created), ``S`` its shard count.

Coordinator keys, hash tag ``{NS}`` (one slot per namespace)::

    P:{NS}:meta     HASH    fingerprint, vocab_size, buckets, shards, instance, schema,
                            history_partitions (absent: 1)
    P:{NS}:clock    HASH    instance, cur (newest version), t (ms the current epoch opened), floor
    P:{NS}:lease    STRING  "<holder>|<token>" with the lease's expiry (PX): who may rebuild
    P:{NS}:fence    STRING  the last fencing token handed out (INCR)
    P:{NS}:gen      HASH    generation, location, token, kind: the newest committed generation
    P:{NS}:epochs   LIST    epoch numbers, newest first, trimmed to history_epochs + 1;
                            the last one is the floor: the oldest version changes_since serves

The fleet history (`redis_history`) in H partitions (``history_partitions`` in meta: 1 on
standalone Redis, `history.CLUSTER_HISTORY_PARTITIONS` on a Cluster, 1 for a namespace created
before partitions). Partition 0 is in the coordinator slot, under the names the unpartitioned
history always had (so a replica from before partitions reads and writes partition 0);
partition p >= 1 under hash tag ``{NS/I/h.p.k}``, k the smallest integer that puts the tag in
one of the H equal slices of slots ([round(i*16384/H), round((i+1)*16384/H))) that no lower
partition holds: the H partitions take the H slices once, so they spread over the masters of a
Cluster (which owns slots in contiguous, equal ranges, as ``redis-cli --cluster create`` makes). Each partition
holds the records `history.partition_of` gives it::

    P:{T}:hist      STREAM  one entry per record: c (client id), s (seq, decimal int64),
                            g (group), o (offset, decimal), t (tokens, raw '<i4' bytes)
    P:{T}:hstat     HASH    tokens (kept), first (id of the oldest kept entry, '' if none),
                            trimmed (id of the newest entry trimmed, absent if none);
                            partition p >= 1: instance (its scripts' instance check, as
                            meta's is partition 0's)
    P:{T}:hseq      HASH    client id -> highest batch_seq stored here (the exactly-once rule)
    P:{T}:hseen     ZSET    client id, score ms of its last append here (silent senders expire)
    P:{T}:hdup      ZSET    near-duplicate digests (16 bytes), score ms stored

where T is ``NS`` for partition 0 and ``NS/I/h.p.k`` for partition p.

Shard keys, hash tag ``{NS/I/s.k}`` for shard s (k is the smallest integer that puts the tag
in slot range [s*16384/S, (s+1)*16384/S), so shards spread evenly over the masters of a
Cluster that owns contiguous, equal slot ranges, as ``redis-cli --cluster create`` makes)::

    P:{T}:s         HASH    instance, e (epoch the open change piece started), f (trim floor)
    P:{T}:c         LIST    the open change piece: one portable roaring bitmap per applied
                            unit, of the local ids (bucket // S) of the buckets it changed
    P:{T}:h         HASH    closed pieces: "<start>:<end>" -> b"L" + the unit bitmaps, each
                            prefixed by its '<I4' length, or b"R" + their union (one
                            portable roaring bitmap) once a reader sealed it
    P:{T}:i         ZSET    index of h: member "<start>:<end>", score end (for trimming/reads)
    P:{T}:d:<cid>   ZSET    dedup record of client <cid> in this shard: the seqs applied,
                            trimmed to the dedup window, expiring after dedup_ttl
    P:{T}:<b>       HASH    bucket b (global id, decimal): field = n-gram tokens then the
                            follower, token_width little-endian bytes each; value = count

Any tag T a write acknowledged by replicas used (`redis_connection`: the coordinator's, a shard's,
a history partition's) also holds::

    P:{T}:ack       STRING  a counter INCR'd right before WAIT, so WAIT covers every earlier
                            write of that master (value meaningless; dropped with the shard)

Fields are laid out as described in `layout`. A bucket holds ~64 entries when ``buckets`` is sized as entries / 64, which keeps it in
Redis's listpack encoding (hash-max-listpack-entries 128): about 16 bytes an entry for
3-byte tokens. Every key one apply unit touches (s, c, d:<cid>, its buckets) shares the
shard's tag, hence its slot: a unit is one EVALSHA, atomic even on a Cluster. Because the
instance id is in every shard tag, a namespace dropped and recreated never reads the
leftovers of its previous incarnation.
"""

from __future__ import annotations

import functools
from typing import Final

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ngramcache.client.kernel.errors import InvalidArgumentError

from .namespace import validate_namespace

SCHEMA_VERSION: Final = 1
"""Version of this key schema, stored in every namespace record; a store refuses other versions."""


def lease_keys(prefix: str, namespace: str) -> tuple[str, str, str]:
    """(lease, fence, committed generation) keys of a namespace's rebuilds, in its coordinator slot.

    Not part of one incarnation: they outlive a drop, so generation numbers keep growing.
    """
    return (f"{prefix}:{{{namespace}}}:lease", f"{prefix}:{{{namespace}}}:fence", f"{prefix}:{{{namespace}}}:gen")


def meta_key(prefix: str, namespace: str) -> str:
    """The namespace record (HASH)."""
    return f"{prefix}:{{{namespace}}}:meta"


def meta_match(prefix: str) -> str:
    """SCAN pattern of every namespace record (may match other keys: check with `namespace_of_meta_key`)."""
    return f"{prefix}:{{*}}:meta"


def namespace_of_meta_key(prefix: str, key: bytes | str) -> str | None:
    """The namespace whose record `meta_key` names ``key``, or None for any other key."""
    if isinstance(key, bytes):
        key = key.decode(errors="replace")
    head, tail = f"{prefix}:{{", "}:meta"
    if not (key.startswith(head) and key.endswith(tail)):
        return None
    try:
        return validate_namespace(key[len(head):-len(tail)])
    except InvalidArgumentError:
        return None


def history_keys(prefix: str, namespace: str) -> tuple[str, str, str, str, str]:
    """(stream, stat, seq, seen, dup) keys of a namespace's fleet history partition 0, in its coordinator slot.

    Not per incarnation: `drop_namespace` deletes them with the record, and every script checks
    the record's instance, so a recreated namespace starts with an empty history.
    """
    base = f"{prefix}:{{{namespace}}}:"
    return (base + "hist", base + "hstat", base + "hseq", base + "hseen", base + "hdup")


def _slice_of(slot: int, parts: int) -> int:
    """The i with slot in [round(i*16384/parts), round((i+1)*16384/parts)) (redis-cli --cluster create rounds so)."""
    return -(-(2 * slot + 1) * parts // (2 * REDIS_CLUSTER_HASH_SLOTS)) - 1


@functools.lru_cache(maxsize=256)
def history_partition_tags(namespace: str, instance: str, partitions: int) -> tuple[str, ...]:
    """The hash tag of each history partition: ``NS`` for partition 0 (the coordinator slot, where the history of a
    namespace with one partition always was); partitions 1.. each take one of the other equal slices of slots, so the
    P partitions cover the P slices once and spread over a Cluster's masters as evenly as its slots are."""
    taken = _slice_of(key_slot(namespace.encode()), partitions)
    tags = [namespace]
    free = [s for s in range(partitions) if s != taken]
    for p, piece in enumerate(free, start=1):
        k = 0
        while True:
            tag = f"{namespace}/{instance}/h.{p}.{k}"
            if _slice_of(key_slot(tag.encode()), partitions) == piece:
                break
            k += 1
        tags.append(tag)
    return tuple(tags)


class HistoryKeys:
    """Key names of one partition of a namespace's fleet history; ``guard`` holds the instance its scripts check."""

    __slots__ = ("dup", "guard", "seen", "seq", "stat", "stream")

    def __init__(self, prefix: str, tag: str, partition: int) -> None:
        base = f"{prefix}:{{{tag}}}:"
        self.stream, self.stat, self.seq, self.seen, self.dup = (
            base + "hist", base + "hstat", base + "hseq", base + "hseen", base + "hdup")
        self.guard = base + "meta" if partition == 0 else self.stat

    def all(self) -> tuple[str, str, str, str, str]:
        return (self.stream, self.stat, self.seq, self.seen, self.dup)


def history_partition_keys(prefix: str, namespace: str, instance: str, partitions: int) -> list[HistoryKeys]:
    """The key names of every partition of a namespace's fleet history, by partition."""
    return [HistoryKeys(prefix, tag, p) for p, tag in enumerate(history_partition_tags(namespace, instance, partitions))]


def clock_key(prefix: str, namespace: str) -> str:
    """The namespace's clock (HASH): the state of its `EpochClock`."""
    return f"{prefix}:{{{namespace}}}:clock"


def epochs_key(prefix: str, namespace: str) -> str:
    """The epochs kept (LIST, newest first)."""
    return f"{prefix}:{{{namespace}}}:epochs"


@functools.lru_cache(maxsize=256)
def shard_tags(namespace: str, instance: str, shards: int) -> tuple[str, ...]:
    """The hash tag of each shard, chosen so shard s lands in the s-th equal slice of slots."""
    tags = []
    for s in range(shards):
        lo = s * REDIS_CLUSTER_HASH_SLOTS // shards
        hi = (s + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        k = 0
        while True:
            tag = f"{namespace}/{instance}/{s}.{k}"
            if lo <= key_slot(tag.encode()) < hi:
                break
            k += 1
        tags.append(tag)
    return tuple(tags)


class ShardKeys:
    """Key names of one shard of one namespace incarnation."""

    __slots__ = ("base", "changes", "history", "index", "state")

    def __init__(self, prefix: str, tag: str) -> None:
        self.base = f"{prefix}:{{{tag}}}:"
        self.state = self.base + "s"
        self.changes = self.base + "c"
        self.history = self.base + "h"
        self.index = self.base + "i"

    def dedup(self, client_id: str) -> str:
        """The dedup record (ZSET) of one client in this shard."""
        return f"{self.base}d:{client_id}"

    def bucket(self, bucket: int) -> str:
        """The HASH of a bucket (global id) of this shard."""
        return f"{self.base}{bucket}"


def shard_keys(prefix: str, namespace: str, instance: str, shards: int) -> list[ShardKeys]:
    """The key names of every shard of one namespace incarnation, by shard index."""
    return [ShardKeys(prefix, tag) for tag in shard_tags(namespace, instance, shards)]


def instance_match(prefix: str, namespace: str, instance: str | None = None) -> str:
    """SCAN pattern of every shard key of a namespace (one incarnation, or all of them)."""
    return f"{prefix}:{{{namespace}/{instance}/*" if instance else f"{prefix}:{{{namespace}/*"


def bucket_match(prefix: str, namespace: str, instance: str) -> str:
    """SCAN pattern of the bucket keys of one namespace incarnation."""
    return f"{prefix}:{{{namespace}/{instance}/*}}:[0-9]*"


def bucket_of_key(key: bytes | str) -> int:
    """The global bucket id at the end of a bucket key."""
    if isinstance(key, bytes):
        key = key.decode()
    return int(key.rsplit(":", 1)[1])
