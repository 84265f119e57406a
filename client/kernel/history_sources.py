"""What a drafter appends of other publishers' sequences: the source id of each contiguous run, which offsets it already
holds, and the prompts a sequence whose own copy the store skipped (a sibling's near-duplicate) starts with."""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict

import numpy as np
from numpy.typing import NDArray

__all__ = ["HELD_IDLE_SECONDS", "KNOWN_SEQUENCES", "MirroredRuns", "Prompts", "SourceIds", "prompt_group"]

KNOWN_SEQUENCES = 1 << 16
"""Remote sequences whose runs are remembered; beyond, the least recently appended is forgotten."""

HELD_IDLE_SECONDS = 0.25
"""Tokens a source held back for a history piece (match_params history_piece) join the history once it
has been idle this long: a finished sequence's last tokens do not wait for more that never come."""

_MAX_RUNS = 16  # runs remembered per sequence: a sequence arrives in order, so it is nearly always one

PROMPT_TOKENS = 1 << 20
"""Most tokens of the prompts a `Prompts` remembers (4 MB); beyond, the least recently seen are forgotten."""


def prompt_group(tokens: NDArray[np.int32]) -> str:
    """The default group of a sequence: the hex of an 8-byte blake2b of its first record's tokens (its prompt).

    The store skips a record at offset 0 in the group its tokens name when a sibling stored the
    same one in the last 10 s (cache_service.counts.history.is_prompt, the same digest).
    """
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=8).hexdigest()


class Prompts:
    """The prompts seen lately, by the group their tokens name: what a sequence starts with when the store kept only a
    sibling's copy of it.

    A record at offset 0 whose group is `prompt_group` of its tokens is a prompt; the store skips
    such a record when a sibling stored the same one in the last 10 s, so a sibling's sequence
    may reach a reader without its start: its first record sits at offset len(prompt) in the
    prompt's group. `start` finds that prompt, so the reader appends the sequence whole.
    Bounded by `PROMPT_TOKENS` tokens, the least recently seen forgotten.

    Thread-safety: `learn` may be called from any thread; the rest from one.
    """

    def __init__(self, max_tokens: int = PROMPT_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._by_group: OrderedDict[str, NDArray[np.int32]] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, group: str, offset: int, tokens: NDArray[np.int32]) -> None:
        """Remember ``tokens`` if the record is a prompt (offset 0, in the group its tokens name)."""
        if offset != 0 or len(group) != 16 or not len(tokens) or prompt_group(tokens) != group:
            return
        tokens = np.array(tokens, dtype=np.int32)  # a copy: the caller's buffer may be reused
        with self._lock:
            old = self._by_group.pop(group, None)
            self.tokens -= 0 if old is None else len(old)
            self._by_group[group] = tokens
            self.tokens += len(tokens)
            while self.tokens > self.max_tokens and self._by_group:
                self.tokens -= len(self._by_group.popitem(last=False)[1])

    def start(self, group: str, offset: int) -> NDArray[np.int32] | None:
        """The prompt a sequence of ``group`` whose first record sits at ``offset`` starts with, or None."""
        if not offset or not group:
            return None
        with self._lock:
            prompt = self._by_group.get(group)
            if prompt is None or len(prompt) != offset:
                return None
            self._by_group.move_to_end(group)
            return prompt


def source_id(client_id: str, seq: int, offset: int) -> int:
    """A stable signed int64 for (client_id, seq, the offset its run started at)."""
    digest = hashlib.blake2b(f"{client_id}\0{seq}\0{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SourceIds:
    """The ``source`` a mirrored record is appended to the drafter's history under: one per contiguous run of a sequence.

    A record continuing where the same (client_id, seq) stopped keeps its source, so the
    drafter continues one text; a record that does not (one was trimmed unseen, or sent twice)
    gets another, so two pieces are never glued together. `whole` puts back a prompt the store
    skipped in front of the sequence that starts after it (`Prompts`).
    """

    def __init__(self, limit: int = KNOWN_SEQUENCES, prompts: Prompts | None = None) -> None:
        self.next: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()  # -> (next offset, source)
        self.limit = limit
        self.prompts = Prompts() if prompts is None else prompts

    def whole(self, client_id: str, seq: int, group: str, offset: int,
              tokens: NDArray[np.int32]) -> tuple[int, NDArray[np.int32]]:
        """(offset, tokens) of a record to append: with its prompt in front when it is the first seen of a sequence
        whose prompt the store kept only a sibling's copy of; else as given."""
        self.prompts.learn(group, offset, tokens)
        if (client_id, seq) in self.next:
            return offset, tokens
        prompt = self.prompts.start(group, offset)
        if prompt is None:
            return offset, tokens
        return 0, np.concatenate([prompt, np.asarray(tokens, dtype=np.int32)])

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
    be appended again. A sequence first seen right after a prompt of its group that the store
    kept only a sibling's copy of (`Prompts`) is appended with that prompt in front: no sequence
    is left without its start.

    Thread-safety: none; the mirror's task owns it.
    """

    def __init__(self, limit: int = KNOWN_SEQUENCES, prompts: Prompts | None = None) -> None:
        self.runs: OrderedDict[tuple[str, int], list[list[int]]] = OrderedDict()  # [start, end, source], sorted, disjoint
        self.limit = limit
        self.prompts = Prompts() if prompts is None else prompts

    def held(self, client_id: str, seq: int) -> list[tuple[int, int]]:
        """The (start, end) offset ranges of the sequence appended so far."""
        return [(start, end) for start, end, _ in self.runs.get((client_id, seq), [])]

    def fresh(self, client_id: str, seq: int, offset: int, tokens: NDArray[np.int32],
              group: str = "") -> list[tuple[int, NDArray[np.int32]]]:
        """The parts of a record not appended yet, as (source, tokens), in offset order; they count as appended from now.

        ``group`` is the record's: a prompt (`Prompts`) is remembered, and the first record seen
        of a sequence that starts right after a remembered prompt of its group gets it in front.
        """
        key = (client_id, seq)
        runs = self.runs.get(key)
        if runs and len(tokens) and runs[-1][1] == offset:
            # The usual record: the next part of a sequence, right where its last run ends (not a prompt: offset > 0).
            last = runs[-1]
            last[1] = offset + len(tokens)
            self.runs.move_to_end(key)
            return [(last[2], tokens)]
        self.prompts.learn(group, offset, tokens)
        if runs is None:
            runs = self.runs[key] = []
            prompt = self.prompts.start(group, offset)
            if prompt is not None:
                offset, tokens = 0, np.concatenate([prompt, np.asarray(tokens, dtype=np.int32)])
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
