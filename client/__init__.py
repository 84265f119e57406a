"""ngramcache.client: the compiled drafting core, static caches and tools for inference workers."""

from importlib import metadata as _metadata

from ngramcache.client._core import (
    MAX_DRAFT,
    MAX_VOCAB,
    NGRAM_MAX,
    UNTAGGED,
    CountTable,
    Drafter,
    StaticBuilder,
    StaticCache,
    checksum64,
    export_llama,
    import_llama,
    load_llama_counts,
    ngram_hash,
    replay,
)
from ngramcache.client.adapters.draft_length import DraftLengthPolicy, VerifyCost
from ngramcache.client.admin import AdminClient
from ngramcache.client.build import BuildResult, IndexBudgetWarning, build_static_from_tokens
from ngramcache.client.errors import (
    BackendUnavailableError,
    BatchTooOldError,
    CacheFormatError,
    ChecksumMismatchError,
    ConnectTimeoutError,
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
    ServiceUnreachableError,
    SnapshotFormatError,
    StoreAuthenticationError,
    TokenizerMismatchError,
)
from ngramcache.client.remote import RemoteDrafter
from ngramcache.client.sync import ClientConfig, NgramClient
from ngramcache.client.tokenizer import Tokenizer, load_tokenizer

try:
    __version__ = _metadata.version("ngramcache")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "MAX_DRAFT",
    "MAX_VOCAB",
    "NGRAM_MAX",
    "UNTAGGED",
    "AdminClient",
    "BackendUnavailableError",
    "BatchTooOldError",
    "BuildResult",
    "CacheFormatError",
    "ChecksumMismatchError",
    "ClientConfig",
    "ConnectTimeoutError",
    "CountTable",
    "DraftLengthPolicy",
    "Drafter",
    "GenerationConflictError",
    "GenerationNotFoundError",
    "GenerationNotNewerError",
    "IndexBudgetWarning",
    "InvalidArgumentError",
    "LeaseHeldError",
    "LeaseLostError",
    "LimitExceededError",
    "NamespaceNotFoundError",
    "NgramCacheError",
    "NgramClient",
    "OffsetOutOfRangeError",
    "OverloadedError",
    "RemoteDrafter",
    "ResyncRequiredError",
    "ServiceUnreachableError",
    "SnapshotFormatError",
    "StaticBuilder",
    "StaticCache",
    "StoreAuthenticationError",
    "Tokenizer",
    "TokenizerMismatchError",
    "VerifyCost",
    "build_static_from_tokens",
    "checksum64",
    "export_llama",
    "import_llama",
    "load_llama_counts",
    "load_tokenizer",
    "ngram_hash",
    "replay",
]
