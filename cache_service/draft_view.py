"""DraftView: the part of a namespace's dynamic counts that can change a draft, served to clients as a change log.

A fleet of N clients that each mirror every change of the store moves O(N^2) rows. The
service instead publishes one *draft view* per namespace (ngc/draft_view.h): of each key
whose total reaches the drafter's strict minimum for its size, its ``top_k`` followers by
count; a count already published is republished only when it moved by more than
``min_change_pct`` percent. Every client pulls the same log, so its traffic is the view's
change rate (a row is sent O(log count) times in its life, not once per push) and its
memory is the view's size. Two budgets bound both whatever the fleet's size: over
``max_rows`` rows, or over ``max_rows_per_second`` rows logged per second (a token bucket that lets a
``burst_seconds`` burst pass), the view doubles its key minimum (``scale``), and the change that does it removes the keys now under it. The
long tail the view leaves out reaches drafts through the next static generation.

The view lives in the service's memory, one per replica: a client that moves to another
replica (or pulls from one that restarted) sees another ``view_id`` and reloads the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections import deque

import numpy as np

from ngramcache.client._core import CountTable
from ngramcache.client.kernel.rows import empty_counts

MAX_TOP_K = 64  # ngc::kMaxViewTopK


@dataclasses.dataclass(frozen=True)
class ViewPolicy:
    """What a draft view keeps (see the module docstring).

    Attributes:
        top_k: followers kept per key (1..64).
        min_total: the key total, per n-gram size 1..4, from which a key is in the view
            (default: the drafter's strict minimum, so nothing that can draft is left out).
        min_change_pct: a published count is updated when it moves by more than this
            percent (0: on every change).
        max_rows: the most (key, follower) rows in the view; over it the key minimum doubles.
        max_rows_per_second: the most rows logged per second (what each client pulls);
            over it the key minimum doubles.
        burst_seconds: the rate budget is a token bucket holding this many seconds of it, so a
            burst (a client's first pushes) passes without raising the key minimum.
        settle_seconds: how long the log stays under a quarter of its rate budget before the
            key minimum halves again.
        log_rows: rows of change log kept; a client further behind reloads the view.
    """

    top_k: int = 8
    min_total: tuple[int, int, int, int] = (4, 3, 2, 2)
    min_change_pct: int = 25
    max_rows: int = 2_000_000
    max_rows_per_second: int = 20_000
    burst_seconds: float = 10.0
    settle_seconds: float = 10.0
    log_rows: int = 4_000_000

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"view top_k must be in 1..{MAX_TOP_K}, got {self.top_k}")
        if len(self.min_total) != 4 or min(self.min_total) < 1:
            raise ValueError(f"view min_total needs 4 values >= 1, got {self.min_total}")
        if self.settle_seconds <= 0 or self.burst_seconds < 0:
            raise ValueError("view settle_seconds must be > 0 and burst_seconds >= 0")
        if self.min_change_pct < 0 or min(self.max_rows, self.max_rows_per_second, self.log_rows) < 1:
            raise ValueError("view min_change_pct must be >= 0, max_rows, max_rows_per_second and log_rows >= 1")


class DraftView:
    """One namespace's draft view over its full mirror ``full`` (a `CountTable` this object only reads).

    The heavy parts (`diff`, `build`, `export_rows`) are native calls that release the GIL
    and may run on a worker thread; the bookkeeping (`apply`, `install`, `changes_since`)
    runs on the one thread that owns the view (the service's event loop), which is also the
    only writer of ``published``; `wait_newer` waits there for the next `apply` or `install`.
    """

    def __init__(self, full: CountTable, policy: ViewPolicy | None = None) -> None:
        self.policy = policy or ViewPolicy()
        self.full = full
        self.scale = 1  # the key minimum is policy.min_total * scale
        self.published = CountTable()
        self.view_id = ""
        self.version = 0
        self._log: deque[tuple[int, np.ndarray]] = deque()  # (version, rows), versions increasing
        self._log_rows = 0
        self._export: tuple[str, int, np.ndarray] | None = None  # the last export: (view_id, version, rows)
        self._quiet = 0.0  # seconds the log has stayed under a quarter of its rate budget
        self._credit = float(self.policy.max_rows_per_second * self.policy.burst_seconds)  # rows it may log now
        self.rows_published = 0  # rows appended to the log since this object was made
        self.rebuilds = 0
        self._news: asyncio.Event | None = None  # made by the first waiter; set (and dropped) by a change
        self.install(*self.build(full))

    def min_total(self, scale: int) -> list[int]:
        return [m * scale for m in self.policy.min_total]

    # worker-thread parts

    def diff(self, changed: np.ndarray, seconds: float) -> tuple[np.ndarray, int]:
        """The view rows to publish for the store rows ``changed`` (already applied to the full mirror)
        ``seconds`` after the last diff, and the key minimum's scale they were computed at.

        Over a budget, the scale doubles and the rows cover every key (removing those now under
        the minimum). After ``policy.settle_seconds`` under a quarter of the rate budget, the
        scale halves again if the keys that brings back fit in ``settle_seconds`` of budget.
        """
        scale = self.scale
        seconds = max(seconds, 1e-3)
        rows = self._diff(np.ascontiguousarray(changed, dtype=np.int64), scale)
        rate = self.policy.max_rows_per_second
        budget = rate * seconds
        # A token bucket: bursts of up to burst_seconds of budget pass (a client's first pushes).
        self._credit = min(self._credit + budget, rate * self.policy.burst_seconds)
        if len(rows) > self._credit or self.published.n_entries + self._added(rows) > self.policy.max_rows:
            while True:
                scale *= 2
                rows = self._diff(None, scale)  # the removals of a scale change go out whatever their number
                if self.published.n_entries + self._added(rows) <= self.policy.max_rows:
                    break
            self._quiet = 0.0
            self._credit = 0.0
            return rows, scale
        self._credit -= len(rows)
        self._quiet = self._quiet + seconds if len(rows) < budget / 4 else 0.0
        if scale > 1 and self._quiet >= self.policy.settle_seconds:
            self._quiet = 0.0
            lower = self._diff(None, scale // 2)
            if (len(lower) <= self.policy.max_rows_per_second * self.policy.settle_seconds
                    and self.published.n_entries + self._added(lower) <= self.policy.max_rows):
                return lower, scale // 2
        return rows, scale

    def _diff(self, changed: np.ndarray | None, scale: int) -> np.ndarray:
        return self.full.view_diff(self.published, changed, top_k=self.policy.top_k, min_total=self.min_total(scale),
                                   min_change_pct=self.policy.min_change_pct)

    @staticmethod
    def _added(rows: np.ndarray) -> int:
        """An upper bound of the rows ``rows`` adds to the view (each nonzero row may be new)."""
        return int(np.count_nonzero(rows[:, -1]))

    def build(self, full: CountTable, scale: int = 1) -> tuple[CountTable, CountTable, int]:
        """A whole view of ``full`` within max_rows: (full, published, scale)."""
        while True:
            rows = full.view_diff(CountTable(), None, top_k=self.policy.top_k, min_total=self.min_total(scale),
                                  min_change_pct=0)
            if len(rows) <= self.policy.max_rows:
                break
            scale *= 2
        published = CountTable()
        published.assign_rows(rows, zero_removes=True)
        return full, published, scale

    def export_rows(self) -> tuple[str, int, np.ndarray]:
        """(view_id, version, every row of the view); the rows reflect at least that version."""
        view_id, version, published = self.view_id, self.version, self.published
        cached = self._export
        if cached is not None and cached[0] == view_id and cached[1] == version:
            return cached
        rows = published.view_diff(CountTable(), None, top_k=MAX_TOP_K, min_total=(1, 1, 1, 1), min_change_pct=0)
        self._export = (view_id, version, rows)
        return self._export

    # owner-thread parts

    def install(self, full: CountTable, published: CountTable, scale: int) -> None:
        """Make a built view current, as a new incarnation (clients reload it)."""
        self.full, self.published, self.scale = full, published, scale
        self.view_id = uuid.uuid4().hex
        self.version = 1
        self._log.clear()
        self._log_rows = 0
        self.rebuilds += 1
        self._changed()

    def apply(self, rows: np.ndarray, scale: int) -> None:
        """Publish what `diff` returned."""
        self.scale = scale
        if not len(rows):
            return
        self.published.assign_rows(rows, zero_removes=True)
        self.version += 1
        self._log.append((self.version, rows))
        self._log_rows += len(rows)
        self.rows_published += len(rows)
        while self._log_rows > self.policy.log_rows and len(self._log) > 1:
            self._log_rows -= len(self._log.popleft()[1])
        self._changed()

    def _changed(self) -> None:
        news, self._news = self._news, None
        if news is not None:
            news.set()

    async def wait_newer(self, view_id: str, version: int, timeout: float) -> None:
        """Return when the view is past ``version`` of incarnation ``view_id`` (at once if it is already, or
        is another incarnation), or after ``timeout`` seconds: a Pull with nothing new waits here for a change
        rather than the client asking again and again."""
        if view_id != self.view_id or version != self.version or timeout <= 0:
            return
        if self._news is None:
            self._news = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._news.wait(), timeout)

    def changes_since(self, view_id: str, version: int) -> np.ndarray | None:
        """The rows to apply after ``version`` of incarnation ``view_id`` (in order: a later row of an
        entry overrides an earlier one), or None when that is not served here (reload the view)."""
        if view_id != self.view_id or not 1 <= version <= self.version:
            return None
        if version == self.version:
            return empty_counts()
        if not self._log or version < self._log[0][0] - 1:
            return None
        parts = [rows for v, rows in self._log if v > version]
        return np.concatenate(parts) if parts else empty_counts()

    def stats(self) -> dict[str, int | str]:
        return {"view_id": self.view_id, "version": self.version, "rows": self.published.n_entries,
                "memory_bytes": self.published.memory_bytes(), "log_rows": self._log_rows, "scale": self.scale,
                "rows_published": self.rows_published, "rebuilds": self.rebuilds}
