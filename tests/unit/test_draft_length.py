"""The draft-length policy: verify costs, the length chosen for given odds, calibration by the sequence's history."""

from __future__ import annotations

import types

import numpy as np
import pytest
from helpers.drafters import NoOddsDrafter

from ngramcache import UNTAGGED, Drafter, InvalidArgumentError
from ngramcache.client.adapters import draft_length
from ngramcache.client.adapters.draft_length import (
    DraftLengthPolicy,
    VerifyCost,
    best_length,
    best_tree_size,
    expected_tokens,
)
from ngramcache.client.adapters.sequence_feed import SequenceFeed


def linear(slope: float, max_k: int = 16) -> VerifyCost:
    return VerifyCost(lambda k: 1.0 + slope * k, max_k)


def test_verify_cost_interpolates_and_extends_past_the_last_point():
    cost = VerifyCost({0: 2.0, 4: 4.0, 8: 8.0}, max_k=10)
    assert cost(0) == 1.0  # relative to one token
    assert cost(2) == pytest.approx(1.5)
    assert cost(6) == pytest.approx(3.0)
    assert cost(10) == pytest.approx(5.0)  # the last segment's slope, not flat
    assert VerifyCost([1.0, 1.25, 1.5], max_k=4)(4) == pytest.approx(2.0)


@pytest.mark.parametrize("points", [{1: 1.0, 2: 2.0}, {0: 1.0, -1: 0.5}, {0: 1.0, 1: 0.0}, [1.0, float("nan")]])
def test_verify_cost_refuses_bad_points(points):
    with pytest.raises(InvalidArgumentError):
        VerifyCost(points, max_k=4)


