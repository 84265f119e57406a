"""Versions: the `EpochClock` that hands them out and the checks of a version a reader asks changes since.

A version is the time in milliseconds at which an epoch opened, bumped by at least one.
`EpochClock` advances it at most once per ``epoch_seconds`` and keeps ``history_epochs``
epochs; its oldest is the floor (the Redis backend's TICK script mirrors it). A fresh
history (a new namespace, an embedded store reloaded from its snapshot) therefore starts
above every version handed out before it, and `check_version` answers an old version with
`ResyncRequiredError` instead of a silently wrong mirror.
"""

from __future__ import annotations

import collections
import time

from ngramcache.client.kernel.errors import ResyncRequiredError

__all__ = ["EpochClock", "check_version", "history_lost", "now_ms"]


def check_version(namespace: str, since: int, floor: int, cur: int) -> None:
    """Raise ResyncRequiredError unless ``floor <= since <= cur`` (the history kept)."""
    if since < floor or since > cur:
        raise ResyncRequiredError(
            f"version {since} of namespace {namespace!r} is outside the history kept "
            f"[{floor}, {cur}]; resync from version() + export()")


def history_lost(namespace: str, since: int) -> ResyncRequiredError:
    """A shard trimmed the history ``since`` needs after the clock said it was kept."""
    return ResyncRequiredError(f"version {since} of namespace {namespace!r} fell out of the history kept; resync")


def now_ms() -> int:
    """Wall-clock time in milliseconds (the unit of versions)."""
    return time.time_ns() // 1_000_000


class EpochClock:
    """The versions of one namespace: the current one and the epochs kept (newest first).

    The Redis backend's TICK script applies the same rule to the namespace's clock and
    epochs keys. Not thread-safe: the caller holds its store's lock.
    """

    __slots__ = ("cur", "epochs", "opened_ms")

    def __init__(self, start_ms: int) -> None:
        self.cur = start_ms  # the newest version
        self.opened_ms = start_ms  # when the current epoch opened
        self.epochs: collections.deque[int] = collections.deque([start_ms])

    @property
    def floor(self) -> int:
        """The oldest version `changes_since` still serves."""
        return self.epochs[-1]

    def tick(self, now: int, epoch_ms: int, history_epochs: int) -> bool:
        """Open a new epoch if the current one is at least ``epoch_ms`` old; return whether it did."""
        if not (now > self.opened_ms and now - self.opened_ms >= epoch_ms):
            return False
        self.cur, self.opened_ms = max(self.cur + 1, now), now
        self.epochs.appendleft(self.cur)
        while len(self.epochs) > history_epochs + 1:
            self.epochs.pop()
        return True

