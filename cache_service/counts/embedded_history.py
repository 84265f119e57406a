"""The embedded backend's fleet history: one namespace's recent records in memory, under the rules of `history`.

The history is a recent window, not a log: it lives in the store's process only (the
snapshot file holds counts, not history), so a restarted embedded store starts with an
empty history under a new incarnation, and cursors of the old one are answered from the
oldest kept record with ``gap=True``.
"""

from __future__ import annotations

import collections
import secrets
from typing import Final

from ngramcache.client.kernel.errors import InvalidArgumentError

from .history import (
    BYTES_PER_TOKEN,
    DUPLICATE_WINDOW_MS,
    HistoryAppend,
    HistoryBudget,
    HistoryPage,
    HistoryRecord,
    duplicate_key,
    format_cursor,
    parse_cursor,
)

__all__ = ["NamespaceHistory"]

_SWEEP_EVERY: Final = 1024  # appends between sweeps of silent senders' dedup records


class NamespaceHistory:
    """One namespace's history window. Not thread-safe: the store's lock guards it.

    Positions are a counter (1, 2, ...) per incarnation; a cursor is ``<incarnation>.<position>``.

    Args:
        dedup_ttl_ms: a sender's highest batch_seq is forgotten after this long without appends.
    """

    def __init__(self, dedup_ttl_ms: int) -> None:
        self.incarnation = secrets.token_hex(8)
        self._dedup_ttl_ms = dedup_ttl_ms
        self._records: collections.deque[HistoryRecord] = collections.deque()
        self._positions: collections.deque[int] = collections.deque()
        self._next = 1
        self._trimmed = 0  # position of the newest record trimmed (0: none)
        self._tokens = 0
        self._senders: dict[str, tuple[int, int]] = {}  # client_id -> (highest batch_seq, last append ms)
        self._recent: dict[bytes, int] = {}  # near-duplicate key -> ms stored, oldest first
        self._appends = 0

    def append(self, client_id: str, batch_seq: int, records: list[HistoryRecord], budget: HistoryBudget,
               now_ms: int) -> HistoryAppend:
        """Store a checked batch unless (client_id, batch_seq) is a duplicate, near-duplicate prompts skipped; trim to
        ``budget``."""
        sender = self._senders.get(client_id)
        if sender is not None and batch_seq <= sender[0]:
            return HistoryAppend(False)
        self._senders[client_id] = (batch_seq, now_ms)
        self._forget_recent(now_ms)
        stored = tokens = skipped = skipped_tokens = 0
        for record in records:
            key = duplicate_key(record)
            if key is not None:
                if key in self._recent:
                    skipped += 1
                    skipped_tokens += len(record.tokens)
                    continue
                self._recent[key] = now_ms
            position = self._next
            self._next += 1
            self._records.append(HistoryRecord(client_id, record.seq, record.group, record.offset, record.tokens,
                                               format_cursor(self.incarnation, str(position)), now_ms))
            self._positions.append(position)
            self._tokens += len(record.tokens)
            stored += 1
            tokens += len(record.tokens)
        self.trim(budget, now_ms)
        self._appends += 1
        if self._appends % _SWEEP_EVERY == 0:
            silent = now_ms - self._dedup_ttl_ms
            for cid in [cid for cid, (_, touched) in self._senders.items() if touched < silent]:
                del self._senders[cid]
        return HistoryAppend(True, stored, tokens, skipped, skipped_tokens)

    def _forget_recent(self, now_ms: int) -> None:
        horizon = now_ms - DUPLICATE_WINDOW_MS
        while self._recent:
            key, stored = next(iter(self._recent.items()))
            if stored >= horizon:
                break
            del self._recent[key]

    def trim(self, budget: HistoryBudget, now_ms: int) -> None:
        """Drop the oldest records while over ``budget``'s bytes or older than its age."""
        max_tokens = budget.max_bytes // BYTES_PER_TOKEN
        oldest = now_ms - budget.max_age_ms
        while self._records and (self._tokens > max_tokens or self._records[0].time_ms < oldest):
            self._tokens -= len(self._records.popleft().tokens)
            self._trimmed = self._positions.popleft()

    def read(self, after: str, limit: int, budget: HistoryBudget, now_ms: int) -> HistoryPage:
        """Up to ``limit`` records after cursor ``after`` (see `CountsStore.read_history`)."""
        cursor = parse_cursor(after)
        self.trim(budget, now_ms)
        if cursor is None:
            since, gap = 0, False
        elif cursor.incarnation != self.incarnation:
            since, gap = 0, True
        else:
            since = _position(cursor.position, after)
            gap = since < self._trimmed
        start = self._first_after(since)
        records = [self._records[i] for i in range(start, min(start + limit, len(self._records)))]
        if records:
            next_cursor = records[-1].cursor
        elif cursor is not None and gap:  # resume at what was trimmed, so the gap is reported once
            next_cursor = format_cursor(self.incarnation, str(self._trimmed))
        else:
            next_cursor = after
        return HistoryPage(records, next_cursor, gap)

    def _first_after(self, since: int) -> int:
        """Index of the first kept record whose position is above ``since`` (positions are consecutive)."""
        if not self._positions:
            return 0
        return min(len(self._positions), max(0, since + 1 - self._positions[0]))

    def stats(self) -> dict[str, int]:
        return {"records": len(self._records), "tokens": self._tokens, "bytes": self._tokens * BYTES_PER_TOKEN}


def _position(text: str, after: str) -> int:
    if not text.isdigit():
        raise InvalidArgumentError(f"history cursor {after[:100]!r} is not an embedded store's cursor")
    return int(text)
