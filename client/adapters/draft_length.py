"""The draft-length policy: how many drafted tokens to send, given what verifying them costs and their odds."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["DraftLengthPolicy", "VerifyCost", "best_length", "best_tree_size", "expected_tokens"]


class VerifyCost:
    """c(k): the cost of a forward pass over 1 + k tokens relative to one token (c(0) = 1).

    Built from measured points (k -> seconds or relative cost), interpolated linearly between
    them and extended past the last one along the last segment's slope; or from a callable.
    Immutable, so thread-safe.

    Args:
        points: {k: cost} with k >= 0 and costs > 0 (at least k = 0 and one more point), a
            sequence whose item k is c(k), or a callable k -> c(k).
        max_k: the largest k it is tabulated for (drafts are at most this long).

    Raises:
        InvalidArgumentError: no point for k = 0, a negative k, or a cost that is not > 0.
    """

    def __init__(self, points: Mapping[int, float] | Sequence[float] | Callable[[int], float], max_k: int = 256) -> None:
        if max_k < 0:
            raise InvalidArgumentError(f"max_k must be >= 0, got {max_k}")
        if callable(points):
            raw = [float(points(k)) for k in range(max_k + 1)]
        else:
            table = dict(points) if isinstance(points, Mapping) else dict(enumerate(points))
            if 0 not in table:
                raise InvalidArgumentError("verify costs need c(0), the cost of one token")
            if any(k < 0 for k in table):
                raise InvalidArgumentError(f"verify cost points need k >= 0, got {sorted(table)}")
            ks = np.array(sorted(table), dtype=np.float64)
            cs = np.array([float(table[int(k)]) for k in ks], dtype=np.float64)
            grid = np.arange(max_k + 1, dtype=np.float64)
            raw = list(np.interp(grid, ks, cs))
            if len(ks) >= 2:  # np.interp is flat past the last point: costs keep growing instead
                slope = (cs[-1] - cs[-2]) / (ks[-1] - ks[-2])
                for k in range(int(ks[-1]) + 1, max_k + 1):
                    raw[k] = cs[-1] + slope * (k - ks[-1])
        if not all(np.isfinite(c) and c > 0 for c in raw):
            raise InvalidArgumentError(f"verify costs must be finite and > 0, got {raw[:9]}")
        self.costs: NDArray[np.float64] = np.asarray(raw, dtype=np.float64) / raw[0]

    @classmethod
    def measure(cls, run: Callable[[int], object], ks: Sequence[int] = (0, 1, 2, 4, 8), *, repeats: int = 7,
                max_k: int = 256) -> VerifyCost:
        """Times `run(k)` (one forward pass over 1 + k tokens) for each k of `ks`, `repeats`
        rounds after a warm-up round, and fits c(k) = 1 + slope x k to the medians.

        The rounds go over every k in turn, so a neighbour's load slows all of them alike; the
        line (least squares, slope >= 0) is what both engines show, and a single noisy median
        moves it less than it would move an interpolation through the points.

        Raises:
            InvalidArgumentError: fewer than two distinct k, or `repeats` < 1.
        """
        order = sorted(set(ks))
        if len(order) < 2 or order[0] < 0 or repeats < 1:
            raise InvalidArgumentError(f"measuring verify costs needs two k >= 0 or more, got {list(ks)}, and repeats >= 1")
        for k in order:
            run(k)  # warm-up: first-use allocations are not the steady cost
        times: dict[int, list[float]] = {k: [] for k in order}
        for _ in range(repeats):
            for k in order:
                start = time.perf_counter()
                run(k)
                times[k].append(time.perf_counter() - start)
        x = np.array(order, dtype=np.float64)
        y = np.array([np.median(times[k]) for k in order])
        slope, intercept = np.polyfit(x, y, 1)
        if intercept <= 0:  # noise beyond reason: fall back to the smallest k's median as one token's cost
            intercept = float(y[0])
        rel = max(0.0, float(slope) / float(intercept))
        return cls(lambda k: 1.0 + rel * k, max_k)

    @classmethod
    def measure_loop(cls, call_times: Callable[[int], Sequence[float]], ks: Sequence[int] = (0, 1, 2, 4, 8), *,
                     repeats: int = 3, max_k: int = 256) -> VerifyCost:
        """c(k) measured in an engine's own decoding loop: `call_times(k)` runs the loop with a
        probe that drafts k tokens each step and returns the times of the probe's calls, so the
        gaps between them (the first one dropped: the prompt's) are steps with k drafted tokens.
        `repeats` rounds over every k after a warm-up round; c(k) is the median step with k
        over the median step with none, made never to fall with k (a noisy point would make a
        longer draft look cheaper), and interpolated between the measured k.

        Raises:
            InvalidArgumentError: `ks` without 0 or another k, `repeats` < 1, or too few steps timed.
        """
        order = sorted(set(ks))
        if len(order) < 2 or order[0] != 0 or repeats < 1:
            raise InvalidArgumentError(f"measuring verify costs needs k = 0 and another k and repeats >= 1, "
                                       f"got ks {list(ks)}, repeats {repeats}")
        steps: dict[int, list[float]] = {k: [] for k in order}
        for round_ in range(repeats + 1):  # round 0 warms up (first-use allocations)
            for k in order:
                times = np.diff(np.asarray(call_times(k), dtype=np.float64))[1:]
                if round_:
                    steps[k].extend(times.tolist())
        if any(not v for v in steps.values()):
            raise InvalidArgumentError("the decoding loop made too few steps to time: raise passes")
        medians = np.maximum.accumulate(np.array([np.median(steps[k]) for k in order]))
        return cls(dict(zip(order, medians.tolist())), max_k)

    @property
    def max_k(self) -> int:
        return len(self.costs) - 1

    def needs_baseline(self) -> bool:
        """Whether the next step should draft nothing, to time a step without a draft: never for
        given costs (`step_costs.StepCosts`, learned from the engine's steps, sometimes asks)."""
        return False

    def __call__(self, k: int) -> float:
        return float(self.costs[min(k, self.max_k)])

    def __repr__(self) -> str:
        shown = ", ".join(f"{c:.2f}" for c in self.costs[:9])
        return f"VerifyCost([{shown}{', ...' if self.max_k > 8 else ''}])"


def expected_tokens(odds: NDArray[np.floating] | Sequence[float]) -> NDArray[np.float64]:
    """E[new tokens] of a verification with the first k drafted tokens, for k = 0..len(odds):
    1 + sum_{i<=k} prod_{j<=i} odds[j] (the model's own token plus the accepted prefix)."""
    p = np.clip(np.asarray(odds, dtype=np.float64), 0.0, 1.0)
    return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(p))))


