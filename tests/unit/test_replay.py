"""The core's llama-lookup-stats replay against the Python reference and a hand-checked case."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import reference
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramcache import UNTAGGED, CountTable, InvalidArgumentError, StaticCache, build_static_from_tokens, replay


def split_calls(flat: np.ndarray) -> list[list[int]]:
    calls, cur = [], []
    for t in flat.tolist():
        if t == -1:
            calls.append(cur)
            cur = []
        else:
            cur.append(t)
    return calls


def test_hand_checked_replay():
    # n_ctx 6 over "1 2 3 1 2 3": the output starts [1]; the first drafts find nothing until
    # the context knows 1 -> 2 (lax thresholds need 2 samples for 1-grams... so none at all
    # from context); with no static cache and an empty dynamic table nothing is drafted,
    # 5 draft calls are made (one per appended token).
    r = replay(np.array([1, 2, 3, 1, 2, 3, 0], dtype=np.int32), 6, 4, 1, 4, None, CountTable(), True)
    assert (r["n_chunks"], r["n_draft_calls"], r["n_drafted"], r["n_accept"]) == (1, 5, 0, 0)
    # llama-lookup-stats' loop is `i_start + n_ctx < n_input`: a chunk ending exactly at the
    # end of the input is not replayed.
    r = replay(np.array([1, 2, 3, 1, 2, 3], dtype=np.int32), 6, 4, 1, 4, None, CountTable(), True)
    assert r["n_chunks"] == 0
    # The second chunk sees the first one through the dynamic table, but its strict
    # thresholds need 2..4 samples: [1,2,3]*2 gives each n-gram one count, still no draft.
    dyn = CountTable()
    r = replay(np.array([1, 2, 3] * 4 + [0], dtype=np.int32), 6, 4, 1, 4, None, dyn, True)
    assert r["n_chunks"] == 2 and r["n_drafted"] == 0
    # After merging, 1-gram (1,) has follower 2 with count 2*2 = 4 (two chunks, twice each).
    assert dyn.lookup([1])[1].tolist() == [4]
    # A third replay over the same text drafts from the dynamic table. Call 1 sees [1]: too
    # short (llama.cpp drafts nothing before 2 tokens). The true token 2 is appended. Call 2
    # sees [1, 2]: 2-gram (1,2) -> 3 has 4 counts (>= 3 strict samples, 100%); then
    # (1,2,3) -> 1 has 2 (>= 2); then 4-grams (1,2,3,1) -> 2 and (2,3,1,2) -> 3 have 2 each.
    # All four match the chunk and fill it.
    r = replay(np.array([1, 2, 3] * 2 + [0], dtype=np.int32), 6, 4, 1, 4, None, dyn, True)
    assert split_calls(r["drafts"]) == [[], [3, 1, 2, 3]]
    assert (r["n_draft_calls"], r["n_drafted"], r["n_accept"]) == (2, 4, 4)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(st.integers(0, 5), min_size=0, max_size=300),
    st.integers(2, 64),
    st.integers(1, 10),
    st.booleans(),
)
def test_replay_matches_reference(vocab, tokens, n_ctx, n_draft, with_static):
    tokens = [t % vocab for t in tokens]
    static, ref_static = None, None
    if with_static:
        import os
        import tempfile

        fd, path = tempfile.mkstemp()
        os.close(fd)
        corpus = [(t * 7 + 3) % vocab for t in tokens[::-1]]
        build_static_from_tokens([np.asarray(corpus, dtype=np.int32)], path, vocab_size=vocab, fingerprint=UNTAGGED)
        static = StaticCache.open(path)
        os.unlink(path)
        ref_static = reference.count_static([corpus])
    dyn = CountTable()
    r = replay(np.asarray(tokens, dtype=np.int32), n_ctx, n_draft, 1, 4, static, dyn, True)
    n_drafted, n_accept, calls, ref_dyn = reference.replay(tokens, n_ctx, n_draft, ref_static)
    assert split_calls(r["drafts"]) == calls
    assert (r["n_drafted"], r["n_accept"], r["n_draft_calls"]) == (n_drafted, n_accept, len(calls))
    assert reference.rows_to_table(dyn.to_rows()) == ref_dyn


def test_replay_arguments():
    t = np.arange(10, dtype=np.int32)
    with pytest.raises(InvalidArgumentError, match="n_ctx"):
        replay(t, 1, 4, 1, 4, None, CountTable())
    with pytest.raises(InvalidArgumentError, match="n_draft"):
        replay(t, 4, 0, 1, 4, None, CountTable())
    with pytest.raises(ValueError, match="int32"):
        replay(t.astype(np.int64), 4, 4, 1, 4, None, CountTable())
