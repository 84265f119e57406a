"""The default draft length ("auto"): verify costs learned from an engine's own steps, and the lengths they choose."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ngramcache import UNTAGGED, Drafter, InvalidArgumentError
from ngramcache.client.adapters import sequence_feed
from ngramcache.client.adapters.draft_length import DraftLengthPolicy, VerifyCost
from ngramcache.client.adapters.sequence_feed import CAPPED_AUTO_DRAFT, SequenceFeed
from ngramcache.client.adapters.step_costs import MAX_AUTO_DRAFT, StepCosts, draft_length_setting

ODDS = np.full(64, 0.99, dtype=np.float32)  # a long, likely copy (the match mode gives 0.99)


def learned(step_ms: dict[int, float], rounds: int = 4) -> StepCosts:
    """StepCosts fed `rounds` steps of each length k taking step_ms[k] milliseconds."""
    cost = StepCosts()
    for _ in range(rounds):
        for k, ms in step_ms.items():
            cost.record(k, ms / 1e3)
    cost.update()
    return cost


def repetitive(n: int = 3) -> np.ndarray:
    return np.asarray(list(range(100, 200)) * n + list(range(100, 110)), dtype=np.int32)


def test_flat_costs_draft_up_to_64():
    """A GPU's steps: 25 ms with no draft, 27 ms with 64 tokens: the whole 64-token draft is worth it."""
    cost = learned({0: 25.0, 1: 25.2, 4: 25.5, 16: 26.0, 64: 27.0})
    assert cost.measured and cost(64) == pytest.approx(27 / 25)
    assert DraftLengthPolicy(cost).choose(ODDS) == 64
    assert DraftLengthPolicy(cost).choose(ODDS[:20]) == 20  # as long as the drafter has


def test_steep_costs_draft_short_or_nothing():
    """A 2-core CPU's steps: one drafted token costs 1.6x, 8 cost 2x, 64 cost 4x."""
    cost = learned({0: 10.0, 1: 16.0, 2: 19.0, 8: 20.0, 64: 40.0})
    assert cost(1) == pytest.approx(1.6) and cost(64) == pytest.approx(4.0)
    policy = DraftLengthPolicy(cost)
    chosen = policy.choose(np.full(64, 0.8, dtype=np.float32))
    assert 1 <= chosen <= 16  # a likely draft's first tokens, not 64
    assert policy.choose(ODDS) == 64  # a near-certain copy is worth even 4x
    assert policy.choose(np.full(64, 0.3, dtype=np.float32)) == 0  # unlikely drafts: none


def test_unseen_lengths_cost_what_the_longest_seen_costs():
    """Optimism where nothing was timed: past the longest length seen, c(k) follows the (flat) prior,
    so longer drafts are tried; lengths between two points are interpolated; a point never falls."""
    cost = learned({0: 10.0, 2: 12.0, 4: 11.0})  # k=4's median is noise below k=2's
    assert cost(4) == pytest.approx(1.2) and cost(3) == pytest.approx(1.2) and cost(1) == pytest.approx(1.1)
    assert cost(64) == pytest.approx(1.2)
    steep_prior = StepCosts(prior=lambda k: 1.0 + k)
    for _ in range(3):
        steep_prior.record(0, 0.010)
        steep_prior.record(4, 0.020)
    steep_prior.update()
    assert steep_prior(8) == pytest.approx(2.0 * 9 / 5)  # the prior's growth from k=4 on


def test_costs_stay_the_prior_until_a_baseline_is_timed():
    cost = StepCosts(prior=[1.0, 2.0], min_samples=3, probe_every=20, refresh=1)
    for _ in range(4):
        cost.record(8, 0.02)
    assert not cost.measured and cost(8) == pytest.approx(9.0)  # the prior's line, extended
    assert not cost.needs_baseline()
    cost.record(8, 0.02)
    assert cost.needs_baseline()  # 5 drafted steps (a quarter of probe_every, unmeasured) and no undrafted one
    assert DraftLengthPolicy(cost).choose(ODDS) == 0
    for _ in range(3):
        cost.record(0, 0.01)
    assert cost.measured and cost(8) == pytest.approx(2.0) and not cost.needs_baseline()


def test_recording_refreshes_every_few_steps_and_ignores_bad_times():
    cost = StepCosts(refresh=4)
    for k in (0, 0, 0, 8, 8, 8, 0):
        cost.record(k, 0.01 if k == 0 else 0.03)
    assert not cost.measured  # 7 steps: one refresh, before the k=8 bucket had 3 samples
    cost.record(8, 0.03)
    assert cost.measured and cost(8) == pytest.approx(3.0)
    cost.record(0, 0.0)
    cost.record(0, float("nan"))
    assert cost.steps == 8


def test_given_costs_are_honoured_and_never_learned():
    given = VerifyCost(lambda k: 1.0 + 5.0 * k, MAX_AUTO_DRAFT)
    assert not given.needs_baseline()
    drafter = Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match")
    feed = SequenceFeed(drafter, 1, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(given))
    assert len(feed.draft(repetitive())) == 0  # no draft is worth 6x a step
    assert feed.policy is not None and feed.policy.cost is given