def best_length(odds: NDArray[np.floating] | Sequence[float], cost: VerifyCost) -> int:
    """The k in 0..len(odds) with the most expected new tokens per unit of verify cost (ties: the shorter)."""
    # One pass of a few array operations: it runs every step of an engine's loop (a GPU step is ~25 ms).
    n = min(len(odds), cost.max_k)
    if n == 0:
        return 0
    rate = np.minimum(np.asarray(odds[:n], dtype=np.float64), 1.0)  # np.clip costs 3x as much on short arrays
    np.maximum(rate, 0.0, out=rate)
    np.cumprod(rate, out=rate)
    np.cumsum(rate, out=rate)
    rate += 1.0
    rate /= cost.costs[1: n + 1]
    k = int(np.argmax(rate))  # the first maximum: the shortest draft among equals
    return k + 1 if rate[k] > 1.0 else 0  # k = 0 yields 1 token for c(0) = 1


def best_tree_size(probs: NDArray[np.floating] | Sequence[float], cost: VerifyCost) -> int:
    """How many of a best-first tree's nodes to verify: the m in 0..len(probs) with the most
    expected new tokens, 1 + sum(probs[:m]), per unit of verify cost c(m) (ties: the smaller).

    `probs[i]` is node i's path probability (`Drafter.draft_tree_scored`): a verification accepts
    one root-to-node path, so the accepted drafted tokens expected are the sum of the nodes'
    chances to be on it. Best-first nodes make every prefix a tree, so the first m nodes are sent.
    """
    p = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
    gain = np.concatenate(([1.0], 1.0 + np.cumsum(p)))
    m_max = min(len(gain) - 1, cost.max_k)
    return int(np.argmax(gain[: m_max + 1] / cost.costs[: m_max + 1]))


