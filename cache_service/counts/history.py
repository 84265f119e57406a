"""The fleet history's values and rules: records, budgets, pages, their checks, cursors and the near-duplicate rule every backend shares."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Collection, Sequence
from typing import Final

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.history_buffer import validate_group

from .values import validate_client_id, validate_seq

__all__ = [
    "BYTES_PER_TOKEN",
    "CLUSTER_HISTORY_PARTITIONS",
    "DUPLICATE_WINDOW_MS",
    "MAX_BATCH_RECORDS",
    "MAX_HISTORY_PARTITIONS",
    "MAX_OFFSET",
    "MAX_READ_LIMIT",
    "MAX_RECORD_TOKENS",
    "Cursor",
    "HistoryAppend",
    "HistoryBatch",
    "HistoryBudget",
    "HistoryPage",
    "HistoryRecord",
    "duplicate_key",
    "format_composite_cursor",
    "format_cursor",
    "is_prompt",
    "parse_cursor",
    "partition_of",
    "partitions_of_groups",
    "validate_batch_seq",
    "validate_limit",
    "validate_partitions",
    "validate_records",
]

MAX_RECORD_TOKENS: Final = 4096
"""Most tokens one record holds (a sender splits longer runs)."""

MAX_BATCH_RECORDS: Final = 256
"""Most records one `append_history` call takes."""

MAX_OFFSET: Final = 2**40
"""Offsets lie in [0, MAX_OFFSET)."""

MAX_READ_LIMIT: Final = 65536
"""Most records one `read_history` call answers."""

BYTES_PER_TOKEN: Final = 4
"""What a stored token counts against the byte budget (int32)."""

DUPLICATE_WINDOW_MS: Final = 10_000
"""A prompt record (`is_prompt`) equal to one stored this recently (same group, same tokens) is not stored again."""

MAX_HISTORY_PARTITIONS: Final = 64
"""Most partitions of one namespace's history (a composite cursor holds a position for each)."""

CLUSTER_HISTORY_PARTITIONS: Final = 12
"""Partitions of a new namespace's history on a Redis Cluster: 12 spread evenly over 1, 2, 3, 4, 6 or 12
masters (each partition is one slot in the p-th twelfth of the slots), and keep a cursor near 200 bytes."""

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_CURSOR_RE = re.compile(r"^([A-Za-z0-9]{1,64})\.([0-9]{1,20}(?:-[0-9]{1,20})?)$")
_POSITION = r"(?:[0-9]{1,20}-[0-9]{1,20})?"
_COMPOSITE_RE = re.compile(rf"^([A-Za-z0-9]{{1,64}})\.({_POSITION}(?:_{_POSITION}){{1,{MAX_HISTORY_PARTITIONS - 1}}})$")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise comparison of the arrays
class HistoryRecord:
    """Tokens one sequence generated, published by one client: tokens[i] sits at offset + i in it.

    Attributes:
        client_id: the publisher (the rules of `values.validate_client_id`); `append_history`
            sets it to the caller's client_id.
        seq: the publisher's sequence id, int64 (any value in [-2**63, 2**63)).
        group: "" or 1..64 characters of [A-Za-z0-9_.:-]: siblings of one prompt share it.
        offset: [0, 2**40): position of tokens[0] in the sequence.
        tokens: int32, 1..MAX_RECORD_TOKENS tokens, each in [0, vocab_size).
        cursor: set on read: resume after it.
        time_ms: set on read: when the store took it (ms since the epoch; Redis: the stream id's ms).
    """

    client_id: str
    seq: int
    group: str
    offset: int
    tokens: np.ndarray
    cursor: str = ""
    time_ms: int = 0


@dataclasses.dataclass(frozen=True)
class HistoryAppend:
    """What `append_history` did with one batch: its records are stored or skipped, never anything else.

    Attributes:
        stored: False for a duplicate (a retry of a batch stored before): nothing happened now
            and every count is 0.
        records, tokens: what this call stored.
        skipped_records, skipped_tokens: near-duplicate prompts this call did not store (the same
            prompt stored in the last DUPLICATE_WINDOW_MS); with ``records``/``tokens`` they add up
            to the whole batch.
    """

    stored: bool
    records: int = 0
    tokens: int = 0
    skipped_records: int = 0
    skipped_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class HistoryBatch:
    """One sender's batch for `CountsStore.append_history_many`: the arguments `append_history` takes."""

    client_id: str
    batch_seq: int
    records: Sequence[HistoryRecord]
    fingerprint: bytes | None = None


