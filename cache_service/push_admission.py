"""Push admission: whether a push may wait for the store, from the store's measured throughput, and how long to ask a shed caller to wait.

The push path never lets work outlive its caller. A push is shed (answered
`OverloadedError`, RESOURCE_EXHAUSTED with reason OVERLOADED and a retry-after, nothing
applied) when its namespace's queue is full, when the rows ahead of it cannot reach the
store before its caller's deadline, or, when its group forms, when that group's store call
would end after the deadline. The estimates come from `StoreThroughput`, the rows per second
the store took on recent group calls; until a call was measured nothing is shed for its
deadline, and the oldest push of a group is never shed for it, so the estimate keeps
learning even when it is too pessimistic.
"""

from __future__ import annotations

import math

from ngramcache.client.kernel.errors import OverloadedError

__all__ = ["PushAdmission", "StoreThroughput"]

QUEUE_FULL = "queue_full"
DEADLINE = "deadline"
SHED_REASONS = (QUEUE_FULL, DEADLINE)
"""Why a push was shed: the values of the pushes-shed metric's ``reason`` label."""


class StoreThroughput:
    """Rows per second the store applied, over its recent group calls (rows-weighted, decaying).

    Thread-safety: not thread-safe; the batcher updates and reads it on the event loop.

    Args:
        decay: the weight the past keeps at each new call (0..1); 0.8 forgets a store that
            got faster or slower within some ten calls.
    """

    def __init__(self, decay: float = 0.8) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self._decay = decay
        self._rows = 0.0
        self._seconds = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """One store call applied ``rows`` rows in ``seconds`` (a failed call says nothing of the rate)."""
        if rows <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._rows = self._decay * self._rows + rows
        self._seconds = self._decay * self._seconds + max(seconds, 1e-6)

    @property
    def rows_per_second(self) -> float | None:
        """The estimate (None: nothing measured yet)."""
        return self._rows / self._seconds if self._seconds > 0 else None

    def seconds_for(self, rows: int) -> float | None:
        """How long the store should take for ``rows`` rows (None: unknown yet)."""
        rate = self.rows_per_second
        return rows / rate if rate else None


class PushAdmission:
    """The shedding decisions of a `PushBatcher` (see the module docstring).

    Args:
        max_queue_rows: most rows waiting in one namespace's queue (a push into an empty queue
            is always taken, however big).
        safety: a group's store call is expected to take its estimated time times this; a push
            whose deadline is nearer is shed rather than applied after its caller gave up.
        min_retry_after, max_retry_after: bounds of the retry-after hint, seconds.
    """

    def __init__(self, max_queue_rows: int, *, safety: float = 1.5, min_retry_after: float = 0.02,
                 max_retry_after: float = 5.0) -> None:
        if max_queue_rows < 1:
            raise ValueError("max_queue_rows must be >= 1")
        if not 0 < min_retry_after <= max_retry_after or safety < 1:
            raise ValueError("need 0 < min_retry_after <= max_retry_after and safety >= 1")
        self.max_queue_rows = max_queue_rows
        self.safety = safety
        self.min_retry_after = min_retry_after
        self.max_retry_after = max_retry_after
        self.throughput = StoreThroughput()

    def retry_after(self, rows_ahead: int) -> float:
        """Seconds a shed caller should wait: the time the store needs for what is ahead of it."""
        seconds = self.throughput.seconds_for(rows_ahead)
        if seconds is None:
            seconds = 0.1  # nothing measured yet: a short wait, the next answer says more
        return min(self.max_retry_after, max(self.min_retry_after, seconds))

    def refuse_on_arrival(self, rows: int, queued: int, in_store: int, remaining: float | None) -> str | None:
        """Why a push of ``rows`` arriving at a queue holding ``queued`` rows (``in_store`` more in the
        store) is shed at once, or None to queue it. ``remaining``: seconds to its caller's deadline."""
        if queued == 0 and in_store == 0:
            return None  # nothing ahead: it goes to the store now
        if queued > 0 and queued + rows > self.max_queue_rows:
            return QUEUE_FULL
        if remaining is not None:
            wait = self.throughput.seconds_for(queued + in_store + rows)
            if remaining <= 0 or (wait is not None and wait > remaining):
                return DEADLINE
        return None

    def too_late(self, group_rows: int, remaining: float | None, first: bool) -> bool:
        """Whether a push whose caller has ``remaining`` seconds left must stay out of a group that
        would hold ``group_rows`` rows with it (``first``: the group has nothing else yet)."""
        if remaining is None:
            return False
        if remaining <= 0:
            return True
        if first:
            return False  # keep the store busy and the estimate learning
        seconds = self.throughput.seconds_for(group_rows)
        return seconds is not None and seconds * self.safety > remaining

    def overloaded(self, reason: str, rows_ahead: int, namespace: str) -> OverloadedError:
        """The error a shed push is answered with."""
        retry_after = self.retry_after(rows_ahead)
        why = ("its push queue is full" if reason == QUEUE_FULL
               else "the push cannot reach the counts store before its deadline")
        return OverloadedError(f"the service is overloaded: namespace {namespace!r}: {why} ({rows_ahead} rows "
                               f"ahead); nothing was applied, retry the same batch in {retry_after * 1000:.0f} ms",
                               retry_after=retry_after)
