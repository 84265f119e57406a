"""FleetCounts: the fleet's shared counts as real clients get them, simulated: deltas pushed, folded into the service's draft view, mirrored into every replica's dynamic table.

The real path (client/sync: pusher and mirror; cache_service: namespaces and draft_view): each
client drains its drafter's accepted n-gram counts every `push_interval` and pushes them; the
service adds them to the store, and every `mirror_interval` folds what changed into the
namespace's `DraftView` (a key enters once its total reaches the view's minimums, 4, 3, 2, 2 for
1- to 4-grams by default; a published count moves when it changed by more than 25%); each client
pulls the view's changes every `pull_interval` into its drafter's dynamic table, which the match
mode's count walk reads. A client's own counts come back to it the same way (its context table
is per sequence). Here the same objects do the same work on simulated time: the drafters'
`drain_deltas`, a `CountTable` for the store, the service's own `DraftView` class and its
`changes_since` log; only the network is left out. The intervals default to the client's and the
service's defaults; each replica pushes and pulls at its own phase (clients start at different
times).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ngramcache.cache_service.config import ServiceConfig
from ngramcache.cache_service.draft_view import DraftView, ViewPolicy
from ngramcache.client import CountTable
from ngramcache.client.sync.config import ClientConfig


def _default(cls: Any, name: str) -> float:
    return float(cls.__dataclass_fields__[name].default) * 1000.0


PUSH_MS = _default(ClientConfig, "push_interval")
PULL_MS = _default(ClientConfig, "pull_interval")
REFRESH_MS = _default(ServiceConfig, "mirror_interval")


class FleetCounts:
    """The store, the draft view and one mirrored dynamic table per replica, attached to the
    replica's drafter (`drafters[r]`, made with track_deltas). Call `tick(now)` at the start of
    every tick."""

    def __init__(self, drafters: list[Any], push_ms: float = PUSH_MS, refresh_ms: float = REFRESH_MS,
                 pull_ms: float = PULL_MS, policy: ViewPolicy | None = None) -> None:
        if min(push_ms, refresh_ms, pull_ms) <= 0:
            raise ValueError("push, refresh and pull intervals must be > 0 ms")
        self.drafters = drafters
        self.k = k = len(drafters)
        self.push_ms, self.refresh_ms, self.pull_ms = push_ms, refresh_ms, pull_ms
        self.store = CountTable()
        self.view = DraftView(self.store, policy)
        self.tables = [CountTable() for _ in range(k)]
        for drafter, table in zip(drafters, self.tables):
            drafter.set_dynamic(table)
        # Each replica's next push and pull, spread over the interval (clients start apart).
        self.next_push = [push_ms * (r + 1) / k for r in range(k)]
        self.next_pull = [pull_ms * (r + 1) / k for r in range(k)]
        self.next_refresh = refresh_ms
        self.last_refresh = 0.0
        self.pushed: list[np.ndarray] = []  # rows the store took since the last refresh
        self.pulled_at = [(self.view.view_id, self.view.version) for _ in range(k)]
        self.pushed_rows = 0
        self.pulled_rows = [0] * k

    @staticmethod
    def _due(now: float, at: float, interval: float) -> float | None:
        """The next time after `now` when `at` (a due time) has passed, else None."""
        if now < at:
            return None
        return at + interval * (math.floor((now - at) / interval) + 1)

    def tick(self, now: float) -> None:
        for r in range(self.k):
            nxt = self._due(now, self.next_push[r], self.push_ms)
            if nxt is None:
                continue
            self.next_push[r] = nxt
            rows = self.drafters[r].drain_deltas()
            if len(rows):
                self.store.add_rows(rows)
                self.pushed.append(rows)
                self.pushed_rows += len(rows)
        nxt = self._due(now, self.next_refresh, self.refresh_ms)
        if nxt is not None:
            self.next_refresh = nxt
            if self.pushed:
                changed = np.concatenate(self.pushed).astype(np.int64)
                self.pushed = []
                diff, scale = self.view.diff(changed, (now - self.last_refresh) / 1000.0)
                self.view.apply(diff, scale)
            self.last_refresh = now
        for r in range(self.k):
            nxt = self._due(now, self.next_pull[r], self.pull_ms)
            if nxt is None:
                continue
            self.next_pull[r] = nxt
            self._pull(r)

    def _pull(self, r: int) -> None:
        rows = self.view.changes_since(*self.pulled_at[r])
        view_id, version = self.view.view_id, self.view.version
        if rows is None:  # not served from the log: a new table of the whole view, as a client does
            view_id, version, rows = self.view.export_rows()
            self.tables[r] = CountTable()
            self.drafters[r].set_dynamic(self.tables[r])
        if len(rows):
            self.tables[r].assign_rows(rows, zero_removes=True)
        self.pulled_rows[r] += len(rows)
        self.pulled_at[r] = (view_id, version)

    def extra(self) -> dict[str, float]:
        return {"view_rows_pulled_per_client": sum(self.pulled_rows) / self.k, "view_rows": float(
            self.view.published.n_entries)}