def test_measured_costs_are_a_line_through_the_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass over 1 + k tokens takes 2 + k ms on a clock the test drives (no wall-clock: a loaded machine
    cannot move it), with one slow outlier per k: the medians ignore them, the line is exact."""
    now = [0.0]
    calls: dict[int, int] = {}

    def forward(k: int) -> None:
        calls[k] = calls.get(k, 0) + 1
        now[0] += (0.002 + 0.001 * k) * (25 if calls[k] == 3 else 1)  # its 2nd timed round: a neighbour's burst

    monkeypatch.setattr(draft_length, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    cost = VerifyCost.measure(forward, (0, 2, 4), repeats=3, max_k=8)
    assert calls == {0: 4, 2: 4, 4: 4}  # a warm-up round, then 3 timed rounds
    assert [cost(k) for k in (0, 2, 4, 8)] == pytest.approx([1.0, 2.0, 3.0, 5.0])  # c(k) = 1 + k / 2
    with pytest.raises(InvalidArgumentError, match="two k >= 0 or more"):
        VerifyCost.measure(lambda k: None, (0,), repeats=1)


def test_expected_tokens():
    assert list(expected_tokens([0.5, 0.5])) == pytest.approx([1.0, 1.5, 1.75])


def test_best_length_for_given_costs_and_odds():
    # E = 1, 1.9, 2.35 over c = 1, 1.5, 2.0: rates 1, 1.27, 1.18
    assert best_length([0.9, 0.5], VerifyCost([1.0, 1.5, 2.0])) == 1
    assert best_length([0.9] * 8, linear(0.05)) == 8  # cheap verification: send everything likely
    assert best_length([0.99] * 8, linear(0.325)) == 8  # 9 tokens cost 3.6x, but almost all are accepted
    assert best_length([], linear(0.1)) == 0


def test_best_length_is_zero_when_odds_are_low():
    assert best_length([0.3] * 8, linear(0.325)) == 0  # llama-cpp-python's 3.6x for 9 tokens
    assert best_length([0.2, 0.9, 0.9], linear(0.3)) == 0


def test_ties_go_to_the_shorter_draft():
    assert best_length([0.5], VerifyCost([1.0, 1.5])) == 0  # 1/1 == 1.5/1.5


def test_calibration_moves_with_rejections_and_recovers():
    policy = DraftLengthPolicy(linear(0.1))
    odds = [0.95] * 8
    first = policy.choose(odds)
    assert first == 8
    for _ in range(6):
        policy.record(odds, 0)  # the model never agrees: this sequence's odds are worse than the counts say
    assert policy.ratio < 0.5
    assert policy.choose(odds) < first
    for _ in range(3):
        policy.record(odds, 1)  # some agreement, with zero-length drafts too (all the model produced)
    for _ in range(12):
        policy.record(odds, 8)
    assert policy.ratio > 1.0 and policy.choose(odds) == 8
    policy.reset()
    assert policy.ratio == 1.0


def test_policy_is_deterministic():
    def run() -> list[int]:
        policy = DraftLengthPolicy(linear(0.3))
        rng = np.random.default_rng(3)
        out = []
        for _ in range(50):
            odds = rng.random(8)
            out.append(policy.choose(odds))
            policy.record(odds[: out[-1] + 1], int(rng.integers(0, out[-1] + 2)))
        return out

    assert run() == run()


def test_policy_refuses_bad_tuning():
    with pytest.raises(InvalidArgumentError):
        DraftLengthPolicy(linear(0.1), decay=1.5)


def repetitive() -> np.ndarray:
    return np.asarray([5, 6, 7, 8, 9, 10, 11, 12] * 6, dtype=np.int32)


def test_feed_sends_the_chosen_prefix_only():
    drafter = Drafter(vocab_size=64, fingerprint=UNTAGGED)
    tokens = repetitive()
    full = drafter.draft(9, tokens, 8)  # a sequence with no context yet: counts come with accept
    cheap = SequenceFeed(drafter, 1, 8, policy=DraftLengthPolicy(linear(0.01)))
    costly = SequenceFeed(drafter, 2, 8, policy=DraftLengthPolicy(linear(5.0)))
    plain = SequenceFeed(drafter, 3, 8)
    assert len(full) == 0
    sent_plain = plain.draft(tokens)
    assert len(sent_plain) == 8
    assert list(cheap.draft(tokens)) == list(sent_plain)
    assert len(costly.draft(tokens)) == 0  # no draft is worth 6x a token's cost
    assert costly.stats.drafted == 0 and cheap.stats.drafted == 8


def test_feed_calibrates_from_the_models_tokens():
    drafter = Drafter(vocab_size=64, fingerprint=UNTAGGED)
    policy = DraftLengthPolicy(linear(0.2))
    feed = SequenceFeed(drafter, 1, 8, policy=policy)
    tokens = repetitive()
    for i in range(8):  # the "model" never continues as drafted
        drafted = feed.draft(tokens)
        tokens = np.append(tokens, 40 + i).astype(np.int32)  # a new token each time: never drafted
        assert len(drafted) <= 8
    assert policy.ratio < 1.0
    assert len(feed.draft(tokens)) < 8


def test_a_policy_needs_draft_scored():
    with pytest.raises(InvalidArgumentError, match="draft_scored"):
        SequenceFeed(NoOddsDrafter(), 1, 8, policy=DraftLengthPolicy(linear(0.1)))


def test_tree_size_keeps_the_nodes_worth_their_cost():
    probs = [0.9, 0.8, 0.7, 0.2, 0.1, 0.05]
    assert best_tree_size(probs, VerifyCost([1.0] * 7)) == 6  # free verification: every node
    assert best_tree_size(probs, VerifyCost(lambda k: 1.0 + 0.5 * k, 8)) == 3  # (1 + 2.4) / 2.5 beats (1 + 2.6) / 3.0
    assert best_tree_size(probs, VerifyCost(lambda k: 1.0 + 2.0 * k, 8)) == 0  # dearer than any node's odds
    assert best_tree_size([], VerifyCost([1.0, 1.1])) == 0


def test_tree_odds_are_calibrated_per_node_given_its_parent():
    policy = DraftLengthPolicy(VerifyCost(lambda k: 1.0 + 0.5 * k, 8))
    probs, parents = [0.8, 0.4, 0.6], [-1, 0, -1]
    assert np.allclose(policy.calibrated_tree(probs, parents), probs)  # uncalibrated: ratio 1
    for _ in range(20):  # nothing the odds predicted was accepted
        policy.record_tree(probs, 0)
    low = policy.calibrated_tree(probs, parents)
    r = policy.ratio
    assert r < 0.5 and np.allclose(low, [0.8 * r, 0.8 * r * (0.5 * r), 0.6 * r])
    assert policy.choose_tree(probs, parents) == 0


def test_measuring_in_an_engines_loop_refuses_bad_arguments():
    # Checked before the engine is touched: no model is needed to be told.
    from ngramcache.client.adapters.transformers import measure_verify_cost

    with pytest.raises(InvalidArgumentError, match="k = 0"):
        measure_verify_cost(object(), ks=(1, 2))
    with pytest.raises(InvalidArgumentError, match="passes >= 1"):
        measure_verify_cost(object(), passes=0)


def test_loop_costs_are_median_steps_never_falling_with_k():
    # Synthetic probe runs: the first gap (the prompt) is dropped; a noisy k=4 cheaper than k=2
    # is lifted to k=2's cost; k=3 is interpolated.
    step = {0: 10.0, 1: 20.0, 2: 24.0, 4: 22.0, 8: 40.0}

    def call_times(k: int) -> list[float]:
        return list(np.cumsum([500.0] + [step[k]] * 5))

    cost = VerifyCost.measure_loop(call_times, (0, 1, 2, 4, 8), repeats=2, max_k=8)
    assert np.allclose(cost.costs, [1.0, 2.0, 2.4, 2.4, 2.4, 2.8, 3.2, 3.6, 4.0])
    with pytest.raises(InvalidArgumentError, match="too few steps"):
        VerifyCost.measure_loop(lambda k: [0.0, 1.0], (0, 1), repeats=1)
    with pytest.raises(InvalidArgumentError, match="k = 0"):
        VerifyCost.measure_loop(call_times, (1, 2))
