"""Verify costs learned from an engine's own decoding steps: the default draft length ("auto") sized to the engine.

On a GPU a forward pass over 1 + 64 drafted tokens costs about as much as one over 1 token, so
the best draft is long; on a few CPU cores a drafted step costs 1.6-2x a plain one, so the best
draft is short or none. `StepCosts` tells the two apart without a single extra forward pass:
the adapters time the steps their engine runs anyway (the gap between two calls of the drafter
is one step that verified the tokens drafted at the first), and c(k) is the median step with k
drafted tokens over the median step with none. Until a length has been seen, c(k) is taken flat
(as cheap as the longest length seen): an optimistic guess, so long drafts are tried and kept
where they are cheap and cut after a few steps where they are not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ngramcache.client._core import MAX_DRAFT
from ngramcache.client.adapters.draft_length import VerifyCost
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["AUTO", "MAX_AUTO_DRAFT", "UNSCORED_ODDS", "StepCosts", "draft_length_setting"]

AUTO = "auto"
MAX_AUTO_DRAFT = 64  # the longest draft n_draft="auto" sends (a forward over 65 tokens is still ~flat on a GPU)
# The odds n_draft="auto" gives each token of a drafter without draft_scored (RemoteDrafter): a
# neutral guess that the policy's calibration (agreed / predicted tokens) scales to the sequence's.
UNSCORED_ODDS = 0.6


def draft_length_setting(n_draft: int | str) -> tuple[int, bool]:
    """(most tokens drafted a step, whether the length is chosen per step) for an adapter's `n_draft`.

    Raises:
        InvalidArgumentError: neither "auto" nor a whole number in 1..256.
    """
    if n_draft == AUTO:
        return MAX_AUTO_DRAFT, True
    if isinstance(n_draft, bool) or not isinstance(n_draft, (int, np.integer)) or not 1 <= n_draft <= MAX_DRAFT:
        raise InvalidArgumentError(f"n_draft must be 'auto' or a whole number in 1..{MAX_DRAFT}, got {n_draft!r}")
    return int(n_draft), False


class StepCosts(VerifyCost):
    """c(k) learned from timed decoding steps (`record(k, seconds)`), refreshed every few steps.

    Steps are kept per length bucket (0, 1, 2-3, 4-7, ..., 32-63, 64+), the last `window` of each;
    a bucket with `min_samples` steps is a point (its median k, its median seconds). c(k) is
    interpolated between the points over the point of bucket 0, made never to fall with k, and
    past the last point follows `prior`'s shape (flat by default). Before bucket 0 has its
    samples, `prior` is used as it is, and `needs_baseline()` asks for an undrafted step now and
    then (one in `probe_every` steps at most), since a step with nothing to draft may not come.

    Not thread-safe: the steps of one engine are timed from one thread (the adapters hold the
    engine's lock, or the engine runs one generation at a time).

    Args:
        max_k: the longest draft the costs are for.
        prior: the costs before they are measured and the shape past the longest length seen
            (a `VerifyCost`, a list whose item k is c(k), or a callable; default flat).
        window: steps kept per bucket.
        min_samples: steps a bucket needs to count.
        refresh: steps recorded between two recomputations (each is a few medians: ~50 us).
        probe_every: most steps between two undrafted steps asked for by `needs_baseline`.
    """

    def __init__(self, max_k: int = MAX_AUTO_DRAFT, *,
                 prior: VerifyCost | Sequence[float] | Callable[[int], float] | None = None, window: int = 16,
                 min_samples: int = 3, refresh: int = 8, probe_every: int = 32) -> None:
        if not 1 <= min_samples <= window or refresh < 1 or probe_every < 1:
            raise InvalidArgumentError(f"need 1 <= min_samples <= window, refresh >= 1, probe_every >= 1; got "
                                       f"{min_samples}, {window}, {refresh}, {probe_every}")
        if prior is None:
            prior = [1.0] * (max_k + 1)
        base = prior if isinstance(prior, VerifyCost) else VerifyCost(prior, max_k)
        super().__init__(lambda k: base(k), max_k)
        self.prior = self.costs.copy()
        self.window = window
        self.min_samples = min_samples
        self.refresh = refresh
        self.probe_every = probe_every
        self._buckets: list[deque[tuple[int, float]]] = [deque(maxlen=window) for _ in range((max_k).bit_length() + 1)]
        self._pending = 0  # steps recorded since the last recomputation
        self._since_baseline = 0  # steps since the last one with nothing drafted
        self.measured = False  # whether the costs come from steps yet (bucket 0 and another point)
        self.steps = 0  # steps recorded in all

    def record(self, k: int, seconds: float) -> None:
        """One decoding step that verified `k` drafted tokens took `seconds`."""
        if not seconds > 0.0:
            return
        k = min(max(int(k), 0), self.max_k)
        self._buckets[k.bit_length()].append((k, seconds))
        self.steps += 1
        self._since_baseline = 0 if k == 0 else self._since_baseline + 1
        self._pending += 1
        if self._pending >= self.refresh:
            self._pending = 0
            self.update()

    def needs_baseline(self) -> bool:
        """Whether the next step should draft nothing: bucket 0 lacks samples and no step without a
        draft came for `probe_every` steps, a quarter of that before anything is measured (without
        it, nothing measures what a draft adds, and "auto" drafts a fixed length until then)."""
        every = self.probe_every if self.measured else max(1, self.probe_every // 4)
        return len(self._buckets[0]) < self.min_samples and self._since_baseline >= every

    def update(self) -> None:
        """Recomputes c(k) from the steps kept (done by `record` every `refresh` steps)."""
        xs: list[float] = []
        ys: list[float] = []
        for bucket in self._buckets:
            if len(bucket) >= self.min_samples:
                ks, secs = zip(*bucket, strict=True)
                xs.append(float(np.median(ks)))
                ys.append(float(np.median(secs)))
        if not xs or xs[0] != 0.0 or len(xs) < 2:
            return  # no baseline, or nothing to compare with it: keep what there is
        rel = np.maximum.accumulate(np.asarray(ys) / ys[0])
        grid = np.arange(self.max_k + 1, dtype=np.float64)
        costs = np.interp(grid, xs, rel)
        last = int(xs[-1])
        if last < self.max_k:  # unseen lengths: the prior's growth from the longest length seen
            costs[last + 1:] = rel[-1] * self.prior[last + 1:] / self.prior[last]
        self.costs = costs
        self.measured = True

    def __repr__(self) -> str:
        shown = ", ".join(f"{self(k):.2f}" for k in (0, 1, 2, 4, 8, 16, 32, 64) if k <= self.max_k)
        return f"StepCosts(c(0, 1, 2, 4, 8, 16, 32, 64) = {shown}; {self.steps} steps{'' if self.measured else ', prior'})"
