"""The dynamic counts store: (n-gram, follower) -> count per namespace, in Redis or embedded; open one with `open_counts_store`.

Modules, one concept each:

* `store`: the `CountsStore` interface and the rules every backend shares (dedup window,
  epoch clock, resync checks, error texts).
* `config`: `CountsStoreConfig` and the backend URL, parsed once.
* `namespace`: a namespace's record and the checks of its name, tokenizer and layout.
* `layout`: bucket hash, field codec, batches encoded by (shard, bucket).
* `embedded`: the in-process backend (optional snapshot file).
* `redis_backend`: standalone Redis or Redis Cluster, one Lua script per atomic unit.
* `schema`: the Redis key names.
* `factory`: `open_counts_store`, the only module that imports the backends.

The delta rows it takes are defined in `ngramcache.client.rows`; its errors in
`ngramcache.client.errors`.
"""

from ngramcache.client.errors import (
    BatchTooOldError,
    NamespaceNotFoundError,
    SnapshotFormatError,
    StoreAuthenticationError,
)

from .config import CountsStoreConfig, StoreAddress, parse_url, redact_url
from .embedded import EmbeddedCountsStore
from .factory import open_counts_store
from .layout import HASH_SEED, EncodedBatch, decode_fields, encode_batch, ngram_bucket
from .namespace import NamespaceInfo, normalize_fingerprint, token_width
from .redis_backend import RedisCountsStore
from .store import ApplyResult, ChangeSet, CountsStore, GroupItem, ItemOutcome, validate_client_id, validate_seq

__all__ = [
    "HASH_SEED",
    "ApplyResult",
    "BatchTooOldError",
    "ChangeSet",
    "CountsStore",
    "CountsStoreConfig",
    "EmbeddedCountsStore",
    "EncodedBatch",
    "GroupItem",
    "ItemOutcome",
    "NamespaceInfo",
    "NamespaceNotFoundError",
    "RedisCountsStore",
    "SnapshotFormatError",
    "StoreAddress",
    "StoreAuthenticationError",
    "decode_fields",
    "encode_batch",
    "ngram_bucket",
    "normalize_fingerprint",
    "open_counts_store",
    "parse_url",
    "redact_url",
    "token_width",
    "validate_client_id",
    "validate_seq",
]
