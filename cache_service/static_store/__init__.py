"""The static generation files of each namespace on disk: `StaticStore` publishes, lists, opens, watches, retains and drops them.

Modules, one concept each:

* `layout`: the data directory's layout (file names, sidecars), `GenerationInfo`,
  `PublishResult` and the argument checks.
* `index`: `GenerationIndex`, what is published as found on disk, each file mapped once
  per process and cached by file identity.
* `publish`: one complete file verified whole, then linked to its generation's name
  without clobbering, fsynced and indexed.
* `upload`: `Upload` (a file received chunk by chunk) and `GenerationReader` (a download).
* `watch`: the watchers' wake-up flags and the watch loop.
* `retention`: old generations pruned, a dropped namespace's folder, crash leftovers.
* `store`: `StaticStore`, the facade over the modules above.

It raises the library's errors (`ngramcache.client.kernel.errors`) and imports no grpc: the
service's `status.status_of` maps them to status codes through the wire error table.
"""

from .layout import (
    GENERATION_DIGITS,
    GenerationInfo,
    PublishResult,
    generation_file_name,
    generation_not_found,
    publish_refused,
)
from .store import StaticStore
from .upload import GenerationReader, Upload

__all__ = [
    "GENERATION_DIGITS",
    "GenerationInfo",
    "GenerationReader",
    "PublishResult",
    "StaticStore",
    "Upload",
    "generation_file_name",
    "generation_not_found",
    "publish_refused",
]
