"""Error interceptor: every exception a handler raises ends the call with its mapped status.

Handlers raise library errors (`ngramcache.client.errors`) or `status.ServiceError`; this
interceptor turns them into the gRPC status, message and ``ngc-error-reason`` trailing
metadata that `status.status_of` picks, for all four kinds of RPC. An unexpected exception
is logged with its traceback here (once) and ends INTERNAL. Aborts raised by the handler
itself (``context.abort``) and cancellations pass through untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from ..status import status_of

log = logging.getLogger("ngramcache.service")


async def _abort(exc: BaseException, context: aio.ServicerContext, method: str) -> None:
    st = status_of(exc)
    if st.code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    await context.abort(st.code, st.message, st.trailing_metadata())


def _passes_through(exc: BaseException) -> bool:
    # context.abort raises an AbortError-like exception that grpc handles; cancellation too.
    return isinstance(exc, asyncio.CancelledError) or type(exc).__module__.startswith("grpc")


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        try:
            return await fn(request_or_iterator, context)
        except BaseException as exc:
            if _passes_through(exc):
                raise
            await _abort(exc, context, method)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in fn(request_or_iterator, context):
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
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method), handler.request_deserializer, handler.response_serializer)
        return handler
