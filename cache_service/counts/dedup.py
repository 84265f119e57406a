"""The exactly-once rule: `DedupWindow`, the seqs one client applied within the dedup window of its highest.

A batch is identified by (client_id, seq). A store keeps, per client, the seqs applied
within ``dedup_window`` of its highest; a seq that far behind is refused with
`BatchTooOldError`, since whether it was applied can no longer be told. The embedded
store keeps a `DedupWindow` per client; the Redis backend's APPLY script runs the same rule
on a sorted set, atomically with the writes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ngramcache.client.kernel.errors import BatchTooOldError

__all__ = ["DedupWindow", "batch_too_old"]


def batch_too_old(seq: int, hwm: int, window: int) -> BatchTooOldError:
    return BatchTooOldError(
        f"batch seq {seq} is older than the dedup window ({window}) behind seq {hwm}: "
        "whether it was applied is unknown, so it was not applied")


class DedupWindow:
    """The seqs one client applied within ``window`` of its highest: the exactly-once record of a namespace.

    The Redis backend's APPLY script applies the same rule to a sorted set. Not
    thread-safe: the caller holds its store's lock.
    """

    __slots__ = ("hwm", "seqs", "touched", "window")

    def __init__(self, window: int, seqs: Iterable[int] = ()) -> None:
        self.window = window
        self.seqs = set(seqs)
        self.hwm = max(self.seqs, default=-1)  # the highest seq applied
        self.touched = time.monotonic()  # last use, for dedup_ttl_seconds

    def seen(self, seq: int) -> bool:
        """Whether ``seq`` was applied already.

        Raises:
            BatchTooOldError: ``seq`` is ``window`` or more behind the highest seq applied.
        """
        self.touched = time.monotonic()
        if seq <= self.hwm - self.window:
            raise batch_too_old(seq, self.hwm, self.window)
        return seq in self.seqs

    def record(self, seq: int) -> None:
        """Mark ``seq`` applied and forget the seqs that fell out of the window."""
        self.seqs.add(seq)
        self.hwm = max(self.hwm, seq)
        if len(self.seqs) > self.window:
            self.seqs = {s for s in self.seqs if s > self.hwm - self.window}

