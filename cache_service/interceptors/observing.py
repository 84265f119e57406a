"""The end of every call, with its final status and duration: the base of the metrics and logging interceptors.

`ObservingInterceptor` wraps the handler of every kind of RPC and calls `finished` once per
call, when the handler ends (a stream: when its last message is sent or the call fails, so
the duration is the whole call's), with the status code the client receives:

- the handler returned: the code it set with ``context.set_code``, else OK;
- it aborted (``context.abort``, which the ErrorInterceptor does for every mapped
  exception): the code of the abort;
- it raised a library error or `ServiceError` (this interceptor sits inside the
  ErrorInterceptor): `status.status_of`'s code, the one the ErrorInterceptor will send;
- it was cancelled: DEADLINE_EXCEEDED when the deadline has passed, else CANCELLED.

Order: grpc.aio applies server interceptors in list order, the first outermost (its
handler wrapper calls the next one's). Put observing interceptors first, before the
ErrorInterceptor, so they see the status it sends, refusals of the auth interceptor (which
sits inside the ErrorInterceptor) included::

    aio.server(interceptors=[MetricsInterceptor(m), LoggingInterceptor(), ErrorInterceptor(), AuthInterceptor(...)])

A method no handler serves (UNIMPLEMENTED, answered by gRPC itself) is reported at once
with no context and a zero duration.

Nothing is read from the call itself after it ended: grpc's C layer frees the call when a
cancelled stream ends, and ``context.peer()`` then dereferences NULL (the process dies, exit
139), so the peer is read when the handler starts and carried in `FinishedCall.peer`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from ..status import REASON_KEY, status_of

log = logging.getLogger("ngramcache.service")


@dataclasses.dataclass(frozen=True)
class FinishedCall:
    """One ended call, as `ObservingInterceptor.finished` receives it."""

    method: str  # the full method name as the client sent it ("/ngramcache.v1.Drafting/Draft")
    code: grpc.StatusCode  # the final status
    seconds: float  # from the handler's start to its end (0 when no handler ran)
    handled: bool  # False when no handler ran (an unknown method)
    request: Any = None  # the request, or a stream's first one; only when `observe_requests`
    reason: str | None = None  # the ngc-error-reason of a failed call, if it has one
    peer: str | None = None  # the client's address, read when the call started (None: unknown)


def final_status(exc: BaseException | None, context: aio.ServicerContext) -> tuple[grpc.StatusCode, str | None]:
    """The status code and ``ngc-error-reason`` (None: none) a call whose handler ended with `exc`
    (None: returned) ends with (module docstring)."""
    if exc is None or type(exc).__module__.startswith("grpc"):  # returned, or aborted (grpc's AbortError)
        code = context.code()
        if not isinstance(code, grpc.StatusCode):
            code = grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
        reason = None
        if code != grpc.StatusCode.OK:
            reason = next((v for k, v in context.trailing_metadata() or () if k == REASON_KEY and isinstance(v, str)),
                          None)
        return code, reason
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED), None
    status = status_of(exc)
    return status.code, status.reason


class _FirstRequest:
    """A request stream that keeps its first message; otherwise the stream itself (same awaits, same cancellation)."""

    __slots__ = ("_it", "_requests", "first")

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests
        self._it: AsyncIterator[Any] | None = None  # taken at the first read: gRPC's receiver, once
        # taken, warns "never awaited" when a refused call never reads it
        self.first: Any = None

    def __aiter__(self) -> _FirstRequest:
        return self

    async def __anext__(self) -> Any:
        if self._it is None:
            self._it = self._requests.__aiter__()
        request = await self._it.__anext__()
        if self.first is None:
            self.first = request
        return request


class ObservingInterceptor(aio.ServerInterceptor):
    """Calls `finished` once at the end of every call (see module docstring).

    Subclasses implement `finished`, which runs on the server's event loop and must not
    block or raise; `observe_requests` makes `FinishedCall.request` available (a
    stream's first request is kept by wrapping the request iterator).
    """

    observe_requests = False

    @abc.abstractmethod
    def finished(self, call: FinishedCall) -> None:
        """Reports one finished call (the subclass's whole job)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None:
            try:
                self.finished(FinishedCall(method, grpc.StatusCode.UNIMPLEMENTED, 0.0, False))
            except Exception:
                log.exception("%s: observing an unknown method failed", type(self).__name__)
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, False), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method, True), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_streaming(handler.unary_stream, method, False), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_streaming(handler.stream_stream, method, True), handler.request_deserializer,
                handler.response_serializer)
        return handler

    def _wrap_streaming(self, fn: Callable[..., Any], method: str, streaming: bool) -> Callable[..., Any]:
        # A coroutine function writes its responses with context.write (grpc.aio's reader/writer
        # API, e.g. Health.Watch) and gRPC calls it as such only if the wrapper is one too.
        if inspect.iscoroutinefunction(fn):
            return self._wrap_unary(fn, method, streaming)
        return self._wrap_stream(fn, method, streaming)

    def _requests(self, request_or_iterator: Any, streaming: bool) -> tuple[Any, _FirstRequest | None]:
        if streaming and self.observe_requests:
            first = _FirstRequest(request_or_iterator)
            return first, first
        return request_or_iterator, None

    @staticmethod
    def _peer(context: aio.ServicerContext) -> str | None:
        """The client's address, read while the call is alive (never after: module docstring)."""
        try:
            peer = context.peer()
        except Exception:
            return None
        return peer if isinstance(peer, str) else None

    def _end(self, method: str, exc: BaseException | None, context: aio.ServicerContext, start: float,
             request: Any, first: _FirstRequest | None, peer: str | None) -> None:
        if first is not None:
            request = first.first
        elif not self.observe_requests:
            request = None
        try:
            code, reason = final_status(exc, context)
            self.finished(FinishedCall(method, code, time.perf_counter() - start, True, request, reason, peer))
        except Exception:  # an observer's bug must not change the call's outcome
            log.exception("%s: observing %s failed", type(self).__name__, method)

    def _wrap_unary(self, fn: Callable[..., Awaitable[Any]], method: str,
                    streaming: bool) -> Callable[..., Awaitable[Any]]:
        async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
            start = time.perf_counter()
            peer = self._peer(context)
            requests, first = self._requests(request_or_iterator, streaming)
            error: BaseException | None = None
            try:
                return await fn(requests, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._end(method, error, context, start, request_or_iterator, first, peer)

        return handler

    def _wrap_stream(self, fn: Callable[..., AsyncGenerator[Any, None]], method: str,
                     streaming: bool) -> Callable[..., AsyncIterator[Any]]:
        async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            peer = self._peer(context)
            requests, first = self._requests(request_or_iterator, streaming)
            error: BaseException | None = None
            try:
                # aclosing: when gRPC closes this generator (a cancelled call), the handler's own
                # finally blocks run now, not when the garbage collector finds it.
                async with contextlib.aclosing(fn(requests, context)) as responses:
                    async for response in responses:
                        yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._end(method, error, context, start, request_or_iterator, first, peer)

        return handler


__all__ = ["FinishedCall", "ObservingInterceptor", "final_status"]
