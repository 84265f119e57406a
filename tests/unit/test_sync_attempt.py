"""Attempts: a batch given up is unconfirmed after an attempt with no definite answer, dropped otherwise."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ngramcache.client.kernel.tasks import cancel_until_done
from ngramcache.client.sync.attempt import Attempts


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


@pytest.mark.parametrize(("code", "uncertain"), [
    (grpc.StatusCode.DEADLINE_EXCEEDED, True), (grpc.StatusCode.CANCELLED, True), (grpc.StatusCode.UNKNOWN, True),
    (grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.INVALID_ARGUMENT, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False)])
def test_the_status_of_a_failed_attempt_decides(code: grpc.StatusCode, uncertain: bool) -> None:
    attempts = Attempts()

    async def fails() -> None:
        raise rpc_error(code)

    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(attempts.call(fails))
    assert attempts.given_up() is uncertain and not attempts.in_rpc
    assert attempts.outcome("stored") == ("unconfirmed (the service may have stored it)" if uncertain else "dropped")


def test_an_answered_attempt_leaves_the_batch_certain_and_an_earlier_doubt_stays() -> None:
    attempts = Attempts()

    async def answers() -> int:
        return 7

    async def times_out() -> int:
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)

    assert asyncio.run(attempts.call(answers)) == 7 and not attempts.given_up()
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(attempts.call(times_out))
    assert asyncio.run(attempts.call(answers)) == 7
    assert attempts.given_up()  # the attempt that timed out may have been applied


def test_a_sender_cancelled_with_a_call_in_flight_is_unconfirmed_and_one_cancelled_between_calls_is_not() -> None:
    async def body() -> tuple[bool, bool, bool]:
        attempts = Attempts()
        started = asyncio.Event()

        async def hangs() -> None:
            started.set()
            await asyncio.sleep(10)

        task = asyncio.create_task(attempts.call(hangs))
        await started.wait()
        in_flight = attempts.given_up(cancelled=True)  # what close sees while the call is on the wire
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        idle = Attempts()
        return in_flight, attempts.given_up(), idle.given_up(cancelled=True)

    assert asyncio.run(body()) == (True, True, False)


def test_a_cancellation_that_wait_for_swallowed_is_made_again() -> None:
    """Python 3.11's asyncio.wait_for returns its inner call's result when that call ends as the cancellation arrives,
    and the task runs on: `cancel_until_done` cancels it again (the fleet history mirror of a client closed under
    load ran on, and `NgramClient.close` waited 70 s)."""
    async def main() -> tuple[int, float]:
        pages: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
        reads = 0

        async def mirror() -> None:  # SyncState.forever's shape: a loop that only a cancellation ends
            nonlocal reads
            while True:
                inner = asyncio.get_running_loop().create_future()
                pages.put_nowait(inner)
                await asyncio.wait_for(inner, 60)
                reads += 1

        task = asyncio.create_task(mirror(), name="mirror")
        inner = await pages.get()
        inner.set_result(1)  # the page arrives ...
        started = time.monotonic()
        await cancel_until_done([task], again_after=0.2)  # ... as the cancellation does
        assert task.cancelled()
        return reads, time.monotonic() - started

    reads, took = asyncio.run(main())
    assert reads >= 1 and took < 5.0  # ran on after the first cancellation; the second ended it
