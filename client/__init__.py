"""ngramcache client library: the compiled drafting core and static caches for inference workers."""

from client._core import CountTable, Drafter, StaticCache, build_static_from_tokens
from client.errors import (
    BackendUnavailableError,
    CacheFormatError,
    InvalidArgumentError,
    NgramCacheError,
    ResyncRequiredError,
    TokenizerMismatchError,
)

__all__ = [
    "BackendUnavailableError",
    "CacheFormatError",
    "CountTable",
    "Drafter",
    "InvalidArgumentError",
    "NgramCacheError",
    "ResyncRequiredError",
    "StaticCache",
    "TokenizerMismatchError",
    "build_static_from_tokens",
]
