"""What the counts store's calls take and answer: a sender's batch identity (client id, seq), group items, apply results, change sets; and the units a backend writes."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import TYPE_CHECKING, Final, TypeAlias

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError

if TYPE_CHECKING:
    from .layout import EncodedBatch

__all__ = [
    "MAX_SEQ",
    "ApplyResult",
    "ChangeSet",
    "GroupItem",
    "ItemOutcome",
    "Seen",
    "Unit",
    "UnitAnswer",
    "validate_client_id",
    "validate_seq",
]

MAX_SEQ: Final = 2**53 - 1
"""Largest seq: seqs travel through Lua numbers (doubles)."""

_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What `CountsStore.apply_group` did with one batch.

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


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise comparison of the arrays
class GroupItem:
    """One batch of a group given to `CountsStore.apply_group`: a sender's batch and its identity.

    Attributes:
        client_id: the sender, 1..128 characters of [A-Za-z0-9_.:@/-].
        seq: the batch number of this sender, in [0, 2**53).
        deltas: int32 delta rows, see `ngramcache.client.kernel.rows.validate_deltas`.
        fingerprint: when not None, must match the namespace's tokenizer.
    """

    client_id: str
    seq: int
    deltas: np.ndarray
    fingerprint: bytes | str | None = None


ItemOutcome: TypeAlias = ApplyResult | NgramCacheError
"""What `CountsStore.apply_group` did with one item: its result, or the error that refused it."""


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """What a backend writes atomically (`CountsStore._write_units`): checked batches summed, with their dedup records.

    Attributes:
        shard: the shard whose entries of ``batch`` it holds (None: all of them; the embedded store
            writes a namespace under one lock).
        batch: the batches' entries summed (`layout.encode_group`).
        pairs: the (client_id, seq) of every batch summed in it, each checked against its client's
            dedup record and recorded with the writes.
    """

    shard: int | None
    batch: EncodedBatch
    pairs: list[tuple[str, int]]


class Seen(enum.Enum):
    """What a unit that wrote nothing found for one of its pairs (another pair was applied before or too old)."""

    NEW = "new"  # not applied before: it goes again, in a unit without the others
    APPLIED = "applied"  # applied before: a duplicate here


UnitAnswer: TypeAlias = "list[Seen | NgramCacheError] | None"
"""A backend's answer for one `Unit`: None when it was written with every dedup record; else, per pair,
`Seen` or the BatchTooOldError that refused it, and nothing of the unit was written."""


@dataclasses.dataclass(frozen=True)
class ChangeSet:
    """The answer of `CountsStore.changes_since`.

    Attributes:
        version: pass it to the next `changes_since` call.
        rows: int64 count rows (k, ROW_WIDTH) (see client.rows): the current absolute
            counts of every entry in the changed buckets (unused token slots -1). Counts
            never decrease, so setting each entry of a mirror to its row's count (an
            upsert, not an addition) brings the mirror up to date.
        buckets: uint32 array of the changed bucket ids, sorted.
    """

    version: int
    rows: np.ndarray
    buckets: np.ndarray


# --------------------------------------------------------------------------- argument checks


def validate_client_id(client_id: str) -> str:
    """Return ``client_id`` if it is 1..128 characters of [A-Za-z0-9_.:@/-], else raise InvalidArgumentError."""
    if not isinstance(client_id, str) or not _CLIENT_ID_RE.fullmatch(client_id):
        raise InvalidArgumentError(f"client_id must be 1..128 characters of [A-Za-z0-9_.:@/-], got {client_id!r}")
    return client_id


def validate_seq(seq: int) -> int:
    """Return ``seq`` as an int if it is an integer in [0, MAX_SEQ], else raise InvalidArgumentError."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= int(seq) <= MAX_SEQ:
        raise InvalidArgumentError(f"seq must be an integer in [0, 2**53), got {seq!r}")
    return int(seq)

