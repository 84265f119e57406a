"""NgramClient's event loop hides grpc.aio's spurious poller errors (grpc issue #25364) and
only those: several clients in one process (one loop each) otherwise print tracebacks when
one of them closes; and it closes with no task left pending."""

from __future__ import annotations

import asyncio
import gc

from ngramcache.client.sync.client import _cancel_leftover_tasks, _quiet_grpc_poller


class Handle:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Handle {self.name}(<_UnixSelectorEventLoop running=True closed=False debug=False>)()>"


def test_only_the_pollers_blocking_and_closed_loop_errors_are_hidden():
    loop = asyncio.new_event_loop()
    seen = []
    loop.default_exception_handler = seen.append  # type: ignore[method-assign]
    try:
        poller = Handle("PollerCompletionQueue._handle_events")
        _quiet_grpc_poller(loop, {"exception": BlockingIOError(11, "try again"), "handle": poller})
        _quiet_grpc_poller(loop, {"exception": RuntimeError("Event loop is closed"), "handle": poller})
        assert seen == []
        others = [
            {"exception": RuntimeError("something else"), "handle": poller},
            {"exception": BlockingIOError(11, "try again"), "handle": Handle("MyProtocol.data_received")},
            {"message": "Task exception was never retrieved"},
        ]
        for context in others:
            _quiet_grpc_poller(loop, context)
        assert seen == others
    finally:
        loop.close()


def pending_task_destroyed(cancel_first: bool) -> list[str]:
    """What the loop's exception handler hears when a loop with a task still waiting (as grpc.aio's task that awaits
    a cancelled stream's status can be when the client's work ends) is closed."""
    loop = asyncio.new_event_loop()
    heard: list[str] = []
    loop.set_exception_handler(lambda _loop, context: heard.append(context.get("message", "")))
    async def status(never: asyncio.Future[None]) -> None:
        await never

    task = loop.create_task(status(loop.create_future()))
    loop.run_until_complete(asyncio.sleep(0))
    if cancel_first:
        _cancel_leftover_tasks(loop)
        assert task.cancelled()
    loop.close()
    del task
    gc.collect()
    return heard


def test_a_task_left_pending_is_cancelled_before_the_loop_closes():
    assert pending_task_destroyed(cancel_first=False) == ["Task was destroyed but it is pending!"]  # the symptom
    assert pending_task_destroyed(cancel_first=True) == []
