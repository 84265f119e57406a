"""The wire error table: which library error travels as which gRPC status code and ``ngc-error-reason``.

Both sides derive their mapping from `WIRE_ERRORS`: the service's `status_of`
(cache_service/status.py) sends an exception's row, the client's `error_from_rpc`
(client/wire/transport.py) raises the row's class again, so every error in the table arrives as
itself. A row without a reason is its code's default; docs/protocol.md lists the codes and
reasons a client can see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    BatchTooOldError,
    CacheFormatError,
    ChecksumMismatchError,
    GenerationConflictError,
    GenerationNotFoundError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LeaseHeldError,
    LeaseLostError,
    LimitExceededError,
    NamespaceNotFoundError,
    NgramCacheError,
    OffsetOutOfRangeError,
    OverloadedError,
    ResyncRequiredError,
    TokenizerMismatchError,
)

__all__ = ["REASON_KEY", "RETRY_AFTER_KEY", "WIRE_ERRORS", "error_class_for", "retry_after_of"]

REASON_KEY = "ngc-error-reason"
RETRY_AFTER_KEY = "ngc-retry-after-ms"
"""Trailing metadata of an OVERLOADED call: whole milliseconds the service asks the caller to wait."""

# Reasons: set where one code has several causes.
TOKENIZER_MISMATCH = "TOKENIZER_MISMATCH"
BATCH_TOO_OLD = "BATCH_TOO_OLD"
RESYNC_REQUIRED = "RESYNC_REQUIRED"
NAMESPACE_NOT_FOUND = "NAMESPACE_NOT_FOUND"
GENERATION_NOT_FOUND = "GENERATION_NOT_FOUND"
OFFSET_OUT_OF_RANGE = "OFFSET_OUT_OF_RANGE"
SESSION_EVICTED = "SESSION_EVICTED"
GENERATION_NOT_NEWER = "GENERATION_NOT_NEWER"
CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
CACHE_FORMAT = "CACHE_FORMAT"
LEASE_HELD = "LEASE_HELD"
LEASE_LOST = "LEASE_LOST"
LIMIT = "LIMIT"
OVERLOADED = "OVERLOADED"

WIRE_ERRORS: tuple[tuple[type[NgramCacheError], grpc.StatusCode, str | None], ...] = (
    # (exception, code, reason), most specific first: a subclass before its base.
    (GenerationNotFoundError, grpc.StatusCode.NOT_FOUND, GENERATION_NOT_FOUND),
    (NamespaceNotFoundError, grpc.StatusCode.NOT_FOUND, NAMESPACE_NOT_FOUND),
    (BatchTooOldError, grpc.StatusCode.INVALID_ARGUMENT, BATCH_TOO_OLD),
    (TokenizerMismatchError, grpc.StatusCode.FAILED_PRECONDITION, TOKENIZER_MISMATCH),
    (OffsetOutOfRangeError, grpc.StatusCode.OUT_OF_RANGE, OFFSET_OUT_OF_RANGE),
    (ResyncRequiredError, grpc.StatusCode.OUT_OF_RANGE, RESYNC_REQUIRED),
    (CacheFormatError, grpc.StatusCode.INVALID_ARGUMENT, CACHE_FORMAT),
    (GenerationNotNewerError, grpc.StatusCode.FAILED_PRECONDITION, GENERATION_NOT_NEWER),
    # Static files: a Fetch resumed on another file; a Publish of a number taken by another file.
    (ChecksumMismatchError, grpc.StatusCode.FAILED_PRECONDITION, CHECKSUM_MISMATCH),
    (GenerationConflictError, grpc.StatusCode.ALREADY_EXISTS, CHECKSUM_MISMATCH),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED, LIMIT),
    # A rebuild is running on another replica, or lost its lease midway: try again later.
    (LeaseHeldError, grpc.StatusCode.ABORTED, LEASE_HELD),
    (LeaseLostError, grpc.StatusCode.ABORTED, LEASE_LOST),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, None),
    # The service shed the call (nothing applied): retry after ngc-retry-after-ms, sending less.
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED),
    (BackendUnavailableError, grpc.StatusCode.UNAVAILABLE, None),
)

# Codes no row names (or with a reason no row names): what the client raises for them.
_RETRIABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.ABORTED)
_CALLER_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
_BY_REASON: dict[tuple[grpc.StatusCode, str | None], type[NgramCacheError]] = {
    (code, reason): cls for cls, code, reason in WIRE_ERRORS if reason is not None}
_BY_CODE: dict[grpc.StatusCode, type[NgramCacheError]] = {code: cls for cls, code, reason in WIRE_ERRORS if reason is None}


def error_class_for(code: grpc.StatusCode | None, reason: str | None) -> type[NgramCacheError]:
    """The library error a call that ended with ``code`` and ``reason`` raises on the client.

    The table's row for (code, reason), else its code's default row; else UNAVAILABLE,
    DEADLINE_EXCEEDED, CANCELLED and ABORTED are `BackendUnavailableError` (retriable), the
    other codes a caller can fix (RESOURCE_EXHAUSTED, NOT_FOUND, ...) `InvalidArgumentError`,
    and the rest (UNAUTHENTICATED, PERMISSION_DENIED, INTERNAL, ...) `NgramCacheError`.
    """
    if code is None:
        return NgramCacheError
    if (code, reason) in _BY_REASON:
        return _BY_REASON[(code, reason)]
    if code == grpc.StatusCode.NOT_FOUND and reason is None:
        return NamespaceNotFoundError  # older services sent no reason with it
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return ResyncRequiredError  # likewise
    if code in _BY_CODE:
        return _BY_CODE[code]
    if code in _RETRIABLE_CODES:
        return BackendUnavailableError
    if code in _CALLER_CODES:
        return InvalidArgumentError
    return NgramCacheError


def retry_after_of(trailing_metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    """Seconds an OVERLOADED call's trailing metadata asks to wait (None: absent or not a number)."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return ms / 1000 if ms >= 0 else None
    return None
