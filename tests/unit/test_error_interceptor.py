"""The error interceptor's stream wrapper: a response stream that grpc closes because its call
ended (the client cancelled or went away) is let go, never aborted; real errors still are."""

from __future__ import annotations

import asyncio

import grpc

from ngramcache.cache_service.interceptors.errors import _wrap_stream
from ngramcache.client.kernel.errors import InvalidArgumentError


class Context:
    """What the wrapper uses of an aio.ServicerContext: abort (recorded)."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        self.aborted.append((code, details))
        raise RuntimeError("aborted")  # as grpc's abort does: the handler stops here


async def endless(request: object, context: object):
    n = 0
    while True:
        yield n
        n += 1


async def failing(request: object, context: object):
    yield 0
    raise InvalidArgumentError("bad step")


def test_a_stream_closed_by_its_ended_call_is_not_aborted():
    async def run() -> Context:
        context = Context()
        stream = _wrap_stream(endless, "/ngramcache.v1.Counts/Pull", False)(object(), context)
        assert await stream.__anext__() == 0
        await stream.aclose()  # what grpc does when the client cancels the call
        return context

    assert asyncio.run(run()).aborted == []


def test_an_error_in_the_stream_is_still_mapped_to_its_status():
    async def run() -> Context:
        context = Context()
        stream = _wrap_stream(failing, "/ngramcache.v1.Drafting/Session", False)(object(), context)
        assert await stream.__anext__() == 0
        try:
            await stream.__anext__()
        except RuntimeError:
            pass
        return context

    assert asyncio.run(run()).aborted == [(grpc.StatusCode.INVALID_ARGUMENT, "bad step")]
