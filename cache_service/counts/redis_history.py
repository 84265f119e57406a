"""The Redis backend's fleet history: a namespace's records in H partitions (streams), appended and trimmed by one Lua script per partition and call (`redis_scripts` HAPPEND, HREAD).

Each partition's keys (`schema.HistoryKeys`) share one hash tag, so every script is one
EVALSHA on one node, atomic even on a Cluster. Partition 0 is the namespace's coordinator
slot (where a namespace with one partition, or created before partitions, keeps its whole
history); partitions 1.. take the other slices of the slots, so one namespace's appends
spread over a Cluster's masters. A record goes to the partition of its group
(`history.partition_of`). A record is a stream entry of five short fields (client id, seq,
group, offset, tokens as raw little-endian int32), its time the stream id's milliseconds
(the Redis server's clock).

With one partition a cursor is ``<namespace instance>.<stream id>``. With H > 1 it is
composite, ``<instance>.<id or "">_<id or "">..`` (a position per partition); an older
single-position cursor names partition 0. Per partition the rules of `history` hold as with
one stream: a batch's part in a partition is stored exactly once per (client id, batch_seq)
(a retried batch stores the parts a failed try left out, and only those), near-duplicate
prompts are compared within the partition (a group's prompts are all there), each partition
keeps 1/H of the byte budget and the whole age budget, and a gap is reported when a cursor's
position in some partition was trimmed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError

from .config import CountsStoreConfig
from .history import (
    BYTES_PER_TOKEN,
    DUPLICATE_WINDOW_MS,
    HistoryAppend,
    HistoryPage,
    HistoryRecord,
    duplicate_key,
    format_composite_cursor,
    format_cursor,
    parse_cursor,
    partition_of,
    partitions_of_groups,
)
from .namespace import StaleNamespace
from .redis_connection import RedisConnection
from .redis_handles import Handle
from .redis_scripts import HAPPEND, HREAD, Call

__all__ = ["RedisHistory"]

_StreamId = tuple[int, int]


def _stream_id(text: str, after: str) -> _StreamId:
    ms, sep, n = text.partition("-")
    if not sep:
        raise InvalidArgumentError(f"history cursor {after[:100]!r} is not a Redis store's cursor")
    return int(ms), int(n)


def _before(sid: _StreamId) -> _StreamId:
    """The stream id just before ``sid`` (a cursor there reads ``sid`` next)."""
    return (sid[0], sid[1] - 1) if sid[1] else (sid[0] - 1, 2**64 - 1)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(entry: Any) -> tuple[str, dict[str, Any]]:
    raw = entry[1]
    return _text(entry[0]), {_text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}


def _record(entry_id: str, fields: dict[str, Any], cursor: str) -> HistoryRecord:
    return HistoryRecord(_text(fields["c"]), int(fields["s"]), _text(fields["g"]), int(fields["o"]),
                         np.frombuffer(fields["t"], dtype="<i4").copy(), cursor, int(entry_id.partition("-")[0]))


class RedisHistory:
    """Appends and reads of the fleet history for `RedisCountsStore`. Thread-safe (no state of its own)."""

    def __init__(self, conn: RedisConnection, config: CountsStoreConfig) -> None:
        self._conn = conn
        self._config = config

    def _max_tokens(self, handle: Handle) -> int:
        """Tokens one partition keeps: the namespace's byte budget split evenly."""
        return max(1, self._config.history_budget.max_bytes // BYTES_PER_TOKEN // handle.info.history_partitions)

    def append(self, handle: Handle, client_id: str, batch_seq: int, records: Sequence[HistoryRecord]) -> HistoryAppend:
        """`append_many` of one batch."""
        return self.append_many(handle, [(client_id, batch_seq, records)])[0]

    def append_many(self, handle: Handle, batches: Sequence[tuple[str, int, Sequence[HistoryRecord]]]
                    ) -> list[HistoryAppend]:
        """Run HAPPEND for checked batches: one call per partition for the parts of every batch there (pipelined over
        the partitions); raises StaleNamespace when the namespace changed instance.

        An empty batch takes its batch_seq in partition 0. A batch's ``stored`` is False only when every part was
        stored before (a retry); otherwise its counts are those of the parts stored now.
        """
        partitions = handle.info.history_partitions
        parts: dict[int, list[tuple[int, list[HistoryRecord]]]] = {}
        for i, (_client_id, _batch_seq, records) in enumerate(batches):
            mine: dict[int, list[HistoryRecord]] = {}
            for record in records:
                mine.setdefault(partition_of(record, partitions), []).append(record)
            if not mine:
                mine[0] = []
            for p, recs in mine.items():
                parts.setdefault(p, []).append((i, recs))
        budget = self._config.history_budget
        head: list[Any] = [handle.info.instance, self._max_tokens(handle), budget.max_age_ms, DUPLICATE_WINDOW_MS,
                           self._config.dedup_ttl_ms]
        order = sorted(parts)
        calls: list[Call] = []
        for p in order:
            keys = handle.history[p]
            args = list(head)
            for i, recs in parts[p]:
                args += [batches[i][0], batches[i][1], len(recs)]
                for record in recs:
                    args += [record.seq, record.group, record.offset, record.tokens.tobytes(),
                             duplicate_key(record) or b""]
            calls.append((HAPPEND, [keys.guard, keys.stream, keys.stat, keys.seq, keys.seen, keys.dup], args))
        replies = [[int(x) for x in reply] for reply in self._conn.for_counts(calls)]
        if any(reply[0] < 0 for reply in replies):
            raise StaleNamespace
        totals = [[0, 0, 0, 0, 0] for _ in batches]  # parts stored now, records, tokens, skipped, their tokens
        for p, reply in zip(order, replies):
            for k, (i, _recs) in enumerate(parts[p]):
                status = reply[1 + 5 * k:6 + 5 * k]
                if status[0] == 1:
                    totals[i] = [a + b for a, b in zip(totals[i], status)]
        return [HistoryAppend(True, *t[1:]) if t[0] else HistoryAppend(False) for t in totals]

    def read(self, handle: Handle, after: str, limit: int, groups: Sequence[str] = ()) -> HistoryPage:
        """Run HREAD after cursor ``after`` (see `CountsStore.read_history`)."""
        if handle.info.history_partitions == 1:
            return self._read_one(handle, after, limit)
        return self._read_partitions(handle, after, limit, groups)

    def _read_one(self, handle: Handle, after: str, limit: int) -> HistoryPage:
        cursor = parse_cursor(after)
        incarnation = handle.info.instance
        since: _StreamId | None = None
        if cursor is not None and cursor.incarnation == incarnation:
            if cursor.positions:
                raise InvalidArgumentError(f"history cursor {after[:100]!r} is a partitioned history's; this "
                                           f"namespace's history has one partition")
            since = _stream_id(cursor.position, after)
        budget = self._config.history_budget
        keys = handle.history[0]
        reply = self._conn.run_one(HREAD, [keys.guard, keys.stream, keys.stat],
                                   [incarnation, "" if since is None else f"{since[0]}-{since[1]}", limit,
                                    self._max_tokens(handle), budget.max_age_ms])
        if int(reply[0]) < 0:
            raise StaleNamespace
        trimmed_text = _text(reply[1])
        trimmed = _stream_id(trimmed_text, trimmed_text) if trimmed_text else (0, 0)
        records = []
        for entry in reply[2]:
            entry_id, fields = _fields(entry)
            records.append(_record(entry_id, fields, format_cursor(incarnation, entry_id)))
        if cursor is None:
            gap = False
        elif since is None:  # another incarnation's cursor: answered from the oldest kept
            gap = True
        else:
            gap = since < trimmed
        if records:
            next_cursor = records[-1].cursor
        elif gap:  # resume at what was trimmed, so the gap is reported once
            next_cursor = format_cursor(incarnation, f"{trimmed[0]}-{trimmed[1]}")
        else:
            next_cursor = after
        return HistoryPage(records, next_cursor, gap)

    def _read_partitions(self, handle: Handle, after: str, limit: int, groups: Sequence[str]) -> HistoryPage:
        """Read the partitions (those of ``groups``, or all) at once and merge them by stream id, oldest first.

        Each partition is asked for an equal share of ``limit``; the merge stops where a partition that answered its
        whole share runs out (its next records, unread, may be older than the others' rest), so every partition's
        records in the page are a prefix of what it holds after the cursor, and ``more`` says a page was cut so.
        """
        partitions = handle.info.history_partitions
        cursor = parse_cursor(after)
        incarnation = handle.info.instance
        since: list[_StreamId | None] = [None] * partitions
        foreign = cursor is not None and cursor.incarnation != incarnation
        if cursor is not None and not foreign:
            if cursor.positions:
                if len(cursor.positions) != partitions:
                    raise InvalidArgumentError(
                        f"history cursor {after[:100]!r} holds {len(cursor.positions)} positions; this namespace's "
                        f"history has {partitions} partitions")
                since = [_stream_id(text, after) if text else None for text in cursor.positions]
            else:  # an older single-position cursor (one partition, or a replica from before partitions): partition 0
                since[0] = _stream_id(cursor.position, after)
        read = partitions_of_groups(groups, partitions)
        share = -(-limit // len(read))
        budget = self._config.history_budget
        max_tokens = self._max_tokens(handle)
        calls: list[Call] = []
        for p in read:
            keys = handle.history[p]
            start = since[p]
            calls.append((HREAD, [keys.guard, keys.stream, keys.stat],
                          [incarnation, "" if start is None else f"{start[0]}-{start[1]}", share, max_tokens,
                           budget.max_age_ms]))
        replies = self._conn.run(calls)
        if any(int(reply[0]) < 0 for reply in replies):
            raise StaleNamespace
        given = ["" if s is None else f"{s[0]}-{s[1]}" for s in since]
        positions = list(given)
        gap = foreign
        streams: list[list[tuple[_StreamId, int, str, dict[str, Any]]]] = []
        full: dict[int, int] = {}
        for p, reply in zip(read, replies):
            entries = []
            for entry in reply[2]:
                entry_id, fields = _fields(entry)
                entries.append((_stream_id(entry_id, entry_id), p, entry_id, fields))
            if len(entries) >= share:
                full[p] = len(entries)
            streams.append(entries)
            trimmed_text = _text(reply[1])
            trimmed = _stream_id(trimmed_text, trimmed_text) if trimmed_text else None
            start = since[p]
            if start is not None and trimmed is not None and start < trimmed:
                gap = True  # resume at what was trimmed, so the gap is reported once
                start = trimmed
            if start is None:
                # From the oldest kept: the cursor now says where that was, so a record trimmed before the
                # next read is reported as a gap (and what was trimmed before this read is not).
                start = _before(entries[0][0]) if entries else trimmed or (0, 0)
            positions[p] = f"{start[0]}-{start[1]}"
        records: list[HistoryRecord] = []
        taken: dict[int, int] = {}
        more = False
        for _sid, p, entry_id, fields in heapq.merge(*streams, key=lambda e: (e[0], e[1])):
            if len(records) >= limit:
                more = True
                break
            positions[p] = entry_id
            records.append(_record(entry_id, fields, format_composite_cursor(incarnation, positions)))
            taken[p] = taken.get(p, 0) + 1
            if full.get(p) == taken[p]:
                more = True
                break
        if records:
            next_cursor = records[-1].cursor
        elif not foreign and positions == given:
            next_cursor = after  # nothing new, nothing trimmed: the cursor given (even an older one) stands
        else:
            next_cursor = format_composite_cursor(incarnation, positions)
        return HistoryPage(records, next_cursor, gap, more)

    def stats(self, handle: Handle) -> dict[str, int]:
        with self._conn.errors():
            pipe = self._conn.client.pipeline(transaction=False)
            for keys in handle.history:
                pipe.xlen(keys.stream)
                pipe.hget(keys.stat, "tokens")
            replies = pipe.execute()
        records = sum(int(x) for x in replies[0::2])
        tokens = sum(int(x or 0) for x in replies[1::2])
        return {"records": records, "tokens": tokens, "bytes": tokens * BYTES_PER_TOKEN}
