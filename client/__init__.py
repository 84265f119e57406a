"""ngramcache.client: the compiled drafting core, static caches and tools for inference workers."""

from importlib import metadata as _metadata

from ngramcache.client._core import CountTable, Drafter, StaticBuilder, StaticCache, build_static_from_tokens
from ngramcache.client._core import MAX_DRAFT, MAX_VOCAB, NGRAM_MAX, UNTAGGED, checksum64, ngram_hash
from ngramcache.client._core import export_llama, import_llama, load_llama_counts, replay
from ngramcache.client.errors import (
    BackendUnavailableError,
    CacheFormatError,
    InvalidArgumentError,
    NgramCacheError,
    ResyncRequiredError,
    TokenizerMismatchError,
)
from ngramcache.client.tokenizer import Tokenizer, load_tokenizer

try:
    __version__ = _metadata.version("ngramcache")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "MAX_DRAFT",
    "MAX_VOCAB",
    "NGRAM_MAX",
    "BackendUnavailableError",
    "CacheFormatError",
    "CountTable",
    "Drafter",
    "InvalidArgumentError",
    "NgramCacheError",
    "ResyncRequiredError",
    "StaticBuilder",
    "StaticCache",
    "Tokenizer",
    "TokenizerMismatchError",
    "UNTAGGED",
    "build_static_from_tokens",
    "checksum64",
    "export_llama",
    "import_llama",
    "load_llama_counts",
    "load_tokenizer",
    "ngram_hash",
    "replay",
]
