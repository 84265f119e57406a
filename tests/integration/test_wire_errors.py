"""The wire error table: every row goes out through the service's status_of and comes back through the client's error_from_rpc as itself, over a real gRPC call."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from ngramcache.cache_service.interceptors.errors import ErrorInterceptor
from ngramcache.cache_service.status import SESSION_EVICTED, ServiceError, limit_exceeded, status_of
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    ChecksumMismatchError,
    GenerationConflictError,
    GenerationNotFoundError,
    InvalidArgumentError,
    LimitExceededError,
    NamespaceNotFoundError,
    NgramCacheError,
    OffsetOutOfRangeError,
    ResyncRequiredError,
    StoreAuthenticationError,
)
from ngramcache.client.wire.rpc_errors import WIRE_ERRORS, error_class_for
from ngramcache.client.wire.transport import error_from_rpc

RAISES: list[BaseException] = []


def _handler(request: bytes, context: aio.ServicerContext) -> bytes:
    raise RAISES[0]


async def _roundtrip(exc: BaseException) -> NgramCacheError:
    RAISES[:] = [exc]
    server = aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "ngramcache.test.T", {"M": grpc.unary_unary_rpc_method_handler(_async(_handler))})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                await ch.unary_unary("/ngramcache.test.T/M")(b"", timeout=10)
            except grpc.RpcError as e:
                return error_from_rpc(e)
        raise AssertionError("the call succeeded")
    finally:
        await server.stop(None)


def _async(fn):  # type: ignore[no-untyped-def]
    async def handler(request, context):  # type: ignore[no-untyped-def]
        return fn(request, context)

    return handler


@pytest.mark.parametrize("cls, code, reason", WIRE_ERRORS, ids=[row[0].__name__ for row in WIRE_ERRORS])
def test_every_row_arrives_as_itself(cls, code, reason):
    status = status_of(cls("boom"))
    assert (status.code, status.reason) == (code, reason)
    got = asyncio.run(_roundtrip(cls("boom")))
    assert type(got) is cls and got.code == code and got.reason == reason and "boom" in str(got)
    assert got.retriable == cls.retriable
    assert error_class_for(code, reason) is cls


def test_rows_are_most_specific_first():
    for i, (cls, _, _) in enumerate(WIRE_ERRORS):
        for later, _, _ in WIRE_ERRORS[i + 1:]:
            assert not issubclass(later, cls) or later is cls, f"{later.__name__} is shadowed by {cls.__name__}"


def test_errors_only_of_the_service_side_and_codes_without_a_row():
    got = asyncio.run(_roundtrip(StoreAuthenticationError("wrong password")))
    assert type(got) is BackendUnavailableError and got.retriable
    got = asyncio.run(_roundtrip(ServiceError(grpc.StatusCode.ABORTED, "idle", SESSION_EVICTED)))
    assert type(got) is BackendUnavailableError and got.retriable and got.reason == SESSION_EVICTED
    got = asyncio.run(_roundtrip(limit_exceeded("over the limit")))  # a server limit has its row now
    assert type(got) is LimitExceededError and isinstance(got, InvalidArgumentError) and got.reason == "LIMIT"
    got = asyncio.run(_roundtrip(RuntimeError("a bug")))
    assert type(got) is NgramCacheError and got.code == grpc.StatusCode.INTERNAL
    assert error_class_for(grpc.StatusCode.DEADLINE_EXCEEDED, None) is BackendUnavailableError
    assert error_class_for(grpc.StatusCode.PERMISSION_DENIED, None) is NgramCacheError


# The static store's errors, and what each arrived as before it had a row of its own: the code on
# the wire is the same, and a caller's `except` of the old class still catches the new one.
STATIC_STORE_ROWS = [
    (GenerationNotFoundError, grpc.StatusCode.NOT_FOUND, NamespaceNotFoundError),
    (OffsetOutOfRangeError, grpc.StatusCode.OUT_OF_RANGE, ResyncRequiredError),
    (ChecksumMismatchError, grpc.StatusCode.FAILED_PRECONDITION, InvalidArgumentError),
    (GenerationConflictError, grpc.StatusCode.ALREADY_EXISTS, NgramCacheError),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED, InvalidArgumentError),
]


@pytest.mark.parametrize("cls, code, before", STATIC_STORE_ROWS, ids=[row[0].__name__ for row in STATIC_STORE_ROWS])
def test_static_store_errors_arrive_as_themselves_and_still_as_what_they_were(cls, code, before):
    assert any(row[:2] == (cls, code) for row in WIRE_ERRORS)
    got = asyncio.run(_roundtrip(cls("boom")))
    assert type(got) is cls and got.code == code and isinstance(got, before)
    assert not got.retriable and got.retriable == before.retriable
    assert error_class_for(code, None) is before  # the same code without a reason (an older service)
