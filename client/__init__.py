"""ngramcache.client: the compiled drafting core, static caches and tools for inference workers."""

from ngramcache.client import _moved
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
from ngramcache.client.kernel.build import BuildResult, IndexBudgetWarning, build_static_from_tokens
from ngramcache.client.kernel.errors import (
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
from ngramcache.client.kernel.tokenizer import Tokenizer, load_tokenizer
from ngramcache.client.kernel.version import __version__ as __version__
from ngramcache.client.sync import ClientConfig, NgramClient
from ngramcache.client.sync.admin import AdminClient
from ngramcache.client.sync.remote import RemoteDrafter

_moved.install()  # the old paths of modules that moved into kernel/, wire/, sync/ and tools/ (deprecated)


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