class DraftLengthPolicy:
    """Chooses each step's draft length for one sequence, its odds calibrated by the sequence's own history.

    The drafter's odds come from counts and matches; how well they predict acceptance varies
    with the text. The policy keeps a decayed ratio of tokens the model agreed with to tokens
    the odds predicted (over the tokens the model produced after each draft, whether they were
    sent or not), and scales the odds by it before choosing the length: a sequence whose
    drafts fail more than the counts suggest drafts shorter, one whose drafts do better drafts
    longer. Deterministic: the same calls give the same lengths.

    Not thread-safe: one policy serves one sequence (one `SequenceFeed`).

    Args:
        cost: the engine's verify costs.
        prior: weight, in tokens, of the uncalibrated ratio 1 (the start of each sequence).
        decay: how much of the past the ratio keeps at each draft (0..1).
    """

    def __init__(self, cost: VerifyCost, *, prior: float = 4.0, decay: float = 0.9) -> None:
        if prior <= 0 or not 0.0 <= decay <= 1.0:
            raise InvalidArgumentError(f"prior must be > 0 and decay in 0..1, got {prior}, {decay}")
        self.cost = cost
        self.prior = prior
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        """Forgets the sequence's history (a new sequence starts uncalibrated)."""
        self.agreed = 0.0
        self.predicted = 0.0

    @property
    def ratio(self) -> float:
        """Agreed over predicted tokens so far, shrunk towards 1 by the prior."""
        return (self.agreed + self.prior) / (self.predicted + self.prior)

    def calibrated(self, odds: NDArray[np.floating] | Sequence[float]) -> NDArray[np.float64]:
        """The odds scaled by `ratio`, within 0..1."""
        return np.clip(np.asarray(odds, dtype=np.float64) * self.ratio, 0.0, 1.0)

    def choose(self, odds: NDArray[np.floating] | Sequence[float]) -> int:
        """How many of the drafted tokens (whose raw odds are `odds`) to send: 0..len(odds)."""
        if len(odds) == 0 or self.cost.needs_baseline():
            return 0
        return best_length(np.multiply(odds, self.ratio, dtype=np.float64), self.cost)  # best_length clips

    def record(self, odds: NDArray[np.floating] | Sequence[float], agreed: int) -> None:
        """Learns from one step: the model's tokens agreed with the first `agreed` drafted tokens,
        out of the len(odds) drafted tokens it produced a token for (sent or not)."""
        if len(odds) == 0:
            return
        p = np.minimum(np.asarray(odds, dtype=np.float64), 1.0)  # as best_length: np.clip is slow on short arrays
        np.maximum(p, 0.0, out=p)
        self._learn(float(np.cumprod(p, out=p).sum()), agreed)

    def choose_tree(self, probs: NDArray[np.floating] | Sequence[float],
                    parents: NDArray[np.integer] | Sequence[int]) -> int:
        """How many nodes of a best-first tree (`Drafter.draft_tree_scored`: path probabilities
        `probs`, `parents`) to verify: 0..len(probs), its odds calibrated as `choose` does (each
        node's own odds, given its parent, scaled by `ratio`)."""
        if len(probs) == 0:
            return 0
        return best_tree_size(self.calibrated_tree(probs, parents), self.cost)

    def calibrated_tree(self, probs: NDArray[np.floating] | Sequence[float],
                        parents: NDArray[np.integer] | Sequence[int]) -> NDArray[np.float64]:
        """A tree's path probabilities with each node's conditional odds scaled by `ratio`, within 0..1."""
        p = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
        out = np.empty_like(p)
        for i, parent in enumerate(parents):  # parents come first, so out[parent] is set
            above = 1.0 if parent < 0 else p[parent]
            own = p[i] / above if above > 0 else 0.0
            out[i] = min(1.0, own * self.ratio) * (1.0 if parent < 0 else out[parent])
        return out

    def record_tree(self, probs: NDArray[np.floating] | Sequence[float], agreed: int) -> None:
        """Learns from one tree step: the model's tokens agreed with a path of `agreed` nodes of a
        tree whose path probabilities (all its nodes, sent or not) are `probs`."""
        if len(probs) == 0:
            return
        self._learn(float(np.sum(np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0))), agreed)

    def _learn(self, predicted: float, agreed: int) -> None:
        self.agreed = self.decay * self.agreed + agreed
        self.predicted = self.decay * self.predicted + predicted