@dataclasses.dataclass(frozen=True)
class HistoryBudget:
    """What a namespace's history may hold; the oldest records are dropped beyond it.

    Attributes:
        max_bytes: BYTES_PER_TOKEN a stored token, per namespace.
        max_age_s: records older than this many seconds are dropped.
    """

    max_bytes: int = 64 << 20
    max_age_s: float = 3600.0

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise InvalidArgumentError(f"history max_bytes must be an integer >= 1, got {self.max_bytes!r}")
        if not float(self.max_age_s) > 0:
            raise InvalidArgumentError(f"history max_age must be > 0 seconds, got {self.max_age_s!r}")

    @property
    def max_age_ms(self) -> int:
        """``max_age_s`` in whole milliseconds, at least 1."""
        return max(1, int(self.max_age_s * 1000))


@dataclasses.dataclass(frozen=True)
class HistoryPage:
    """The answer of `read_history`.

    Attributes:
        records: oldest first.
        cursor: resume after this (== the ``after`` given when nothing was new).
        gap: ``after`` was older than the oldest kept record (or from another incarnation):
            some records were trimmed unseen.
        more: a partitioned history cut the page short of ``limit`` (a partition answered its whole
            share): more records may follow at once, read again without waiting.
    """

    records: list[HistoryRecord]
    cursor: str
    gap: bool
    more: bool = False


@dataclasses.dataclass(frozen=True)
class Cursor:
    """A parsed cursor: the incarnation that issued it and a position the backend reads (see `parse_cursor`).

    ``positions`` is set for a composite cursor (a partitioned history, `partition_of`): one
    position per partition, "" where the cursor reads that partition from its oldest kept record;
    ``position`` is then "".
    """

    incarnation: str
    position: str
    positions: tuple[str, ...] = ()


def format_cursor(incarnation: str, position: str) -> str:
    """The cursor string of a position in one incarnation of a namespace's history."""
    return f"{incarnation}.{position}"


def format_composite_cursor(incarnation: str, positions: Sequence[str]) -> str:
    """The cursor of a partitioned history: a position per partition, "" for one read from its oldest kept record."""
    return f"{incarnation}.{'_'.join(positions)}"


def parse_cursor(after: str) -> Cursor | None:
    """Parse a cursor: None for "" (from the oldest kept record).

    A cursor is ``<incarnation>.<position>``: the incarnation names the history that issued
    it (a namespace instance on Redis, a store process on the embedded backend); the
    position is a stream id ``<ms>-<n>`` (Redis) or a counter (embedded). A partitioned
    history (`partition_of`, Redis Cluster) gives composite cursors
    ``<incarnation>.<p0>_<p1>_..`` with a stream id (or "": from the oldest kept) per
    partition; a single-position cursor given to it names partition 0, the others read from
    their oldest kept record (so an older client's cursor keeps working). A cursor of
    another incarnation is answered from the oldest kept record with ``gap=True`` by both
    backends; only a malformed one is an error.

    Raises:
        InvalidArgumentError: not a cursor.
    """
    if not isinstance(after, str):
        raise InvalidArgumentError(f"cursor must be a string, got {type(after).__name__}")
    if after == "":
        return None
    match = _CURSOR_RE.fullmatch(after)
    if match is not None:
        return Cursor(match.group(1), match.group(2))
    match = _COMPOSITE_RE.fullmatch(after)
    if match is None:
        raise InvalidArgumentError(f"malformed history cursor {after[:100]!r}")
    return Cursor(match.group(1), "", tuple(match.group(2).split("_")))


def validate_partitions(partitions: int) -> int:
    """A history partition count: an integer in [1, MAX_HISTORY_PARTITIONS], else InvalidArgumentError."""
    if isinstance(partitions, bool) or not isinstance(partitions, (int, np.integer)) \
            or not 1 <= int(partitions) <= MAX_HISTORY_PARTITIONS:
        raise InvalidArgumentError(f"history_partitions must be an integer in [1, {MAX_HISTORY_PARTITIONS}], "
                                   f"got {partitions!r}")
    return int(partitions)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, person=b"ngc-hpart").digest(), "little")


def partition_of(record: HistoryRecord, partitions: int) -> int:
    """The partition of a partitioned history that holds ``record``: by its group, so a group's records stay together
    (its siblings, its prompt's near-duplicates, and a group-first read touches one partition); a record without a
    group by its (client id, seq), so a sequence stays in order in one partition and sequences spread evenly.

    Stable across processes and versions (every replica must agree): BLAKE2b, not Python's hash.
    """
    if partitions == 1:
        return 0
    key = f"g\0{record.group}" if record.group else f"s\0{record.client_id}\0{record.seq}"
    return _hash64(key) % partitions


