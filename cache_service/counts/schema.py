"""The Redis key schema of the counts store: every key name is built here and nowhere else.

``P`` is ``config.prefix`` (default ``ngc``), ``NS`` the namespace, ``I`` its instance id
(random, new each time the namespace is created), ``S`` its shard count.

Coordinator keys, hash tag ``{NS}`` (one slot per namespace)::

    P:{NS}:meta     HASH    fingerprint, vocab_size, buckets, shards, instance, schema
    P:{NS}:clock    HASH    instance, cur (newest version), t (ms the current epoch opened), floor
    P:{NS}:lease    STRING  "<holder>|<token>" with the lease's expiry (PX): who may rebuild
    P:{NS}:fence    STRING  the last fencing token handed out (INCR)
    P:{NS}:gen      HASH    generation, location, token, kind: the newest committed generation
    P:{NS}:epochs   LIST    epoch numbers, newest first, trimmed to history_epochs + 1;
                            the last one is the floor: the oldest version changes_since serves

The fleet history (`redis_history`), in the same slot: one stream per namespace, so a
Cluster spreads namespaces, not one namespace's records::

    P:{NS}:hist     STREAM  one entry per record: c (client id), s (seq, decimal int64),
                            g (group), o (offset, decimal), t (tokens, raw '<i4' bytes)
    P:{NS}:hstat    HASH    tokens (kept), first (id of the oldest kept entry, '' if none),
                            trimmed (id of the newest entry trimmed, absent if none)
    P:{NS}:hseq     HASH    client id -> highest batch_seq stored (the exactly-once rule)
    P:{NS}:hseen    ZSET    client id, score ms of its last append (silent senders expire)
    P:{NS}:hdup     ZSET    near-duplicate digests (16 bytes), score ms stored

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

from ngramcache.client.errors import InvalidArgumentError

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
    """(stream, stat, seq, seen, dup) keys of a namespace's fleet history, in its coordinator slot.

    Not per incarnation: `drop_namespace` deletes them with the record, and every script checks
    the record's instance, so a recreated namespace starts with an empty history.
    """
    base = f"{prefix}:{{{namespace}}}:"
    return (base + "hist", base + "hstat", base + "hseq", base + "hseen", base + "hdup")


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
