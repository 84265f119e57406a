"""The Redis backend's writes: a unit (`values.Unit`) as one APPLY call on its shard, and the script's reply as the unit's answer.

A unit is the entries of one shard of one or several batches summed, and is applied by one
APPLY script together with every dedup record it carries (see `redis_scripts`). A reply lost
to a timeout, a dropped connection or a server restart (with ``appendonly yes``, which logs a
script's effects as one MULTI/EXEC) is therefore retried safely: the unit is either recorded
whole or not at all. What to redo after a unit that wrote nothing is `CountsStore`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyroaring

from ngramcache.client.kernel.errors import NgramCacheError

from .config import CountsStoreConfig
from .dedup import batch_too_old
from .layout import EncodedBatch
from .namespace import StaleNamespace
from .redis_handles import Handle
from .redis_scripts import APPLY, Call
from .values import Seen, Unit, UnitAnswer

__all__ = ["apply_call", "unit_answer"]


def apply_call(handle: Handle, unit: Unit, config: CountsStoreConfig) -> Call:
    """The APPLY call of a unit: shard ``unit.shard``'s entries of ``unit.batch``, which hold the sum of ``unit.pairs``."""
    assert unit.shard is not None, "a Redis unit is one shard's"
    shard, enc = unit.shard, unit.batch
    sk = handle.shards[shard]
    unit_buckets, args = _unit_args(enc, int(enc.shard_bounds[shard]), int(enc.shard_bounds[shard + 1]), handle.info.shards)
    clients: dict[str, int] = {}
    pairs: list[int] = []
    for client_id, seq in unit.pairs:
        pairs += [clients.setdefault(client_id, len(clients) + 1), seq]
    base = sk.base
    keys = [sk.state, sk.changes, *(sk.dedup(c) for c in clients), *(base + str(b) for b in unit_buckets)]
    return (APPLY, keys, [handle.info.instance, config.dedup_window, config.dedup_ttl_ms, *args, len(clients), *pairs])


def unit_answer(reply: Any, unit: Unit, dedup_window: int) -> UnitAnswer:
    """The answer of a unit from its APPLY reply: ``{1}`` written; else per pair 1 new, 0 applied before, or too old.

    Raises:
        StaleNamespace: the script found another instance of the namespace (``{-1}``).
    """
    code = int(reply[0])
    if code == 1:
        return None
    if code == -1:
        raise StaleNamespace
    answer: list[Seen | NgramCacheError] = []
    for j, (_, seq) in enumerate(unit.pairs):
        status = int(reply[1 + 2 * j])
        if status == 1:
            answer.append(Seen.NEW)
        elif status == 0:
            answer.append(Seen.APPLIED)
        else:
            answer.append(batch_too_old(seq, int(float(reply[2 + 2 * j])), dedup_window))
    return answer


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

