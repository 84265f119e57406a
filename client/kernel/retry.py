"""Retrying: the delay policies and the one retry loop (async, with a sync twin) that every caller uses.

A caller passes one attempt and what to do after a failure, and writes no loop of its own:
``wait(error, attempt)`` gets the error and how many failures came before it (0 for the
first), may log or count it, and returns the seconds to wait before the next attempt, or None to
give up (the error is raised). `Backoff` and `Schedule` say how long: ``policy.delay(attempt)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["Backoff", "Schedule", "retry", "retry_sync"]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

Errors = type[E] | tuple[type[E], ...]
Wait = Callable[[E, int], float | None]


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff: attempt k waits up to d = min(cap, base * 2**k) seconds, the fraction ``jitter`` of it random.

    ``jitter`` 1 (full jitter) waits uniform(0, d), so clients that failed together do not come
    back together; 0.5 waits d/2 + uniform(0, d/2); 0 waits d exactly.
    """

    base: float = 0.05
    cap: float = 2.0
    jitter: float = 1.0

    def delay(self, attempt: int) -> float:
        d = min(self.cap, self.base * (2 ** min(attempt, 30)))
        return d * (1.0 - self.jitter) + random.uniform(0.0, d * self.jitter)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Fixed delays: attempt k waits ``delays[k]``, and the last one for every attempt past the end."""

    delays: tuple[float, ...]

    def delay(self, attempt: int) -> float:
        return self.delays[min(attempt, len(self.delays) - 1)]


async def retry(call: Callable[[], Awaitable[T]], wait: Wait[E], *, errors: Errors[E], attempts: int | None = None,
                sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """Await ``call()`` until it returns, and return what it returned.

    Args:
        call: one attempt.
        wait: after each failure, ``wait(error, attempt)``: the seconds to wait before the next
            attempt, or None to give up. It may raise (its error then ends the retry).
        errors: the exceptions that count as a failure; any other propagates at once.
        attempts: the most attempts (None: no bound); ``wait`` still sees the last failure (to log
            it), then its error is raised.
        sleep: how to wait (one that a stop or a wake event ends early, say).

    Raises:
        The error of the failure ``wait`` gave up on, or of the last of ``attempts``.
    """
    attempt = 0
    while True:
        try:
            return await call()
        except errors as e:
            delay = _next(wait, e, attempt, attempts)
            if delay is None:
                raise
        attempt += 1
        await sleep(delay)


def retry_sync(call: Callable[[], T], wait: Wait[E], *, errors: Errors[E], attempts: int | None = None,
               sleep: Callable[[float], object] = time.sleep) -> T:
    """`retry` for a thread: ``call()`` and ``sleep`` block."""
    attempt = 0
    while True:
        try:
            return call()
        except errors as e:
            delay = _next(wait, e, attempt, attempts)
            if delay is None:
                raise
        attempt += 1
        sleep(delay)


def _next(wait: Wait[E], error: E, attempt: int, attempts: int | None) -> float | None:
    """The wait before the next attempt, or None to give up (``wait`` says so, or that was the last attempt)."""
    delay = wait(error, attempt)
    if attempts is not None and attempt + 1 >= attempts:
        return None
    return delay
