"""Error interceptor: every exception a handler raises ends the call with its mapped status.

Handlers raise library errors (`ngramcache.client.kernel.errors`) or `status.ServiceError`; this
interceptor turns them into the gRPC status, message and ``ngc-error-reason`` trailing
metadata that `status.status_of` picks, for all four kinds of RPC. An unexpected exception
is logged with its traceback here (once) and ends INTERNAL. Aborts raised by the handler
itself (``context.abort``) and cancellations pass through untouched.

It also owns request decoding: a request whose bytes do not parse as its message type ends
INVALID_ARGUMENT naming the method (gRPC alone would answer UNKNOWN).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from ngramcache.client.kernel.errors import InvalidArgumentError

from ..status import status_of

log = logging.getLogger("ngramcache.service")


async def _abort(exc: BaseException, context: aio.ServicerContext, method: str) -> None:
    st = status_of(exc)
    if st.code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    await context.abort(st.code, st.message, st.trailing_metadata())


def _passes_through(exc: BaseException) -> bool:
    # context.abort raises an AbortError-like exception that grpc handles; cancellation too.
    # GeneratorExit is grpc closing a response stream whose call has ended (the client
    # cancelled or went away): the call is gone, so aborting it is wrong (grpc.aio crashed
    # on it, a NULL dereference in cygrpc, when a client dropped a Pull stream).
    return isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or type(exc).__module__.startswith("grpc")


class _Malformed:
    """What a request that does not parse decodes to: the handler turns it into INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # a DecodeError, whatever the protobuf runtime calls it
            return _Malformed(e)

    return decode


def _check(request: Any, method: str) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidArgumentError(f"the request to {method} is not a valid message: {request.error}")
    return request


async def _checked_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _check(request, method)


def _checked(request_or_iterator: Any, streaming_in: bool, method: str) -> Any:
    return _checked_stream(request_or_iterator, method) if streaming_in else _check(request_or_iterator, method)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, streaming_in: bool) -> Callable[..., Awaitable[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        try:
            return await fn(_checked(request_or_iterator, streaming_in, method), context)
        except BaseException as exc:
            if _passes_through(exc):
                raise
            await _abort(exc, context, method)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]], method: str,
                 streaming_in: bool) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in fn(_checked(request_or_iterator, streaming_in, method), context):
                yield response
        except BaseException as exc:
            if _passes_through(exc):
                raise
            await _abort(exc, context, method)

    return handler


class ErrorInterceptor(aio.ServerInterceptor):
    """Maps exceptions raised by any handler to statuses (see module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/ngramcache."):
            return handler  # health and reflection map their own errors (and write with context.write)
        decode, encode = _lenient(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method, False), decode, encode)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, method, True), decode, encode)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, method, False), decode, encode)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, method, True), decode, encode)
        return handler
