"""The retry module: Backoff and Schedule delays, and the retry loop (async and sync) with its give-up rules; no real waiting."""

from __future__ import annotations

import asyncio
import random

import pytest

import ngramcache.client.sync
import ngramcache.client.wire.transport
from ngramcache.client.kernel.retry import Backoff, Schedule, retry, retry_sync


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"; counts its calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"

    async def coro(self) -> str:
        return self()


class Waits:
    """A ``wait`` that records (error, attempt) and answers from ``delays`` (None: give up)."""

    def __init__(self, *delays: float | None) -> None:
        self.delays = list(delays)
        self.seen: list[tuple[BaseException, int]] = []

    def __call__(self, e: BaseException, attempt: int) -> float | None:
        self.seen.append((e, attempt))
        return self.delays.pop(0)


async def _record(slept: list[float], seconds: float) -> None:
    slept.append(seconds)


def run_async(flaky: Flaky, waits: Waits, **options: object) -> tuple[str, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    got = asyncio.run(retry(flaky.coro, waits, sleep=sleep, **options))  # type: ignore[arg-type]
    return got, slept


def test_backoff_full_jitter_stays_under_the_exponential_cap() -> None:
    random.seed(7)
    b = Backoff(base=0.1, cap=1.0)
    for k in range(40):
        assert 0.0 <= b.delay(k) <= min(1.0, 0.1 * 2**k)
    assert len({b.delay(3) for _ in range(20)}) > 1  # jittered


def test_backoff_without_jitter_doubles_up_to_the_cap() -> None:
    b = Backoff(base=0.1, cap=0.8, jitter=0.0)
    assert [b.delay(k) for k in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8, 0.8])
    assert Backoff(base=1.0, cap=5.0, jitter=0.0).delay(10**6) == 5.0  # a huge attempt does not overflow


def test_backoff_half_jitter_waits_at_least_half() -> None:
    random.seed(1)
    b = Backoff(base=0.5, cap=4.0, jitter=0.5)
    for k in range(8):
        d = min(4.0, 0.5 * 2**k)
        assert d / 2 <= b.delay(k) <= d


def test_schedule_repeats_its_last_delay() -> None:
    s = Schedule((1.0, 2.0, 5.0, 10.0, 30.0))
    assert [s.delay(k) for k in range(7)] == [1.0, 2.0, 5.0, 10.0, 30.0, 30.0, 30.0]


def test_backoff_is_one_class_under_its_public_names() -> None:
    assert ngramcache.client.wire.transport.Backoff is Backoff
    assert ngramcache.client.sync.Backoff is Backoff


def test_retry_returns_after_failures_waiting_what_wait_says() -> None:
    a, b = ValueError("a"), ValueError("b")
    flaky, waits = Flaky(a, b), Waits(0.25, 0.5)
    got, slept = run_async(flaky, waits, errors=ValueError)
    assert got == "ok" and flaky.calls == 3
    assert waits.seen == [(a, 0), (b, 1)]  # the error and the failures before it
    assert slept == [0.25, 0.5]


def test_retry_gives_up_when_wait_says_none_raising_that_error() -> None:
    a, b = ValueError("a"), ValueError("b")
    flaky, waits = Flaky(a, b), Waits(0.0, None)
    with pytest.raises(ValueError) as caught:
        run_async(flaky, waits, errors=ValueError)
    assert caught.value is b and flaky.calls == 2


def test_retry_stops_after_attempts_and_still_tells_wait_of_the_last_failure() -> None:
    errors = [KeyError(i) for i in range(5)]
    flaky, waits = Flaky(*errors), Waits(0.0, 0.0, 0.0)
    slept: list[float] = []
    with pytest.raises(KeyError) as caught:
        asyncio.run(retry(flaky.coro, waits, errors=KeyError, attempts=3, sleep=lambda s: _record(slept, s)))
    assert caught.value is errors[2] and flaky.calls == 3
    assert [attempt for _, attempt in waits.seen] == [0, 1, 2]  # the last one too (a caller logs it)
    assert slept == [0.0, 0.0]


def test_retry_lets_other_errors_through_at_once() -> None:
    flaky, waits = Flaky(TypeError("bug")), Waits()
    with pytest.raises(TypeError):
        run_async(flaky, waits, errors=ValueError)
    assert flaky.calls == 1 and waits.seen == []


def test_an_error_wait_raises_ends_the_retry() -> None:
    def wait(e: BaseException, attempt: int) -> float:
        raise RuntimeError(f"translated {e}")

    with pytest.raises(RuntimeError, match="translated a"):
        asyncio.run(retry(Flaky(ValueError("a")).coro, wait, errors=ValueError))


def test_retry_may_take_cancellation_as_a_failure() -> None:
    flaky, waits = Flaky(asyncio.CancelledError()), Waits(0.0)
    got, _ = run_async(flaky, waits, errors=(ValueError, asyncio.CancelledError))
    assert got == "ok" and isinstance(waits.seen[0][0], asyncio.CancelledError)


def test_retry_waits_with_the_real_sleep_by_default() -> None:
    flaky, waits = Flaky(ValueError()), Waits(0.001)
    assert asyncio.run(retry(flaky.coro, waits, errors=ValueError)) == "ok"


def test_retry_sync_is_the_same_loop() -> None:
    a, b = OSError("a"), OSError("b")
    flaky, waits = Flaky(a, b, OSError("c")), Waits(0.1, 0.2, 0.3)
    slept: list[float] = []
    assert retry_sync(flaky, waits, errors=OSError, sleep=slept.append) == "ok"
    assert slept == [0.1, 0.2, 0.3] and [attempt for _, attempt in waits.seen] == [0, 1, 2]

    flaky, waits = Flaky(a, b), Waits(0.0, 0.0)
    with pytest.raises(OSError) as caught:
        retry_sync(flaky, waits, errors=OSError, attempts=2, sleep=slept.append)
    assert caught.value is b and flaky.calls == 2