def partitions_of_groups(groups: Collection[str], partitions: int) -> list[int]:
    """The partitions (sorted) that hold the records of ``groups`` ("" among them, or none given: every partition)."""
    if not groups or "" in groups or partitions == 1:
        return list(range(partitions))
    return sorted({_hash64(f"g\0{group}") % partitions for group in groups})


def validate_batch_seq(batch_seq: int) -> int:
    """A batch number: an integer in [0, 2**53) (it travels through Lua numbers), else InvalidArgumentError."""
    try:
        return validate_seq(batch_seq)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"batch_seq must be an integer in [0, 2**53), got {batch_seq!r}") from None


def validate_limit(limit: int) -> int:
    """A read limit: an integer in [1, MAX_READ_LIMIT], else InvalidArgumentError."""
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 1 <= int(limit) <= MAX_READ_LIMIT:
        raise InvalidArgumentError(f"limit must be an integer in [1, {MAX_READ_LIMIT}], got {limit!r}")
    return int(limit)


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _checked_tokens(tokens: object, vocab_size: int, where: str) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise InvalidArgumentError(f"{where}: tokens must be a 1-D integer array, got shape {array.shape} "
                                   f"of {array.dtype}")
    if not 1 <= array.size <= MAX_RECORD_TOKENS:
        raise InvalidArgumentError(f"{where}: a record holds 1..{MAX_RECORD_TOKENS} tokens, got {array.size}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidArgumentError(f"{where}: token {bad} is outside [0, {vocab_size})")
    return np.ascontiguousarray(array, dtype="<i4")


def validate_records(records: Sequence[HistoryRecord], client_id: str, vocab_size: int) -> list[HistoryRecord]:
    """Check a whole batch; return its records with ``client_id`` set and tokens as contiguous little-endian int32.

    Raises:
        InvalidArgumentError: the first bad record (by index) or the batch's size; nothing is stored.
    """
    validate_client_id(client_id)
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise InvalidArgumentError(f"records must be a sequence of HistoryRecord, got {type(records).__name__}")
    if len(records) > MAX_BATCH_RECORDS:
        raise InvalidArgumentError(f"a batch holds at most {MAX_BATCH_RECORDS} records, got {len(records)}")
    checked = []
    for i, record in enumerate(records):
        where = f"history record {i}"
        if not isinstance(record, HistoryRecord):
            raise InvalidArgumentError(f"{where} is a {type(record).__name__}, not a HistoryRecord")
        if not _is_int(record.seq) or not _INT64_MIN <= int(record.seq) <= _INT64_MAX:
            raise InvalidArgumentError(f"{where}: seq must be an int64, got {record.seq!r}")
        if not _is_int(record.offset) or not 0 <= int(record.offset) < MAX_OFFSET:
            raise InvalidArgumentError(f"{where}: offset must be an integer in [0, 2**40), got {record.offset!r}")
        try:
            validate_group(record.group, empty_ok=True)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        tokens = _checked_tokens(record.tokens, vocab_size, where)
        checked.append(HistoryRecord(client_id, int(record.seq), record.group, int(record.offset), tokens))
    return checked


def is_prompt(record: HistoryRecord) -> bool:
    """Whether a checked record is a sequence's prompt: at offset 0, in the group its tokens name.

    The client tags a sequence it has no explicit group for with the hex of an 8-byte BLAKE2b of
    its first record's tokens (``client.sync.history_sources.prompt_group``: its prompt, which the
    siblings sampled from it share). Such a record is the prompt itself, and its group names it,
    so a reader that holds one sibling's copy can put it back in front of another sibling's
    sequence (`MirroredRuns`). Any other record at offset 0 (an explicit group's, or a prompt
    drained with generated tokens) is a sequence's own start and never a near-duplicate.
    """
    if record.offset != 0 or len(record.group) != 16:
        return False
    digest = hashlib.blake2b(np.ascontiguousarray(record.tokens, dtype="<i4").tobytes(), digest_size=8)
    return digest.hexdigest() == record.group


def duplicate_key(record: HistoryRecord) -> bytes | None:
    """The near-duplicate key of a checked record: a digest of (group, tokens) for a prompt (`is_prompt`), else None.

    Two records with one key are the same prompt sent by siblings; the store keeps the first and
    skips the others for DUPLICATE_WINDOW_MS after it (best effort: a digest per key, forgotten
    once the window passed or the namespace dropped). Records that are not prompts are never
    compared, so no sequence loses its start to a sibling's.
    """
    if not is_prompt(record):
        return None
    digest = hashlib.blake2b(record.group.encode(), digest_size=16, person=b"ngc-history")
    digest.update(b"\0")
    digest.update(record.tokens.tobytes())
    return digest.digest()
