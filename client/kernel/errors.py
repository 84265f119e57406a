"""The error hierarchy of ngramcache: every error raised on purpose derives from NgramCacheError."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class NgramCacheError(Exception):
    """Base class of every ngramcache error.

    Attributes:
        retriable: True when the same call may succeed if retried later (a server was
            unreachable, a lock was held); False when retrying cannot help (bad input,
            a corrupt file, a tokenizer mismatch).
    """

    retriable: bool = False


class InvalidArgumentError(NgramCacheError, ValueError):
    """A caller passed a value outside its documented range (never retriable)."""


class TokenizerMismatchError(NgramCacheError, ValueError):
    """Data for one tokenizer was offered to a namespace or cache bound to another."""


class CacheFormatError(NgramCacheError, ValueError):
    """A static cache file is truncated, corrupt or not a static cache file at all."""


class BackendUnavailableError(NgramCacheError, ConnectionError):
    """A store or server could not be reached; the call may be retried."""

    retriable = True


class ServiceUnreachableError(BackendUnavailableError):
    """A service address did not answer, with the cause a probe found (`ngramcache.client.wire.diagnose`).

    Retriable unless the cause is one waiting cannot fix (TLS on one side only, a certificate
    the CA did not sign, a server that is not gRPC).

    Attributes:
        diagnosis: the `Diagnosis`: address, cause, the setting to change; ``diagnosis.message(names)``
            words it with other names for the settings (the CLI's flags).
    """

    def __init__(self, diagnosis: Any) -> None:
        super().__init__(diagnosis.message())
        self.diagnosis = diagnosis
        self.retriable = not diagnosis.permanent


class ConnectTimeoutError(BackendUnavailableError):
    """No address answered within the connect timeout; what a probe of each found, and the settings to change.

    Attributes:
        addresses: the addresses tried.
        timeout: the connect timeout, seconds.
        diagnoses: each address's `Diagnosis` (a probe that found nothing wrong is left out).
        detail: the last error, said when no probe found anything.
    """

    def __init__(self, addresses: Sequence[str], timeout: float, diagnoses: Sequence[Any], detail: str) -> None:
        self.addresses = tuple(addresses)
        self.timeout = timeout
        self.diagnoses = tuple(diagnoses)
        self.detail = detail
        super().__init__(self.message())

    def message(self, names: Mapping[str, str] | None = None) -> str:
        """One line, settings named as ``names`` says (default: the library's; ``connect_timeout`` included)."""
        timeout = (names or {}).get("connect_timeout", "connect_timeout")
        causes = "; ".join(d.message(names) for d in self.diagnoses) or self.detail
        return (f"no ngramcache service answered at {', '.join(self.addresses)} within {self.timeout:g} s "
                f"({timeout}): {causes}")


class OverloadedError(BackendUnavailableError):
    """The service shed the call to protect itself (its queue is full, or the call's deadline cannot be met).

    Nothing of the call was applied: send the same request again (a push keeps its
    (client_id, seq)) after ``retry_after`` seconds, and send less meanwhile. Retriable.

    Attributes:
        retry_after: seconds the service asks the caller to wait before retrying (None: not said).
    """

    retriable = True

    def __init__(self, message: str = "", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ResyncRequiredError(NgramCacheError):
    """The change history kept no longer reaches the version asked for; resync from a full export."""


class NamespaceNotFoundError(InvalidArgumentError):
    """The counts namespace does not exist (never created, dropped, or its state was lost).

    Not retriable: the same call fails until someone creates the namespace.
    """

    retriable = False


class BatchTooOldError(InvalidArgumentError):
    """A batch's seq fell out of the dedup window, so the store cannot tell whether it was applied.

    The unit it addressed was not applied. A sender that keeps at most ``dedup_window``
    batches unacknowledged never sees this error. Not retriable: the same seq stays too old.
    """

    retriable = False


class StoreAuthenticationError(BackendUnavailableError):
    """The counts store refused the credentials; retrying with the same ones cannot help."""

    retriable = False


class SnapshotFormatError(CacheFormatError):
    """An embedded counts store snapshot is truncated, corrupt, or not a snapshot at all (not retriable)."""

    retriable = False


class LeaseHeldError(NgramCacheError):
    """Another replica holds the namespace's rebuild lease (a rebuild is running there); retry later."""

    retriable = True


class LeaseLostError(NgramCacheError):
    """A rebuild lease expired or was taken over: what it protected was not published (retry the rebuild)."""

    retriable = True


class GenerationNotNewerError(NgramCacheError):
    """A generation at or below the namespace's newest committed or published one (not retriable)."""


class GenerationNotFoundError(NamespaceNotFoundError):
    """The static generation asked for is not (or no longer) published in the namespace (not retriable).

    A `NamespaceNotFoundError` because that is what it arrived as before it had a reason of its own:
    a caller that catches the namespace's absence still catches a namespace with no generation.
    """

    retriable = False


class ChecksumMismatchError(InvalidArgumentError):
    """A download resumed on a file other than the one expected (another SHA-256): fetch it again from offset 0."""

    retriable = False


class OffsetOutOfRangeError(ResyncRequiredError):
    """A download asked for an offset past the end of the file: fetch it again from offset 0 (not retriable as is).

    A `ResyncRequiredError` because that is what it arrived as before it had a reason of its own.
    """

    retriable = False


class GenerationConflictError(NgramCacheError):
    """The generation number is already published with other content (another SHA-256); it is never replaced."""

    retriable = False


class LimitExceededError(InvalidArgumentError):
    """A request went over one of the service's limits (a size, a count, the disk space left); not retriable as is."""

    retriable = False
