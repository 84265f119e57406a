"""Drafter.draft_scored: each drafted token's odds, from the counts (compatible) or the matches (match mode), the drafts unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramcache import UNTAGGED, CountTable, Drafter


def arr(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_compatible_odds_are_the_deciding_counts_ratio():
    # The dynamic table (strict thresholds): key (5) has 6 x3, 7 x1 (total 4, 75%: passes at size 1);
    # then key (6) has only 3 samples (< 4) but (5, 6) has 8 x3 of 3 (passes at size 2).
    dynamic = CountTable()
    for stream in [[5, 6, 8]] * 3 + [[5, 7]]:
        dynamic.update(arr(stream), ngram_min=1, ngram_max=4)
    drafter = Drafter(dynamic=dynamic, vocab_size=16, fingerprint=UNTAGGED)
    tokens, odds = drafter.draft_scored(1, arr([9, 5]), 8)
    assert list(tokens) == [6, 8]
    assert odds.dtype == np.float32
    assert list(odds) == pytest.approx([3 / 5, 3 / 4])  # count / (total + 1)
    assert list(drafter.draft(1, arr([9, 5]), 8)) == [6, 8]


def test_context_odds_use_the_lax_thresholds_counts():
    drafter = Drafter(vocab_size=16, fingerprint=UNTAGGED)
    seq = arr([1, 2, 3, 1, 2, 3, 1, 2])
    drafter.accept(4, seq)
    tokens, odds = drafter.draft_scored(4, seq, 1)
    # The longest key at the tail, (3, 1, 2), was followed by 3 once: 1 / (1 + 1).
    assert list(tokens) == [3] and list(odds) == pytest.approx([0.5])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=st.lists(st.integers(0, 5), min_size=2, max_size=60), n_draft=st.integers(1, 16),
       mode=st.sampled_from(["compatible", "match"]))
def test_scored_drafts_equal_plain_drafts(seq, n_draft, mode):
    drafter = Drafter(vocab_size=8, fingerprint=UNTAGGED, mode=mode)
    tokens = arr(seq)
    drafter.accept(3, tokens[: len(seq) // 2])
    drafter.accept(3, tokens)
    plain = drafter.draft(3, tokens, n_draft)
    scored, odds = drafter.draft_scored(3, tokens, n_draft)
    assert list(scored) == list(plain)
    assert len(odds) == len(scored)
    assert all(0.0 < p <= 1.0 for p in odds)
    again, odds_again = drafter.draft_scored(3, tokens, n_draft)
    assert list(again) == list(scored) and list(odds_again) == list(odds)  # deterministic


def test_match_odds_grow_with_the_match_length():
    long_text = arr([*range(20, 40), 1, *range(20, 40)])
    drafter = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match")
    drafter.accept(1, long_text[:-10])
    tokens, odds = drafter.draft_scored(1, long_text[:-10], 4)
    assert list(tokens) == list(long_text[-10:-6])
    # One occurrence, every token its share 1 / (1 + prior / L) (L >= 10, the tokens matched).
    assert len(set(odds.tolist())) == 1 and 1 / 1.1 - 1e-6 <= odds[0] < 1.0
    shorter = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match")
    text = arr([20, 21, 22, 23, 1, 22, 23])  # the tail (22, 23) matched over 2 tokens only
    shorter.accept(1, text)
    few, odds_short = shorter.draft_scored(1, text, 1)
    assert list(few) == [1] and odds_short[0] < odds[0]


def test_uncapped_match_drafts_run_to_n_draft_with_their_odds():
    """uncapped (the adapters' n_draft="auto"): a 2-token match is not cut at 2 tokens (length_factor) nor where
    its probability falls under min_prob; the capped draft is its prefix. Compatible mode: the same drafts."""
    seq = arr([5, 6, 7, 8, 9, 5, 6])
    match = Drafter(vocab_size=16, fingerprint=UNTAGGED, mode="match")
    match.accept(1, seq)
    capped, _ = match.draft_scored(1, seq, 32)
    full, odds = match.draft_scored(1, seq, 32, uncapped=True)
    assert 0 < len(capped) < 32 and len(full) == 32 and list(full[: len(capped)]) == list(capped)
    assert len(odds) == 32 and float(np.prod(odds.astype(np.float64))) < 0.25  # what min_prob would have cut
    compatible = Drafter(vocab_size=16, fingerprint=UNTAGGED)
    compatible.accept(1, seq)
    assert list(compatible.draft_scored(1, seq, 32, uncapped=True)[0]) == list(compatible.draft(1, seq, 32))


def test_an_occurrence_in_the_sequence_outvotes_other_sequences_by_sequence_weight():
    """Two earlier sequences (the history) go on with 7 after (1, 2, 3), the sequence itself with 4: one vote
    against two by default; with sequence_weight 4 (and in an uncapped draft, which uses at least 4) the
    sequence's own continuation wins. (The count tables' walk is off: it would follow the sequence's counts.)"""
    seq = arr([1, 2, 3, 4, 5, 6, 10, 1, 2, 3])

    def drafter(**params: float) -> Drafter:
        d = Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match", match_params={"count_option": 0, **params})
        d.add_history(40, arr([1, 2, 3, 7, 8, 9]))
        d.add_history(41, arr([1, 2, 3, 7, 8, 9]))
        d.flush_history()  # the second source's text is held back for a piece until then
        d.accept(1, seq)
        return d

    assert drafter().draft_scored(1, seq, 3)[0].tolist() == [7, 8, 9]
    assert drafter(sequence_weight=4).draft_scored(1, seq, 3)[0].tolist() == [4, 5, 6]
    assert drafter().draft_scored(1, seq, 3, uncapped=True)[0].tolist()[:3] == [4, 5, 6]


def test_an_uncapped_draft_from_the_history_gives_way_to_the_sequences_own_text():
    """The tail (30, 31) is only in the history, which goes on 40 41 42 43 70...; the sequence itself has
    40 41 42 43 followed by 80. Once the draft has copied those 4 tokens (splice_min 4 in an uncapped draft) it
    goes on with the sequence's 80 81 82 ..., not the history's 70."""
    seq = arr([40, 41, 42, 43, 80, 81, 82, 90, 30, 31])
    d = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    d.add_history(40, arr([30, 31, 40, 41, 42, 43, 70, 71, 72, 73]))
    d.accept(1, seq)
    tokens, odds = d.draft_scored(1, seq, 16, uncapped=True)
    assert tokens.tolist() == [40, 41, 42, 43, 80, 81, 82, 90, 30, 31]
    assert len(odds) == len(tokens) and all(0 < o < 1 for o in odds.tolist())
    # Capped (the CPU's drafts), nothing changes: 2 tokens for a 2-token match.
    assert d.draft_scored(1, seq, 16)[0].tolist() == [40, 41]


# A prompt where 5 is mostly followed by 60, and once (after 10 .. 18) by 20 21 ...
RESYNC_PROMPT = [5, 60, 61, 5, 60, 62, 5, 60, 63, 10, 11, 12, 13, 14, 15, 16, 17, 18, 5, 20, 21, 22, 23, 24, 25, 99]


def test_after_new_text_an_uncapped_draft_resumes_the_text_it_was_copying():
    """The answer copied the prompt's 10 .. 17, then wrote new text (50 51) where the prompt has 18, then the
    prompt's 5: nothing ends like the tail (51, 5), and 5 alone is mostly followed by 60. An uncapped draft resumes
    the copied text after the 5 that follows the place it left (20 21 ...: resync_below 4); a capped one follows
    the counts. The drafter's history also holds the sequence itself (a copy that must not count as the text
    being copied, or the draft would resume the answer's own 50 51)."""
    seq = arr([*RESYNC_PROMPT, 10, 11, 12, 13, 14, 15, 16, 17, 50, 51, 5])
    d = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    d.accept(1, seq)
    assert d.history_size > 0  # the sequence is in the history too
    tokens, odds = d.draft_scored(1, seq, 8, uncapped=True)
    assert tokens.tolist() == [20, 21, 22, 23, 24, 25, 99, 10]
    assert odds.tolist() == sorted(odds.tolist()) and 0 < odds[0] < 1  # a copy that held so far tends to go on
    assert d.draft_scored(1, seq, 8)[0].tolist()[:1] == [60]
    # resync_below also applies to capped drafts when set, cut as a match of its anchor (1 token) is.
    capped = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match", match_params={"resync_below": 4})
    capped.accept(1, seq)
    assert capped.draft_scored(1, seq, 8)[0].tolist() == [20]


def test_a_resumed_draft_needs_the_copied_texts_next_token_nearby():
    """The new text is longer than the window allows and the prompt's 5 after the copy's place is too far: the
    uncapped draft falls back to the counts (60 ...)."""
    far = RESYNC_PROMPT[:18] + list(range(30, 50)) + RESYNC_PROMPT[18:]
    seq = arr([*far, 10, 11, 12, 13, 14, 15, 16, 17, 50, 51, 5])
    d = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    d.accept(1, seq)
    assert d.draft_scored(1, seq, 8, uncapped=True)[0].tolist()[:1] == [60]


def test_after_a_substituted_token_an_uncapped_draft_goes_on_past_it():
    """The answer copied the prompt's 10 .. 14, then wrote 99 where the prompt has 15: nothing ends like the tail
    (14, 99) and the copy is too short to resume (resync's anchor), so the drafter had nothing. An uncapped draft
    goes on after the replaced token (16 17 ...); a capped one stays empty. Where the tail has a match of its own
    (a draft the drafter trusts), that draft stays."""
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    seq = arr([*prompt, 10, 11, 12, 13, 14, 99])
    d = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    d.accept(1, seq)
    tokens, odds = d.draft_scored(1, seq, 8, uncapped=True)
    assert tokens.tolist() == [16, 17, 18, 19, 10, 11, 12, 13]
    assert len(odds) == len(tokens) and all(0 < o < 1 for o in odds.tolist())
    assert d.draft_scored(1, seq, 8)[0].tolist() == []
    # (14, 99) also goes on with 50 51 in the prompt: the sequence's own match is drafted.
    matched = arr([*prompt, 14, 99, 50, 51, 10, 11, 12, 13, 14, 99])
    fresh = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    fresh.accept(1, matched)
    assert fresh.draft_scored(1, matched, 4, uncapped=True)[0].tolist() == [50, 51, 10, 11]


def test_a_draft_past_a_replaced_token_does_not_cross_into_another_text():
    """The tail before the new 99 (10 .. 14) ends one history text; what follows it there is another text
    (70 71 ...), not the copied one: nothing is drafted."""
    d = Drafter(vocab_size=128, fingerprint=UNTAGGED, mode="match")
    d.add_history(40, arr([10, 11, 12, 13, 14]))
    d.add_history(41, arr([70, 71, 72, 73]))
    d.flush_history()
    seq = arr([1, 2, 10, 11, 12, 13, 14, 99])
    d.accept(1, seq)
    assert d.draft_scored(1, seq, 8, uncapped=True)[0].tolist() == []


@pytest.mark.parametrize(("name", "value"), [("sequence_weight", 0.5), ("splice_min", 65), ("resync_below", 65)])
def test_the_new_match_params_are_range_checked(name, value):
    with pytest.raises(ValueError, match=rf"match_params\['{name}'\] must be in"):
        Drafter(vocab_size=64, fingerprint=UNTAGGED, mode="match", match_params={name: value})
