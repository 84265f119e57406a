"""The Redis backend's fleet history: one stream per namespace, appended and trimmed by one Lua script per call (`redis_scripts` HAPPEND, HREAD).

A namespace's history keys (`schema.history_keys`) share its record's hash tag, so every
call is one EVALSHA on one node, atomic even on a Cluster, and a Cluster spreads the
namespaces' streams over its masters. A record is a stream entry of five short fields
(client id, seq, group, offset, tokens as raw little-endian int32), its cursor
``<namespace instance>.<stream id>`` and its time the stream id's milliseconds (the Redis
server's clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ngramcache.client.errors import InvalidArgumentError

from . import schema
from .config import CountsStoreConfig
from .history import (
    BYTES_PER_TOKEN,
    DUPLICATE_WINDOW_MS,
    HistoryAppend,
    HistoryPage,
    HistoryRecord,
    duplicate_key,
    format_cursor,
    parse_cursor,
)
from .redis_connection import RedisConnection
from .redis_handles import Handle, StaleHandle
from .redis_scripts import HAPPEND, HREAD

__all__ = ["RedisHistory"]


def _stream_id(text: str, after: str) -> tuple[int, int]:
    ms, sep, n = text.partition("-")
    if not sep:
        raise InvalidArgumentError(f"history cursor {after[:100]!r} is not a Redis store's cursor")
    return int(ms), int(n)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisHistory:
    """Appends and reads of the fleet history for `RedisCountsStore`. Thread-safe (no state of its own)."""

    def __init__(self, conn: RedisConnection, config: CountsStoreConfig) -> None:
        self._conn = conn
        self._config = config

    def _keys(self, handle: Handle) -> tuple[str, str, str, str, str]:
        return schema.history_keys(self._config.prefix, handle.info.name)

    def append(self, handle: Handle, client_id: str, batch_seq: int, records: Sequence[HistoryRecord]) -> HistoryAppend:
        """Run HAPPEND for checked records; raises StaleHandle when the namespace changed instance."""
        budget = self._config.history_budget
        args: list[Any] = [handle.info.instance, client_id, batch_seq, budget.max_bytes // BYTES_PER_TOKEN,
                           budget.max_age_ms, DUPLICATE_WINDOW_MS, self._config.dedup_ttl_ms]
        for record in records:
            args += [record.seq, record.group, record.offset, record.tokens.tobytes(), duplicate_key(record) or b""]
        stream, stat, seq, seen, dup = self._keys(handle)
        reply = [int(x) for x in self._conn.run_one(HAPPEND, [handle.meta, stream, stat, seq, seen, dup], args)]
        if reply[0] < 0:
            raise StaleHandle
        if reply[0] == 0:
            return HistoryAppend(False)
        return HistoryAppend(True, *reply[1:5])

    def read(self, handle: Handle, after: str, limit: int) -> HistoryPage:
        """Run HREAD after cursor ``after`` (see `CountsStore.read_history`)."""
        cursor = parse_cursor(after)
        incarnation = handle.info.instance
        since: tuple[int, int] | None = None
        if cursor is not None and cursor.incarnation == incarnation:
            since = _stream_id(cursor.position, after)
        budget = self._config.history_budget
        stream, stat, *_ = self._keys(handle)
        reply = self._conn.run_one(HREAD, [handle.meta, stream, stat],
                                   [incarnation, "" if since is None else f"{since[0]}-{since[1]}", limit,
                                    budget.max_bytes // BYTES_PER_TOKEN, budget.max_age_ms])
        if int(reply[0]) < 0:
            raise StaleHandle
        trimmed_text = _text(reply[1])
        trimmed = _stream_id(trimmed_text, trimmed_text) if trimmed_text else (0, 0)
        records = [self._record(incarnation, entry) for entry in reply[2]]
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

    @staticmethod
    def _record(incarnation: str, entry: Any) -> HistoryRecord:
        entry_id = _text(entry[0])
        raw = entry[1]
        fields = {_text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
        return HistoryRecord(_text(fields["c"]), int(fields["s"]), _text(fields["g"]), int(fields["o"]),
                             np.frombuffer(fields["t"], dtype="<i4").copy(),
                             format_cursor(incarnation, entry_id), int(entry_id.partition("-")[0]))

    def stats(self, handle: Handle) -> dict[str, int]:
        stream, stat, *_ = self._keys(handle)
        with self._conn.errors():
            pipe = self._conn.client.pipeline(transaction=False)
            pipe.xlen(stream)
            pipe.hget(stat, "tokens")
            records, tokens = pipe.execute()
        tokens = int(tokens or 0)
        return {"records": int(records), "tokens": tokens, "bytes": tokens * BYTES_PER_TOKEN}