def test_the_first_step_drafts_at_once_and_steps_are_timed_between_calls(monkeypatch: pytest.MonkeyPatch):
    """No measuring before the first request: its first draft is the whole 64-token copy (flat prior).
    Each later call records the step since the previous one with the length sent then; a new
    generation's first call (after a prefill) records nothing."""
    now = [100.0]
    monkeypatch.setattr(sequence_feed, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    cost = StepCosts(refresh=1)
    drafter = Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match")
    feed = SequenceFeed(drafter, 1, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(cost))
    tokens = repetitive()
    first = feed.draft(tokens)
    assert len(first) == 64 and cost.steps == 0
    now[0] += 0.030
    tokens = np.concatenate((tokens, first[:10], [7])).astype(np.int32)
    feed.draft(tokens)
    assert cost.steps == 1 and list(cost._buckets[7]) == [(64, pytest.approx(0.030))]
    feed.new_generation()
    now[0] += 5.0  # a prefill and whatever came between two requests
    feed.draft(np.concatenate((tokens, [8, 9])).astype(np.int32))
    assert cost.steps == 1
    now[0] += 0.010
    feed.draft(repetitive(2))  # a new prompt (not an extension): reset, not timed
    assert cost.steps == 1


def test_auto_takes_a_drafter_without_odds():
    """RemoteDrafter has no draft_scored: "auto" gives its tokens neutral odds, calibrated by the sequence."""

    class Plain:
        def __init__(self) -> None:
            self.inner = Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match")

        def draft(self, seq, tokens, n_draft=8):
            return self.inner.draft(seq, tokens, n_draft)

        def accept(self, seq, tokens):
            self.inner.accept(seq, tokens)

        def reset(self, seq):
            return self.inner.reset(seq)

    feed = SequenceFeed(Plain(), 1, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(StepCosts()), unscored_odds=0.6)
    assert len(feed.draft(repetitive())) == 64  # flat costs: every token is worth sending
    with pytest.raises(InvalidArgumentError, match="draft_scored"):
        SequenceFeed(Plain(), 1, 8, policy=DraftLengthPolicy(StepCosts()))


@pytest.mark.parametrize("value", ["fast", 0, 257, True, 2.5])
def test_n_draft_is_auto_or_a_whole_number(value):
    assert draft_length_setting("auto") == (64, True) and draft_length_setting(16) == (16, False)
    with pytest.raises(InvalidArgumentError, match="n_draft must be 'auto' or a whole number in 1..256"):
        draft_length_setting(value)


def test_step_costs_refuse_bad_tuning():
    with pytest.raises(InvalidArgumentError, match="min_samples"):
        StepCosts(min_samples=0)


def test_auto_feeds_draft_uncapped_where_measured_costs_are_flat():
    """With "auto" a match-mode Drafter's draft is not cut at the match length where verifying is measured
    nearly free (the policy sends the long copy); where it is dear, the drafter's own draft goes, whole."""
    tokens = np.asarray([5, 6, 7, 8, 9, 5, 6], dtype=np.int32)
    drafter = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match")
    flat_costs = learned({0: 10.0, 1: 10.0, 64: 10.0})
    flat = SequenceFeed(drafter, 1, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(flat_costs), uncapped=True)
    capped = SequenceFeed(drafter, 2, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(flat_costs))  # not "auto"
    steep = SequenceFeed(drafter, 3, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(learned({0: 10.0, 1: 16.0, 64: 80.0})),
                         uncapped=True)
    assert len(flat.draft(tokens)) == 64 and len(capped.draft(tokens)) < 8
    own = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match")  # the same sequences, for the expected draft
    for seq in (1, 2, 3):
        own.accept(seq, tokens)
    assert steep.draft(tokens).tolist() == own.draft(3, tokens, CAPPED_AUTO_DRAFT).tolist() == [7, 8, 9, 5, 6]


def test_auto_drafts_as_a_fixed_length_until_its_costs_are_measured():
    """Before a StepCosts has measured anything its costs are the flat prior, a GPU's: trusting them sent 64-token
    drafts to a CPU's first ~100 steps, and noisy costs learned beside other jobs cut drafts worse than no cut
    (0.59x the tokens/s of n_draft 8 beside other jobs). Until measured, "auto" sends the drafter's own draft of at most
    CAPPED_AUTO_DRAFT tokens, whole."""
    wide = Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match")
    unmeasured = StepCosts()
    feed = SequenceFeed(wide, 1, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(unmeasured), uncapped=True)
    assert not unmeasured.measured
    assert len(feed.draft(repetitive())) == CAPPED_AUTO_DRAFT  # not the 64 the flat prior would send


def test_uncapped_only_where_a_full_draft_is_cheap():
    """A full-length draft costing at most UNCAPPED_MAX_COST steps (a GPU) is asked uncapped; dearer (a CPU's
    c(64) ~ 6), the drafter's own thresholds stay: odds far past a match are the least reliable, and trusting
    them made the default 14% slower than match n_draft 16 on 2 CPU cores."""
    tokens = np.asarray([5, 6, 7, 8, 9, 5, 6], dtype=np.int32)
    drafter = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match")

    def sent(c: float, seq: int) -> int:
        cost = VerifyCost([1.0] + [c] * MAX_AUTO_DRAFT, MAX_AUTO_DRAFT)
        return len(SequenceFeed(drafter, seq, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(cost), uncapped=True).draft(tokens))

    assert sent(1.2, 1) == 64
    assert sent(1.6, 2) < 8
    # Dear long drafts: at most CAPPED_AUTO_DRAFT tokens a step, even of a long, likely copy.
    dear = VerifyCost([1.0] + [1.6] * MAX_AUTO_DRAFT, MAX_AUTO_DRAFT)
    wide = Drafter(vocab_size=500, fingerprint=UNTAGGED, mode="match")
    long_copy = SequenceFeed(wide, 3, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(dear), uncapped=True)
    assert len(long_copy.draft(repetitive())) == CAPPED_AUTO_DRAFT
    cheap = SequenceFeed(wide, 4, MAX_AUTO_DRAFT, policy=DraftLengthPolicy(dear))  # not "auto": no bound
    assert len(cheap.draft(repetitive())) == 64
