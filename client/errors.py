"""The error hierarchy of ngramcache: every error raised on purpose derives from NgramCacheError."""

from __future__ import annotations


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


class ResyncRequiredError(NgramCacheError):
    """The change history kept no longer reaches the version asked for; resync from a full export."""
