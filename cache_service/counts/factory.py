"""`open_counts_store`: the backend chosen by the config's URL (the one module that imports every backend)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import CountsStoreConfig
from .embedded import EmbeddedCountsStore
from .redis_backend import RedisCountsStore
from .store import CountsStore

__all__ = ["open_counts_store"]


def open_counts_store(url_or_config: str | CountsStoreConfig | None = None, **options: Any) -> CountsStore:
    """Open the backend named by a URL (see `config`) or a `CountsStoreConfig`.

    Args:
        url_or_config: None/"" (embedded in memory), ``embedded://PATH``, ``redis://...``,
            ``rediss://...``, ``redis+cluster://h:p[,h:p]``, or a config.
        **options: `CountsStoreConfig` fields, overriding the URL's query options.

    Raises:
        InvalidArgumentError: a malformed URL or option.
        BackendUnavailableError: Redis could not be reached.
        StoreAuthenticationError: Redis refused the credentials.
        SnapshotFormatError: the embedded store's snapshot file is damaged.
    """
    if isinstance(url_or_config, CountsStoreConfig):
        config = dataclasses.replace(url_or_config, **options) if options else url_or_config
    else:
        config = CountsStoreConfig.from_url(url_or_config, **options)
    if config.address.kind == "embedded":
        return EmbeddedCountsStore(config)
    return RedisCountsStore(config)
