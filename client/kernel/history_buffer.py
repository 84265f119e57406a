"""The fleet history's records before they are pushed: validated groups, pending records, live groups, the bounded buffer.

No wire here: the client's publisher (`ngramcache.client.sync.history`) and the service's own history
feed (`ngramcache.cache_service.history_feed`) both buffer accepted records in a `HistoryBuffer`.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections import OrderedDict, deque

import numpy as np
from numpy.typing import NDArray

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.history_sources import KNOWN_SEQUENCES, Prompts, prompt_group

__all__ = ["DROP_LOG_INTERVAL", "GROUP_LIVE_SECONDS", "MAX_BATCH_BYTES", "MAX_BATCH_RECORDS", "MAX_RECORD_TOKENS",
           "HistoryBuffer", "LiveGroups", "PendingRecord", "validate_group"]

MAX_RECORD_TOKENS = 4096
"""Most tokens of a record unless the server says less (ServerLimits.max_history_record_tokens)."""

MAX_BATCH_RECORDS = 256
"""Most records of a batch unless the server says less (ServerLimits.max_history_records)."""

MAX_BATCH_BYTES = 1 << 20
"""Most token bytes of a batch: far under any message limit, small enough to retry cheaply."""

GROUP_LIVE_SECONDS = 30.0
"""A group stays live this long after this client last published (or `set_group` named) a sequence of it."""

DROP_LOG_INTERVAL = 10.0
"""Seconds between two log lines about dropped history tokens."""

_GROUP_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_KNOWN_GROUPS = 4096  # live groups remembered; beyond, the least recently used is forgotten


def validate_group(group: str, *, empty_ok: bool = False) -> str:
    """``group`` if it is 1..64 characters of [A-Za-z0-9_.:-] (or "" where ``empty_ok``: a stored record
    without a group), else InvalidArgumentError."""
    if isinstance(group, str) and ((empty_ok and group == "") or _GROUP_RE.fullmatch(group)):
        return group
    shown = repr(group[:80]) if isinstance(group, str) else type(group).__name__
    allowed = "'' or 1..64" if empty_ok else "1..64"
    raise InvalidArgumentError(f"group must be {allowed} characters of [A-Za-z0-9_.:-], got {shown}")


@dataclasses.dataclass(frozen=True, eq=False)
class PendingRecord:
    """A record waiting to be pushed: tokens[i] sits at offset + i in sequence ``seq`` of group ``group``."""

    seq: int
    group: str
    offset: int
    tokens: NDArray[np.int32]


class _Bounded(OrderedDict[int, str]):
    """A dict that forgets its oldest keys beyond ``limit`` (sequences come and go)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: int, value: str) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class LiveGroups:
    """The groups of the sequences this client publishes now, most recently used first.

    A group becomes live when `set_group` names it or a drained record carries it, and stays
    live for ``ttl`` seconds after its last use. The mirror pulls their records first. `prompts`
    holds the prompts this client published under their default groups: the store may keep a
    sibling's copy of one rather than this client's, and the mirror puts it back in front of that
    sibling's sequence (its pulls skip this client's own records).

    Thread-safety: every method may be called from any thread.
    """

    def __init__(self, ttl: float = GROUP_LIVE_SECONDS, limit: int = _KNOWN_GROUPS) -> None:
        self.ttl = ttl
        self.limit = limit
        self._used: OrderedDict[str, float] = OrderedDict()  # group -> monotonic time of its last use
        self._lock = threading.Lock()
        self.prompts = Prompts()

    def touch(self, group: str, now: float | None = None) -> None:
        """``group`` is used now ("" is no group and is ignored)."""
        if not group:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._used[group] = now
            self._used.move_to_end(group)
            while len(self._used) > self.limit:
                self._used.popitem(last=False)

    def recent(self, most: int, now: float | None = None) -> list[str]:
        """At most ``most`` live groups, the most recently used first (expired ones are forgotten)."""
        now = time.monotonic() if now is None else now
        out: list[str] = []
        with self._lock:
            for group, used in reversed(self._used.items()):
                if len(out) >= most or now - used > self.ttl:
                    break  # past `most`, or expired (and the older ones with it)
                out.append(group)
            while self._used and now - next(iter(self._used.values())) > self.ttl:
                self._used.popitem(last=False)
        return out


