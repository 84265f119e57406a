"""The dynamic counts store: (n-gram, follower) -> count per namespace, in Redis or embedded; open one with `open_counts_store`.

Modules, one concept each:

* `store`: the `CountsStore` interface and the logic every backend shares (argument
  checks, namespace creation, groups and their one redo loop, the lease methods).
* `group`: a group of batches checked against its namespace and queued as units, wave after wave.
* `values`: what its calls take and answer (batch identity, group items, results, change sets).
* `history`: the fleet history's records, budgets, pages, cursors and near-duplicate rule
  (`CountsStore.append_history` / `read_history`; Redis: `redis_history`).
* `dedup`: the exactly-once rule, a dedup window of seqs per client.
* `versions`: the epoch clock that hands out versions, and the resync checks.
* `leases`: rebuild leases and committed generations (and the in-process lease table).
* `export`: the consistent export a mirror starts from (version, export, instance check).
* `config`: `CountsStoreConfig` and the backend URL, parsed once.
* `namespace`: a namespace's record, the checks of its name, tokenizer and layout, its errors.
* `layout`: bucket hash, field codec, batches encoded by (shard, bucket).
* `embedded`: the in-process backend (optional snapshot file).
* `redis_backend`: `RedisCountsStore`, standalone Redis, Redis Cluster or Sentinel, built from
  `redis_connection` (client, retries, error translation, writes acknowledged once
  replicas hold them: WAIT), `redis_scripts` (one Lua script per atomic unit), `redis_handles` (namespace records and key names),
  `redis_writes` (a unit as an APPLY call), `redis_reads` and `redis_leases`.
* `schema`: the Redis key names.
* `factory`: `open_counts_store`, the only module that imports the backends.

The delta rows it takes are defined in `ngramcache.client.kernel.rows`; its errors in
`ngramcache.client.kernel.errors`.
"""

from ngramcache.client.kernel.errors import (
    BatchTooOldError,
    NamespaceNotFoundError,
    SnapshotFormatError,
    StoreAuthenticationError,
)

from .config import CountsStoreConfig, StoreAddress, parse_url, redact_url
from .embedded import EmbeddedCountsStore
from .factory import open_counts_store
from .history import MAX_BATCH_RECORDS, MAX_RECORD_TOKENS, HistoryAppend, HistoryBudget, HistoryPage, HistoryRecord
from .layout import HASH_SEED, EncodedBatch, decode_fields, encode_batch, ngram_bucket
from .namespace import NamespaceRecord, normalize_fingerprint, token_width
from .redis_backend import RedisCountsStore
from .store import ApplyResult, ChangeSet, CountsStore, GroupItem, ItemOutcome, validate_client_id, validate_seq

__all__ = [
    "HASH_SEED",
    "MAX_BATCH_RECORDS",
    "MAX_RECORD_TOKENS",
    "ApplyResult",
    "BatchTooOldError",
    "ChangeSet",
    "CountsStore",
    "CountsStoreConfig",
    "EmbeddedCountsStore",
    "EncodedBatch",
    "GroupItem",
    "HistoryAppend",
    "HistoryBudget",
    "HistoryPage",
    "HistoryRecord",
    "ItemOutcome",
    "NamespaceNotFoundError",
    "NamespaceRecord",
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
