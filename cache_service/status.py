"""The one place where ngramcache errors become gRPC statuses (and the reason metadata).

Servicers raise the library's exceptions (`ngramcache.client.errors`) or `ServiceError`
for conditions that exist only on the wire (a limit, an evicted session); the error
interceptor calls `status_of` and aborts the call with the code, the message and the
trailing metadata entry ``ngc-error-reason`` (docs/protocol.md lists the codes and
reasons). Nothing else in the service picks a status code.
"""

from __future__ import annotations

import dataclasses

import grpc

from ngramcache.client.errors import (
    BackendUnavailableError,
    BatchTooOldError,
    CacheFormatError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LeaseHeldError,
    LeaseLostError,
    NamespaceNotFoundError,
    NgramCacheError,
    ResyncRequiredError,
    StoreAuthenticationError,
    TokenizerMismatchError,
)

REASON_KEY = "ngc-error-reason"

# Reasons (docs/protocol.md): set where one code has several causes.
TOKENIZER_MISMATCH = "TOKENIZER_MISMATCH"
BATCH_TOO_OLD = "BATCH_TOO_OLD"
RESYNC_REQUIRED = "RESYNC_REQUIRED"
NAMESPACE_NOT_FOUND = "NAMESPACE_NOT_FOUND"
SESSION_EVICTED = "SESSION_EVICTED"
GENERATION_NOT_NEWER = "GENERATION_NOT_NEWER"
CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
CACHE_FORMAT = "CACHE_FORMAT"
LEASE_HELD = "LEASE_HELD"
LEASE_LOST = "LEASE_LOST"
LIMIT = "LIMIT"


class ServiceError(NgramCacheError):
    """An error that exists only on the wire: it carries its gRPC code and reason itself.

    Raise it from a servicer for conditions the library has no exception for (a server
    limit, an evicted session, a Publish of an older generation).
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


def limit_exceeded(message: str) -> ServiceError:
    """A request over one of the server's limits (RESOURCE_EXHAUSTED)."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, LIMIT)


@dataclasses.dataclass(frozen=True)
class Status:
    """The status a call ends with."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, self.reason),) if self.reason else ()


# Most specific first: subclasses before their bases.
_MAPPING: tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...] = (
    (NamespaceNotFoundError, grpc.StatusCode.NOT_FOUND, NAMESPACE_NOT_FOUND),
    (BatchTooOldError, grpc.StatusCode.INVALID_ARGUMENT, BATCH_TOO_OLD),
    (TokenizerMismatchError, grpc.StatusCode.FAILED_PRECONDITION, TOKENIZER_MISMATCH),
    (ResyncRequiredError, grpc.StatusCode.OUT_OF_RANGE, RESYNC_REQUIRED),
    (CacheFormatError, grpc.StatusCode.INVALID_ARGUMENT, CACHE_FORMAT),
    (GenerationNotNewerError, grpc.StatusCode.FAILED_PRECONDITION, GENERATION_NOT_NEWER),
    # A rebuild is running on another replica, or lost its lease midway: try again later.
    (LeaseHeldError, grpc.StatusCode.ABORTED, LEASE_HELD),
    (LeaseLostError, grpc.StatusCode.ABORTED, LEASE_LOST),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, None),
    # The store refused the service's own credentials: the service is misconfigured, and
    # to its clients it is unavailable until an operator fixes it.
    (StoreAuthenticationError, grpc.StatusCode.UNAVAILABLE, None),
    (BackendUnavailableError, grpc.StatusCode.UNAVAILABLE, None),
)


def status_of(exc: BaseException) -> Status:
    """The status a call that raised `exc` ends with.

    Library errors map by class; `ServiceError` carries its own code; anything else is a
    bug and ends INTERNAL with its type and message (never a traceback on the wire).
    """
    if isinstance(exc, ServiceError):
        return Status(exc.code, str(exc), exc.reason)
    for cls, code, reason in _MAPPING:
        if isinstance(exc, cls):
            return Status(code, str(exc), reason)
    if isinstance(exc, NgramCacheError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT if not exc.retriable else grpc.StatusCode.UNAVAILABLE, str(exc))
    return Status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
