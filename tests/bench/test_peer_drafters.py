"""tests/bench/lib/peer_drafters.py: the vLLM and transformers lookup rules on hand examples and
against a plain reference, and the replay's counting with fake drafters. Needs neither
SuffixDecoding built nor vLLM/transformers installed (one test uses SuffixDecoding if built)."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.lib import peer_drafters as pd

ROOT = Path(__file__).resolve().parents[2]

# --- the lookup rules -------------------------------------------------------------------------


def test_vllm_docstring_example():
    # vLLM's own example: [4,2,3] has no earlier match, [2,3] does; 3 tokens follow it.
    assert pd.VllmNgram(min_n=2, max_n=3).draft([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]


def test_vllm_prefers_the_longest_ngram_then_the_earliest_occurrence():
    ctx = [5, 2, 3, 7, 1, 2, 3, 9, 1, 2, 3]
    # [1,2,3] occurs at 4 (the longest match); the bigram [2,3] would have matched earlier, at 1.
    assert pd.VllmNgram().draft(ctx, 8) == [9, 1, 2, 3]
    # same length twice: the leftmost occurrence wins, the draft is cut at n_draft
    assert pd.VllmNgram().draft([1, 2, 7, 1, 2, 8, 1, 2], 2) == [7, 1]
    assert pd.VllmNgram().draft([1, 2, 7, 1, 2, 8, 1, 2], 8) == [7, 1, 2, 8, 1, 2]


def test_vllm_caps_the_ngram_at_max_n():
    ctx = [1, 2, 3, 4, 5, 8, 0, 1, 2, 3, 4, 5, 9, 0, 1, 2, 3, 4, 5]
    # max 5: [1..5] is the longest counted, first at 0, followed by 8; the 6-gram [0, 1..5]
    # (first at 6, followed by 9) is longer but beyond max_n
    assert pd.VllmNgram(2, 5).draft(ctx, 2) == [8, 0]
    assert pd.VllmNgram(2, 6).draft(ctx, 2) == [9, 0]
    assert pd.VllmNgram(2, 9).draft(ctx, 2) == [9, 0]


def test_vllm_needs_min_n():
    assert pd.VllmNgram(2, 5).draft([4, 5, 6, 5], 8) == []  # only the unigram [5] recurs
    assert pd.VllmNgram(1, 5).draft([4, 5, 6, 5], 8) == [6, 5]
    for ctx in ([], [1], [1, 1], [1, 2]):
        assert pd.VllmNgram(2, 5).draft(ctx, 8) == []


def test_vllm_overlapping_match_and_the_older_disjoint_variant():
    # PR #22437's KMP allows the earlier occurrence to overlap the suffix: [7,7,7] at 0, then [7]
    assert pd.VllmNgram(2, 5).draft([7, 7, 7, 7], 8) == [7]
    # before it, vLLM searched context[:-n]: [7,7,7] is not in [7]; [7,7] is in [7,7] at 0
    assert pd.VllmNgram(2, 5, disjoint=True).draft([7, 7, 7, 7], 8) == [7, 7]
    assert pd.VllmNgram(2, 5, disjoint=True).draft([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]
    assert pd.VllmNgram(2, 5, disjoint=True).draft([2, 3, 2, 3], 4) == [2, 3]
    assert pd.VllmNgram(2, 5, disjoint=True).draft([2, 3, 2], 4) == []
    assert pd.VllmNgram(1, 5, disjoint=True).draft([2, 3, 2], 4) == [3, 2]


def test_transformers_prompt_lookup():
    t = pd.TransformersPromptLookup(max_ngram=2)
    assert t.draft([1, 2, 3, 1, 2], 8) == [3, 1, 2]
    # the bigram [2,3] occurs at 1, the trigram would have matched at 4: max 2 finds the bigram
    assert t.draft([5, 2, 3, 7, 1, 2, 3, 9, 1, 2, 3], 8) == [7, 1, 2, 3, 9, 1, 2, 3]
    # falls back to the unigram, leftmost
    assert t.draft([4, 5, 6, 5], 8) == [6, 5]
    assert t.draft([6, 1, 6, 2, 6], 8) == [1, 6, 2, 6]
    # windows overlapping the suffix count; only the suffix itself is excluded
    assert t.draft([7, 7, 7, 7], 8) == [7, 7]
    assert t.draft([1, 1], 8) == [1]
    for ctx in ([], [1], [1, 2], [1, 2, 3]):
        assert t.draft(ctx, 8) == []
    assert t.draft(np.array([9, 8, 9, 8, 9], dtype=np.int32), 3) == [8, 9]  # [8, 9] first at 1


def _reference(ctx: list[int], min_n: int, max_n: int, k: int, disjoint: bool = False) -> list[int]:
    """The rules spelled out: n from max_n down, the leftmost earlier occurrence of the last n."""
    length = len(ctx)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        last_start = length - 2 * n if disjoint else length - n - 1
        for j in range(0, last_start + 1):
            if ctx[j : j + n] == ctx[length - n :]:
                return ctx[j + n : j + n + k]
    return []


@pytest.mark.parametrize("disjoint", [False, True])
def test_rules_match_the_plain_reference(disjoint):
    rng = random.Random(7)
    vllm, tf = pd.VllmNgram(2, 5, disjoint=disjoint), pd.TransformersPromptLookup(2)
    for _ in range(600):
        ctx = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        k = rng.randrange(1, 9)
        assert vllm.draft(ctx, k) == _reference(ctx, 2, 5, k, disjoint), ctx
        if not disjoint:
            assert tf.draft(ctx, k) == _reference(ctx, 1, 2, k), ctx


# --- the replay's counting ----------------------------------------------------------------------


class NextTokens(pd.PeerDrafter):
    """On np.arange tokens the next token is always last + 1: drafts `good` right ones, then `bad` wrong."""

    name = "fake"

    def __init__(self, good: int, bad: int = 0) -> None:
        self.good, self.bad = good, bad

    def draft(self, context, n_draft):
        v = int(context[-1])
        return [v + 1 + j for j in range(self.good)] + [-1] * self.bad


def test_replay_counts_steps_and_tokens():
    tokens = np.arange(35, dtype=np.int32)
    r = pd.replay(NextTokens(good=2, bad=1), tokens, n_ctx=10, n_draft=8)
    # chunks at 0, 10, 20 (20 + 10 < 35); each: lengths 1 -> 4 -> 7 -> 10, three steps
    assert (r["chunks"], r["steps"], r["drafted"], r["accepted"]) == (3, 9, 27, 18)
    assert r["tokens_per_step"] == pytest.approx(27 / 9)
    assert r["accept_pct"] == pytest.approx(100 * 18 / 27)


class SlowNextTokens(NextTokens):
    """NextTokens whose draft calls take at least DRAFT_S each and whose observe calls at least OBSERVE_S."""

    DRAFT_S, OBSERVE_S = 0.004, 0.003

    def draft(self, context, n_draft):
        time.sleep(self.DRAFT_S)
        return super().draft(context, n_draft)

    def observe(self, tokens):
        time.sleep(self.OBSERVE_S)


def test_replay_times_the_draft_calls_alone():
    r = pd.replay(SlowNextTokens(good=2, bad=1), np.arange(35, dtype=np.int32), n_ctx=10, n_draft=8)
    assert (r["steps"], r["drafted"]) == (9, 27)
    # The draft calls' time: at least their sleeps, and not the observe calls' (the whole replay has both).
    assert r["draft_seconds"] >= 9 * SlowNextTokens.DRAFT_S
    assert r["seconds"] >= r["draft_seconds"] + 9 * SlowNextTokens.OBSERVE_S
    assert r["us_per_drafted_token"] == pytest.approx(1e6 * r["draft_seconds"] / 27)
    assert r["feed_seconds"] == 0.0 and r["corpus_streams"] == 0


def test_replay_skips_a_chunk_ending_exactly_at_the_end():
    r = pd.replay(NextTokens(good=0), np.arange(30, dtype=np.int32), n_ctx=10)
    assert (r["chunks"], r["steps"], r["drafted"], r["accepted"]) == (2, 18, 0, 0)
    assert r["tokens_per_step"] == 1.0 and r["accept_pct"] == 0.0
    assert pd.replay(NextTokens(good=0), np.arange(10, dtype=np.int32), n_ctx=10)["chunks"] == 0


def test_replay_stops_accepting_at_the_chunk_end():
    tokens = np.arange(6, dtype=np.int32)
    r = pd.replay(NextTokens(good=8), tokens, n_ctx=5, n_draft=8)
    # one step: 4 of the 8 drafted tokens fill the chunk, no model token after them
    assert (r["steps"], r["drafted"], r["accepted"], r["tokens_per_step"]) == (1, 8, 4, 4.0)
    r = pd.replay(NextTokens(good=8), np.arange(11, dtype=np.int32), n_ctx=10, n_draft=8)
    assert (r["steps"], r["drafted"], r["accepted"], r["tokens_per_step"]) == (1, 8, 8, 9.0)


class Recorder(NextTokens):
    def __init__(self) -> None:
        super().__init__(good=3, bad=1)
        self.requests: list[list[int]] = []

    def start_chunk(self, prompt):
        self.requests.append(prompt.tolist())

    def observe(self, tokens):
        self.requests[-1].extend(tokens.tolist())


def test_replay_tells_a_stateful_method_every_appended_token():
    rec = Recorder()
    tokens = np.arange(100, dtype=np.int32)
    r = pd.replay(rec, tokens, n_ctx=16)
    assert r["chunks"] == 6 and rec.requests == [list(range(s, s + 16)) for s in range(0, 96, 16)]


def test_stateless_rules_cannot_be_fed():
    with pytest.raises(TypeError):
        pd.replay(pd.VllmNgram(), np.arange(20, dtype=np.int32), n_ctx=8, corpus_streams=[np.arange(5, dtype=np.int32)])


def test_accepted_tree_is_the_longest_matching_root_path():
    target = np.array([1, 2, 3, 4], dtype=np.int32)
    # root children 9 and 1; under 1: 8 and 2; under 2: 3
    assert pd.accepted_tree([9, 1, 8, 2, 3], [-1, -1, 1, 1, 3], target) == 3
    assert pd.accepted_tree([1, 2, 7], [-1, 0, 0], target) == 2  # 7 is a sibling of 2, not its child
    assert pd.accepted_tree([2, 1], [-1, -1], target) == 1
    assert pd.accepted_tree([], [], target) == 0
    assert pd.accepted_tree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], target[:2]) == 2  # cut at the chunk end


class TreeFake(pd.PeerDrafter):
    name = "tree-fake"
    tree = True

    def draft_tree(self, context, n_draft):
        v = int(context[-1])
        return [-1, v + 1, -2, v + 2], [-1, -1, 1, 1]  # path v+1, v+2 under a wrong sibling


def test_replay_scores_trees_by_the_accepted_path():
    r = pd.replay(TreeFake(), np.arange(11, dtype=np.int32), n_ctx=10)
    # lengths 1 -> 4 -> 7 -> 10: 3 steps of 4 nodes, 2 accepted each
    assert (r["steps"], r["drafted"], r["accepted"], r["tokens_per_step"]) == (3, 12, 6, 3.0)


# --- SuffixDecoding ----------------------------------------------------------------------------


def test_suffix_decoding_missing_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # as if not built
    with pytest.raises(pd.SuffixDecodingUnavailable, match="build_suffix_decoding.py"):
        pd.SuffixDecodingPeer(lib_dir=tmp_path)


def test_suffix_decoding_replay_if_built():
    try:
        peer = pd.SuffixDecodingPeer()
        tree = pd.SuffixDecodingPeer(use_tree_spec=True, max_spec_tokens=8)
    except pd.SuffixDecodingUnavailable as e:
        # tests/run_all.sh builds it before the tests: missing here is a failure, not a skip.
        pytest.fail(f"SuffixDecoding is not built: {e}", pytrace=False)
    pattern = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int32)
    tokens = np.tile(pattern, 20)
    for method in (peer, tree):
        r = pd.replay(method, tokens, n_ctx=64, corpus_streams=[pattern])
        assert r["chunks"] == 2 and r["corpus_streams"] == 1
        # fed the repeating pattern, the drafts are right from the second token on
        assert r["accept_pct"] > 90 and r["tokens_per_step"] > 5
