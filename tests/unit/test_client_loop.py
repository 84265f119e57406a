"""NgramClient's event loop hides grpc.aio's spurious poller errors (grpc issue #25364) and
only those: several clients in one process (one loop each) otherwise print tracebacks when
one of them closes."""

from __future__ import annotations

import asyncio

from ngramcache.client.sync.client import _quiet_grpc_poller


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
