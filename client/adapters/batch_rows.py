"""A batching engine's rows mapped to drafter sequences by their tokens: new requests, requests that moved or came back, and finished ones freed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ngramcache.client.adapters.sequence_feed import DrafterLike
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["BatchRows", "RowSequence"]


class RowSequence:
    """One drafter sequence and the tokens it has accepted (a private, growing copy)."""

    __slots__ = ("_buf", "_len", "seq_id")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self._buf = np.empty(64, dtype=np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> NDArray[np.int32]:
        """The tokens accepted so far (a view of the private copy)."""
        return self._buf[: self._len]

    def is_prefix_of(self, tokens: NDArray[np.int32]) -> bool:
        """Whether `tokens` is this sequence followed by zero or more tokens."""
        n = self._len
        if n > len(tokens):
            return False
        if n == 0:
            return True
        # The last and first tokens differ first in the common cases (another request in the row), so
        # they are compared before the whole prefix.
        if tokens[n - 1] != self._buf[n - 1] or tokens[0] != self._buf[0]:
            return False
        return bool(np.array_equal(tokens[:n], self._buf[:n]))

    def extend_to(self, tokens: NDArray[np.int32]) -> None:
        """Records `tokens`, which this sequence is a prefix of (only the new tail is copied)."""
        n = len(tokens)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len:n] = tokens[self._len:]
        self._len = n

    def append(self, new: NDArray[np.int32]) -> None:
        """Records `new` after the tokens so far (an engine that hands over only what is new)."""
        n = self._len + len(new)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len:n] = new
        self._len = n


@dataclass
class _Parked:
    seq: RowSequence
    since: int  # the step it was last in a row


class BatchRows:
    """Finds, each step, the drafter sequence of every row of a batch from the row's tokens alone.

    An engine such as vLLM hands its proposer the rows of its persistent batch (each row the
    whole verified sequence of one request: prompt and accepted tokens) and no request ids, and
    rows change hands: a finished request's row goes to a new one, rows are compacted and
    swapped, a preempted request leaves the batch and comes back later, in another row. What
    identifies a request across steps is therefore its tokens, which only grow while it lives:

    - a row whose tokens extend the sequence the row had at the previous step keeps it (the
      common case; only the new tokens are counted);
    - otherwise, a sequence not yet claimed this step whose tokens the row extends (a request
      that moved rows, or was preempted and resumed) is taken over;
    - otherwise the row is a new request: a new sequence, counted from its first token.

    A sequence that no row claims is parked: kept (its request may be preempted, or waiting
    for its turn) until more than `max_parked` are parked or it has been out for `max_idle_steps`
    steps, then reset in the drafter (its context table freed). A finished request is freed
    that way. Two requests whose tokens are equal so far (samples of one prompt) may trade
    sequences; their context tables are equal too, so drafts do not change.

    Not thread-safe: one engine's proposer calls it from one thread.

    Args:
        drafter: the drafter whose sequences these are (`reset` frees them).
        first_seq_id: the first sequence id used; ids grow from it (give disjoint ranges to
            several users of one drafter).
        max_parked: most sequences kept while out of the batch (>= 0).
        max_idle_steps: steps after which a parked sequence is freed (>= 1).
    """

    def __init__(self, drafter: DrafterLike, *, first_seq_id: int = 1, max_parked: int = 256,
                 max_idle_steps: int = 10_000) -> None:
        if first_seq_id < 0:
            raise InvalidArgumentError(f"first_seq_id must be >= 0, got {first_seq_id}")
        if max_parked < 0:
            raise InvalidArgumentError(f"max_parked must be >= 0, got {max_parked}")
        if max_idle_steps < 1:
            raise InvalidArgumentError(f"max_idle_steps must be >= 1, got {max_idle_steps}")
        self.drafter = drafter
        self.max_parked = max_parked
        self.max_idle_steps = max_idle_steps
        self._next_id = first_seq_id
        self._by_row: dict[int, RowSequence] = {}
        self._parked: OrderedDict[int, _Parked] = OrderedDict()  # seq id -> parked, oldest first
        self._step = 0
        self.started = 0  # sequences started (new requests, and requests whose sequence was freed)
        self.taken_over = 0  # rows that found their request's sequence elsewhere (moved or resumed)
        self.freed = 0  # sequences reset in the drafter

    @property
    def live(self) -> int:
        """Sequences in rows at the last step."""
        return len(self._by_row)

    @property
    def parked(self) -> int:
        """Sequences kept out of the batch."""
        return len(self._parked)

    def assign(self, rows: Sequence[int], tokens: Sequence[NDArray[np.int32]], held: Sequence[int] = ()) -> list[RowSequence]:
        """Maps this step's rows to sequences and counts what is new in each.

        Args:
            rows: the row indices that have tokens to count this step.
            tokens: for each of `rows`, the row's whole verified sequence (int32).
            held: rows in the batch with nothing to count this step (a prefill not finished):
                they keep their sequence unchecked, unless one of `rows` extends it.

        Returns:
            The sequence of each of `rows`, in order; each has accepted its row's tokens.
        """
        self._step += 1
        previous = self._by_row
        current: dict[int, RowSequence] = {}
        claimed: set[int] = set()
        result: list[RowSequence | None] = [None] * len(rows)
        unmatched: list[int] = []
        for i, (r, toks) in enumerate(zip(rows, tokens, strict=True)):
            seq = previous.get(r)
            if seq is not None and seq.seq_id not in claimed and seq.is_prefix_of(toks):
                result[i] = seq
                claimed.add(seq.seq_id)
            else:
                unmatched.append(i)
        if unmatched:
            # Sequences that lost their row this step, or were already out, may be requests that moved.
            candidates = [s for s in previous.values() if s.seq_id not in claimed]
            candidates += [p.seq for p in self._parked.values()]
            for i in unmatched:
                toks = tokens[i]
                best: RowSequence | None = None
                for cand in candidates:
                    if cand.seq_id not in claimed and (best is None or len(cand) > len(best)) and cand.is_prefix_of(toks):
                        best = cand
                if best is not None:
                    self.taken_over += 1
                    self._parked.pop(best.seq_id, None)
                else:
                    best = RowSequence(self._next_id)
                    self._next_id += 1
                    self.started += 1
                    # A new id, but the drafter may be shared: make sure it starts empty.
                    self.drafter.reset(best.seq_id)
                claimed.add(best.seq_id)
                result[i] = best
        for r in held:
            # A row still prefilling keeps its sequence unless a row with tokens took it this step
            # (the request moved and a new one is filling its old row).
            seq = previous.get(r)
            if seq is not None and seq.seq_id not in claimed:
                current[r] = seq
                claimed.add(seq.seq_id)
        out: list[RowSequence] = []
        for r, seq, toks in zip(rows, result, tokens, strict=True):
            assert seq is not None
            current[r] = seq
            if len(toks) > len(seq):
                self.drafter.accept(seq.seq_id, toks)
                seq.extend_to(toks)
            out.append(seq)
        for seq in previous.values():
            if seq.seq_id not in claimed:
                self._parked[seq.seq_id] = _Parked(seq, self._step - 1)
        self._by_row = current
        self._free_parked()
        return out

    def forget(self) -> None:
        """Frees every sequence (live and parked) in the drafter; the next step starts afresh."""
        for seq in [*self._by_row.values(), *(p.seq for p in self._parked.values())]:
            self.drafter.reset(seq.seq_id)
            self.freed += 1
        self._by_row = {}
        self._parked.clear()

    def _free_parked(self) -> None:
        while self._parked:
            seq_id, oldest = next(iter(self._parked.items()))
            if len(self._parked) <= self.max_parked and self._step - oldest.since < self.max_idle_steps:
                break
            del self._parked[seq_id]
            self.drafter.reset(seq_id)
            self.freed += 1
