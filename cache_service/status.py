"""The one place where ngramcache errors become gRPC statuses (and the reason metadata).

Servicers and the domain code raise the library's exceptions (`ngramcache.client.kernel.errors`,
each with its row in the wire table `ngramcache.client.wire.rpc_errors.WIRE_ERRORS`) or
`ServiceError` for conditions that exist only on the wire (an evicted session); the error
interceptor calls `status_of` and aborts the call with the code, the message and the
trailing metadata entry ``ngc-error-reason`` (docs/protocol.md lists the codes and
reasons). Nothing else in the service picks a status code.
"""

from __future__ import annotations

import dataclasses
import math
import re

import grpc

from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    LimitExceededError,
    NgramCacheError,
    OverloadedError,
    StoreAuthenticationError,
)
from ngramcache.client.wire.rpc_errors import (  # the reasons, re-exported for the servicers
    BATCH_TOO_OLD,
    CACHE_FORMAT,
    CHECKSUM_MISMATCH,
    GENERATION_NOT_FOUND,
    GENERATION_NOT_NEWER,
    LEASE_HELD,
    LEASE_LOST,
    LIMIT,
    NAMESPACE_NOT_FOUND,
    OFFSET_OUT_OF_RANGE,
    OVERLOADED,
    REASON_KEY,
    RESYNC_REQUIRED,
    RETRY_AFTER_KEY,
    SESSION_EVICTED,
    TOKENIZER_MISMATCH,
    WIRE_ERRORS,
)

__all__ = ["BATCH_TOO_OLD", "CACHE_FORMAT", "CHECKSUM_MISMATCH", "GENERATION_NOT_FOUND", "GENERATION_NOT_NEWER",
           "LEASE_HELD", "LEASE_LOST", "LIMIT", "NAMESPACE_NOT_FOUND", "OFFSET_OUT_OF_RANGE", "OVERLOADED", "REASON_KEY",
           "RESYNC_REQUIRED", "RETRY_AFTER_KEY", "SESSION_EVICTED", "TOKENIZER_MISMATCH", "ServiceError", "Status",
           "limit_exceeded", "status_of", "store_outage_message"]


class ServiceError(NgramCacheError):
    """An error that exists only on the wire: it carries its gRPC code and reason itself.

    Raise it from a servicer or an interceptor for conditions the library has no exception
    for (an evicted session, a refused token); a condition the domain code can meet gets a
    library exception and a row in the wire table instead.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


def limit_exceeded(message: str) -> LimitExceededError:
    """A request over one of the server's limits (RESOURCE_EXHAUSTED, reason LIMIT, from the wire table)."""
    return LimitExceededError(message)


@dataclasses.dataclass(frozen=True)
class Status:
    """The status a call ends with."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None
    retry_after_ms: int | None = None  # OVERLOADED: how long the caller should wait before retrying

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        out: tuple[tuple[str, str], ...] = ((REASON_KEY, self.reason),) if self.reason else ()
        if self.retry_after_ms is not None:
            out += ((RETRY_AFTER_KEY, str(self.retry_after_ms)),)
        return out


# The wire error table, and before it the errors that exist only on this side. The store refused
# the service's own credentials: the service is misconfigured, and to its clients it is
# unavailable until an operator fixes it (it arrives as BackendUnavailableError).
_MAPPING: tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...] = (
    (StoreAuthenticationError, grpc.StatusCode.UNAVAILABLE, None),
    *WIRE_ERRORS,
)


MAX_MESSAGE = 1024
"""Longest status message sent: a message quoting a huge client-supplied value must not push the
trailers past gRPC's metadata limit (the call would end RESOURCE_EXHAUSTED instead)."""


def status_of(exc: BaseException) -> Status:
    """The status a call that raised `exc` ends with (its message cut to `MAX_MESSAGE` characters).

    Library errors map by class; `ServiceError` carries its own code; anything else is a
    bug and ends INTERNAL with its type and message (never a traceback on the wire).
    """
    status = _status_of(exc)
    if len(status.message) > MAX_MESSAGE:
        status = dataclasses.replace(status, message=status.message[:MAX_MESSAGE - 20] + "... (message cut)")
    return status


def _status_of(exc: BaseException) -> Status:
    if isinstance(exc, ServiceError):
        return Status(exc.code, str(exc), exc.reason)
    for cls, code, reason in _MAPPING:
        if isinstance(exc, cls):
            if isinstance(exc, OverloadedError):
                return Status(code, str(exc), reason, _milliseconds(exc.retry_after))
            if cls is BackendUnavailableError:
                return Status(code, store_outage_message(str(exc)), reason)
            return Status(code, str(exc), reason)
    if isinstance(exc, NgramCacheError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT if not exc.retriable else grpc.StatusCode.UNAVAILABLE, str(exc))
    return Status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _milliseconds(seconds: float | None) -> int | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    return max(0, math.ceil(seconds * 1000))


# What a store backend says when it cannot be reached ("<where> is unavailable: <RedisErrorName>: <detail>"),
# and the operator's words for the redis-py exception names in it.
_STORE_OUTAGE = re.compile(r"^(?P<where>\S+://\S*) is unavailable: (?:(?P<kind>[A-Za-z]+Error): )?(?P<detail>.*)$",
                           re.DOTALL)
_OUTAGE_KINDS = {
    "ConnectionError": "cannot connect",
    "TimeoutError": "no answer in time",
    "BusyLoadingError": "loading its data after a restart",
    "ClusterDownError": "the cluster is down",
    "MasterDownError": "its primary is down",
    "TryAgainError": "resharding",
    "ReadOnlyError": "read-only (a replica, or failing over)",
    "OutOfMemoryError": "out of memory",
}


def store_outage_message(message: str) -> str:
    """A store backend's unavailability, said as a counts store outage ("the counts store is
    unavailable (<where>: <what happened>)") rather than as a client library's exception name;
    other messages unchanged."""
    m = _STORE_OUTAGE.match(message)
    if m is None:
        return message
    kind = m.group("kind")
    what = _OUTAGE_KINDS.get(kind or "", "unavailable") if kind else ""
    detail = m.group("detail").strip()
    said = f"{what}: {detail}" if what and detail else (what or detail)
    return f"the counts store is unavailable ({m.group('where')}: {said})"
