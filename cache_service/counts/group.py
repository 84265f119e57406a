"""A group of batches before it is written (`CountsStore.apply_group`): each item checked against the namespace, the rest queued as units, wave after wave."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError
from ngramcache.client.kernel.rows import COUNT, validate_deltas

from .layout import MAX_AGGREGATED_COUNT, EncodedBatch, encode_group
from .namespace import NamespaceRecord, check_tokenizer
from .values import ApplyResult, GroupItem, ItemOutcome

__all__ = ["GroupPlan", "plan_group"]


@dataclasses.dataclass
class GroupPlan:
    """What `plan_group` made of a group: the outcomes known before any write, and the units to write.

    Attributes:
        done: item -> its outcome, for the items refused (their error) or empty (nothing to write).
        tally: item -> [units it touches, applied, duplicates, entries], for the items to write.
        queues: unit key (a shard, or None when a unit is the whole namespace) -> the units to
            write there, in order: (the items summed in it, their entries summed and encoded).
    """

    done: dict[int, ItemOutcome]
    tally: dict[int, list[int]]
    queues: dict[int | None, collections.deque[tuple[tuple[int, ...], EncodedBatch]]]


def plan_group(info: NamespaceRecord, items: dict[int, GroupItem], max_rows: int, unit_per_shard: bool) -> GroupPlan:
    """Check every item (client_id and seq already valid) against the namespace and queue the others as units.

    An item with another tokenizer or a bad row gets its error, an empty one its empty result (its
    seq not consumed). The others go in waves: a pair repeated in the group goes in a later wave
    than its previous copy, as if sent after it; a wave's counts sum to at most
    MAX_AGGREGATED_COUNT, so no entry of a unit overflows what it adds exactly (an item over it
    alone is a wave of its own, which `encode_group` refuses). Each wave is summed once and
    queued as one unit per shard it touches (``unit_per_shard``), or one unit.
    """
    done: dict[int, ItemOutcome] = {}
    rounds: list[list[int]] = []  # round r: the (r+1)-th copy of each pair
    copies: collections.Counter[tuple[str, int]] = collections.Counter()
    for i, item in items.items():
        try:
            check_tokenizer(info, item.fingerprint)
            validate_deltas(item.deltas, info.vocab_size, max_rows)
        except NgramCacheError as exc:
            done[i] = exc
            continue
        if len(item.deltas) == 0:
            done[i] = ApplyResult(0, 0, 0, 0)
            continue
        copy = copies[item.client_id, item.seq]
        copies[item.client_id, item.seq] += 1
        if copy == len(rounds):
            rounds.append([])
        rounds[copy].append(i)
    waves: list[list[int]] = []
    for one_round in rounds:
        waves.append([])
        total = 0
        for i in one_round:
            weight = int(items[i].deltas[:, COUNT].sum(dtype=np.int64))
            if waves[-1] and total + weight > MAX_AGGREGATED_COUNT:
                waves.append([])
                total = 0
            waves[-1].append(i)
            total += weight
    plan = GroupPlan(done, {}, {})
    for wave in waves:
        try:
            group = encode_group([items[i].deltas for i in wave], info)
        except InvalidArgumentError as exc:  # an item whose own sum overflows (the waves bound the rest)
            done.update(dict.fromkeys(wave, exc))
            continue
        shards = group.item_shards
        for j, i in enumerate(wave):
            plan.tally[i] = [int(shards[j].sum()) if unit_per_shard else 1, 0, 0, int(group.item_entries[j])]
        if not unit_per_shard:
            plan.queues.setdefault(None, collections.deque()).append((tuple(wave), group.batch))
            continue
        for s in np.flatnonzero(shards.any(axis=0)).tolist():
            alive = tuple(wave[j] for j in np.flatnonzero(shards[:, s]).tolist())
            plan.queues.setdefault(s, collections.deque()).append((alive, group.batch))  # shard s: their entries alone
    return plan
