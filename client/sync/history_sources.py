"""What a drafter appends of other publishers' sequences: the source id of each contiguous run, and which offsets it already holds."""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict

import numpy as np
from numpy.typing import NDArray

__all__ = ["HELD_IDLE_SECONDS", "KNOWN_SEQUENCES", "MirroredRuns", "SourceIds"]

KNOWN_SEQUENCES = 1 << 16
"""Remote sequences whose runs are remembered; beyond, the least recently appended is forgotten."""

HELD_IDLE_SECONDS = 0.25
"""Tokens a source held back for a history piece (match_params history_piece) join the history once it
has been idle this long: a finished sequence's last tokens do not wait for more that never come."""

_MAX_RUNS = 16  # runs remembered per sequence: a sequence arrives in order, so it is nearly always one


def source_id(client_id: str, seq: int, offset: int) -> int:
    """A stable signed int64 for (client_id, seq, the offset its run started at)."""
    digest = hashlib.blake2b(f"{client_id}\0{seq}\0{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SourceIds:
    """The ``source`` a mirrored record is appended to the drafter's history under: one per contiguous run of a sequence.

    A record continuing where the same (client_id, seq) stopped keeps its source, so the
    drafter continues one text; a record that does not (one was trimmed unseen, or sent twice)
    gets another, so two pieces are never glued together.
    """

    def __init__(self, limit: int = KNOWN_SEQUENCES) -> None:
        self.next: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()  # -> (next offset, source)
        self.limit = limit

    source = staticmethod(source_id)

    def of(self, client_id: str, seq: int, offset: int, length: int) -> int:
        key = (client_id, seq)
        known = self.next.get(key)
        source = known[1] if known is not None and known[0] == offset else self.source(client_id, seq, offset)
        self.next[key] = (offset + length, source)
        self.next.move_to_end(key)
        while len(self.next) > self.limit:
            self.next.popitem(last=False)
        return source


class MirroredRuns:
    """The offsets of each remote (client_id, seq) already appended, as runs, each under its `source_id`.

    A record can reach a mirror twice (by its group's pull and by the namespace's tail, or
    sent twice by its publisher): `fresh` returns only the parts of it not held yet, so every
    token of a sequence is appended once, whatever order its records come in. A part that
    starts where a run ends continues that run's source (one text in the drafter); any other
    starts a run of its own. Bounded: `KNOWN_SEQUENCES` sequences (the least recently appended
    forgotten), `_MAX_RUNS` runs each (the lowest forgotten): a forgotten part sent again would
    be appended again.

    Thread-safety: none; the mirror's task owns it.
    """

    def __init__(self, limit: int = KNOWN_SEQUENCES) -> None:
        self.runs: OrderedDict[tuple[str, int], list[list[int]]] = OrderedDict()  # [start, end, source], sorted, disjoint
        self.limit = limit

    def held(self, client_id: str, seq: int) -> list[tuple[int, int]]:
        """The (start, end) offset ranges of the sequence appended so far."""
        return [(start, end) for start, end, _ in self.runs.get((client_id, seq), [])]

    def fresh(self, client_id: str, seq: int, offset: int,
              tokens: NDArray[np.int32]) -> list[tuple[int, NDArray[np.int32]]]:
        """The parts of a record not appended yet, as (source, tokens), in offset order; they count as appended from now."""
        key = (client_id, seq)
        runs = self.runs.get(key)
        if runs is None:
            runs = self.runs[key] = []
        self.runs.move_to_end(key)
        out: list[tuple[int, NDArray[np.int32]]] = []
        end = offset + len(tokens)
        at = offset
        i = bisect.bisect_right(runs, at, key=lambda run: run[0]) - 1  # the last run starting at or before `at`
        i = max(i, 0)
        while at < end:
            while i < len(runs) and runs[i][1] <= at:
                i += 1
            if i < len(runs) and runs[i][0] <= at:  # inside a held run: skip to its end
                at = runs[i][1]
                continue
            stop = min(end, runs[i][0]) if i < len(runs) else end
            before = runs[i - 1] if i > 0 and runs[i - 1][1] == at else None
            if before is not None:
                before[1] = stop
                source = before[2]
            else:
                source = source_id(client_id, seq, at)
                runs.insert(i, [at, stop, source])
                i += 1
            out.append((source, tokens[at - offset:stop - offset]))
            at = stop
        del runs[:max(0, len(runs) - _MAX_RUNS)]
        while len(self.runs) > self.limit:
            self.runs.popitem(last=False)
        return out