class HistoryBuffer:
    """What the publisher has drained and not yet pushed: records grouped, split to the limits, bounded in tokens.

    Thread-safety: `set_group` may be called from any thread; the rest only from the background loop.

    Args:
        max_pending_tokens: most tokens buffered; beyond, the oldest records are dropped.
        max_record_tokens, max_batch_records, max_batch_bytes: how records and batches are split.
    """

    def __init__(self, max_pending_tokens: int, *, max_record_tokens: int = MAX_RECORD_TOKENS,
                 max_batch_records: int = MAX_BATCH_RECORDS, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.max_pending_tokens = max_pending_tokens
        self.max_record_tokens = max_record_tokens
        self.max_batch_records = max_batch_records
        self.max_batch_bytes = max_batch_bytes
        self.pending: deque[PendingRecord] = deque()
        self.pending_tokens = 0
        self.explicit = _Bounded(KNOWN_SEQUENCES)  # set_group: seq -> group, under _lock
        self._lock = threading.Lock()
        self.derived = _Bounded(KNOWN_SEQUENCES)  # seq -> the hash of its first record
        self.live = LiveGroups()

    def limit(self, max_records: int, max_record_tokens: int) -> None:
        """Apply the server's limits (0: none given)."""
        if max_records:
            self.max_batch_records = max(1, min(self.max_batch_records, max_records))
        if max_record_tokens:
            self.max_record_tokens = max(1, min(self.max_record_tokens, max_record_tokens))

    def set_group(self, seq: int, group: str) -> None:
        group = validate_group(group)
        with self._lock:
            self.explicit.put(int(seq), group)
        self.live.touch(group)

    def group_of(self, seq: int, offset: int, tokens: NDArray[np.int32]) -> str:
        with self._lock:
            group = self.explicit.get(seq)
        if group is not None:
            return group
        group = self.derived.get(seq)
        if group is None:
            # The first record seen of a sequence holds its opening (its prompt, when the prompt
            # was accepted first); a sequence first seen mid-way has no prompt to hash: no group.
            group = prompt_group(tokens) if offset == 0 else ""
            self.derived.put(seq, group)
            self.live.prompts.learn(group, offset, tokens)
        return group

    def add(self, drained: list[tuple[int, int, NDArray[np.int32]]]) -> tuple[int, int]:
        """Buffer drained (seq, offset, tokens) records, split to ``max_record_tokens``; return (records, tokens) dropped."""
        for seq, offset, tokens in drained:
            tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            if not len(tokens):
                continue
            group = self.group_of(int(seq), int(offset), tokens)
            self.live.touch(group)
            step = self.max_record_tokens
            for start in range(0, len(tokens), step):
                part = tokens[start:start + step]
                self.pending.append(PendingRecord(int(seq), group, int(offset) + start, part))
                self.pending_tokens += len(part)
        return self.shrink()

    def shrink(self) -> tuple[int, int]:
        """Drop the oldest records while over ``max_pending_tokens``; return (records, tokens) dropped."""
        records = tokens = 0
        while self.pending_tokens > self.max_pending_tokens and self.pending:
            gone = self.pending.popleft()
            self.pending_tokens -= len(gone.tokens)
            records += 1
            tokens += len(gone.tokens)
        return records, tokens

    def take(self) -> list[PendingRecord]:
        """The next batch: the oldest records, up to the batch limits (removed from the buffer)."""
        batch: list[PendingRecord] = []
        size = 0
        while self.pending and len(batch) < self.max_batch_records:
            n = self.pending[0].tokens.nbytes
            if batch and size + n > self.max_batch_bytes:
                break
            record = self.pending.popleft()
            self.pending_tokens -= len(record.tokens)
            batch.append(record)
            size += n
        return batch
