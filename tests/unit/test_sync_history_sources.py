"""MirroredRuns: every token of a remote sequence appended once, whatever order and overlap its records come in; a prompt the
store kept only a sibling's copy of put back in front of a sequence (Prompts)."""

from __future__ import annotations

import numpy as np

from ngramcache.client.kernel.history_sources import MirroredRuns, Prompts, SourceIds, prompt_group


def seq_tokens(start: int, stop: int) -> np.ndarray:
    """The tokens of a record at [start, stop): token i of the sequence is 100 + i, so a part shows where it sits."""
    return np.arange(100 + start, 100 + stop, dtype=np.int32)


def parts(runs: MirroredRuns, offset: int, stop: int, client: str = "c", seq: int = 1) -> list[tuple[int, list[int]]]:
    return [(source, part.tolist()) for source, part in runs.fresh(client, seq, offset, seq_tokens(offset, stop))]


def src(offset: int, client: str = "c", seq: int = 1) -> int:
    return SourceIds.source(client, seq, offset)


def test_in_order_records_continue_one_source_and_a_repeat_appends_nothing() -> None:
    runs = MirroredRuns()
    assert parts(runs, 0, 8) == [(src(0), seq_tokens(0, 8).tolist())]
    assert parts(runs, 8, 12) == [(src(0), seq_tokens(8, 12).tolist())]
    assert parts(runs, 0, 8) == [] and parts(runs, 8, 12) == []  # the same records by the other pull
    assert runs.held("c", 1) == [(0, 12)]


def test_an_overlapping_record_appends_only_its_new_suffix() -> None:
    runs = MirroredRuns()
    parts(runs, 0, 8)
    assert parts(runs, 4, 12) == [(src(0), seq_tokens(8, 12).tolist())]
    assert runs.held("c", 1) == [(0, 12)]


def test_records_out_of_order_fill_the_holes_once() -> None:
    runs = MirroredRuns()
    assert parts(runs, 16, 24) == [(src(16), seq_tokens(16, 24).tolist())]
    assert parts(runs, 0, 8) == [(src(0), seq_tokens(0, 8).tolist())]
    # [8, 16) continues the run that ends at 8 and stops where the run from 16 starts.
    assert parts(runs, 8, 20) == [(src(0), seq_tokens(8, 16).tolist())]
    assert parts(runs, 0, 24) == []
    assert parts(runs, 24, 26) == [(src(16), seq_tokens(24, 26).tolist())]  # after the run that ends at 24
    assert runs.held("c", 1) == [(0, 16), (16, 26)]


def test_a_record_spanning_two_holes_appends_both_under_the_runs_they_continue() -> None:
    runs = MirroredRuns()
    parts(runs, 0, 4)
    parts(runs, 8, 12)
    assert parts(runs, 0, 16) == [(src(0), seq_tokens(4, 8).tolist()), (src(8), seq_tokens(12, 16).tolist())]
    assert parts(runs, 2, 14) == []


def test_sequences_and_clients_are_apart_and_the_oldest_sequence_is_forgotten_beyond_the_limit() -> None:
    runs = MirroredRuns(limit=2)
    parts(runs, 0, 4, client="a")
    parts(runs, 0, 4, client="b")
    assert parts(runs, 0, 4, client="a", seq=2) == [(src(0, "a", 2), seq_tokens(0, 4).tolist())]  # another seq
    # Three sequences known with room for two: ("a", 1) went, so its record would be appended again.
    assert runs.held("a", 1) == [] and runs.held("b", 1) == [(0, 4)]
    assert len(parts(runs, 0, 4, client="a")) == 1


def test_an_empty_record_appends_nothing() -> None:
    runs = MirroredRuns()
    assert parts(runs, 5, 5) == []
    assert parts(runs, 0, 3) == [(src(0), seq_tokens(0, 3).tolist())]


def test_prompts_are_kept_by_group_bounded_and_put_back_only_at_their_length() -> None:
    prompts = Prompts(max_tokens=5)
    p, q = np.array([1, 2, 3], np.int32), np.array([4, 5, 6], np.int32)
    prompts.learn(prompt_group(p), 0, p)
    prompts.learn("rollout-1", 0, p)  # not named by its tokens: not a prompt
    prompts.learn(prompt_group(p), 3, p)  # not at offset 0
    assert prompts.start(prompt_group(p), 3).tolist() == [1, 2, 3]
    assert prompts.start(prompt_group(p), 4) is None and prompts.start("rollout-1", 3) is None
    prompts.learn(prompt_group(q), 0, q)  # 6 tokens > 5: the least recently seen goes
    assert prompts.start(prompt_group(p), 3) is None and prompts.start(prompt_group(q), 3).tolist() == [4, 5, 6]
    assert prompts.tokens == 3


def test_a_sequence_first_seen_after_its_groups_prompt_is_appended_whole() -> None:
    runs = MirroredRuns()
    p = np.array([1, 2, 3], np.int32)
    g = prompt_group(p)
    assert [(s, t.tolist()) for s, t in runs.fresh("a", 1, 0, p, g)] == [(src(0, "a"), [1, 2, 3])]
    assert [(s, t.tolist()) for s, t in runs.fresh("b", 1, 3, np.array([9], np.int32), g)] == [(src(0, "b"),
                                                                                                  [1, 2, 3, 9])]
    assert runs.held("b", 1) == [(0, 4)]
    # b's own copy arriving later (it was stored after all, or came by another pull) is held already.
    assert runs.fresh("b", 1, 0, p, g) == []
    # A sequence seen before continues as it is: the prompt goes only in front of a first record.
    assert [t.tolist() for _, t in runs.fresh("a", 1, 5, np.array([7], np.int32), g)] == [[7]]
    ids = SourceIds()
    assert ids.whole("a", 1, g, 0, p)[0] == 0
    offset, tokens = ids.whole("c", 4, g, 3, np.array([8], np.int32))
    assert (offset, tokens.tolist()) == (0, [1, 2, 3, 8])
