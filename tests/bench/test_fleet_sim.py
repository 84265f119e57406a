"""tests/bench/lib/fleet_sim.py and fleet_setups.py: the replay's accounting (steps, drafted, accepted,
tokens), the schedules (concurrent and sequential siblings, routing, a late replica) and the
fleet's lag, on small synthetic requests. No model, no SuffixDecoding; seconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from bench.lib import fleet_sim as fs
from bench.lib.fleet_setups import MatchFleet, MatchLocal, MatchSiloed, PromptLookup

VOCAB = 1000


def _requests(groups: int, samples: int, length: int, seed: int = 0) -> list[fs.Request]:
    rng = np.random.default_rng(seed)
    return [fs.Request(g, np.array([900 + g, 901], dtype=np.int32), rng.integers(0, 800, length).astype(np.int32))
            for g in range(groups) for _ in range(samples)]


class Oracle(fs.Setup):
    """Drafts the recorded continuation (groups of one sample: the prompt names the request)."""

    def __init__(self, k: int, requests: list[fs.Request], cut: int = 8) -> None:
        super().__init__(k)
        self.by_prompt = {int(r.prompt[0]): np.concatenate([r.prompt, r.output]) for r in requests}
        self.full: dict[int, np.ndarray] = {}
        self.cut = cut

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self.full[rid] = self.by_prompt[int(prompt[0])]

    def draft(self, replica: int, rid: int, tokens: np.ndarray) -> Sequence[int]:
        return self.full[rid][len(tokens): len(tokens) + self.cut].tolist()  # type: ignore[no-any-return]


class Recorder(fs.Setup):
    """Drafts nothing; records which replica each request ran on and when."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.starts: list[tuple[int, int, float]] = []  # replica, first prompt token, ms
        self.ends: dict[int, float] = {}
        self.joined: list[tuple[int, float, bool]] = []

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self.starts.append((replica, int(prompt[0]), now))

    def finish(self, replica: int, rid: int, now: float) -> None:
        self.ends[rid] = now

    def join(self, replica: int, now: float, window: bool) -> None:
        self.joined.append((replica, now, window))


def test_no_drafts_one_token_per_step():
    reqs = _requests(3, 1, 20)
    res = fs.simulate(reqs, fs.Setup(1), fs.Schedule())
    assert (res.steps, res.drafted, res.accepted, res.tokens) == (60, 0, 0, 60)
    assert res.tokens_per_step == 1.0 and res.accept_pct == 0.0


def test_perfect_drafts_nine_tokens_per_step_and_the_end_cut():
    reqs = _requests(2, 1, 20)  # 20 tokens: steps of 9, 9, then 2 (the draft reaches the end)
    res = fs.simulate(reqs, Oracle(1, reqs), fs.Schedule())
    assert res.steps == 6 and res.tokens == 40
    assert res.accepted == 2 * (8 + 8 + 2) and res.drafted == 2 * (8 + 8 + 2)
    assert [s for _, s, _, _ in res.per_request] == [3, 3]


def test_draft_longer_than_n_draft_is_cut():
    reqs = _requests(1, 1, 30)
    res = fs.simulate(reqs, Oracle(1, reqs, cut=20), fs.Schedule(), n_draft=4)
    assert res.steps == 6 and res.drafted == 4 * 5 + 4  # the last step drafts 4 of which 4 are left, + 1 cut


def test_accepted_prefix_stops_at_the_first_mismatch():
    assert fs.accepted_prefix([1, 2, 3], np.array([1, 2, 4], dtype=np.int32)) == 2
    assert fs.accepted_prefix([1, 2, 3], np.array([1], dtype=np.int32)) == 1
    assert fs.accepted_prefix([], np.array([1], dtype=np.int32)) == 0


def test_concurrent_siblings_start_together_sequential_ones_after_each_other():
    reqs = _requests(2, 3, 10)
    rec = Recorder(1)
    fs.simulate(reqs, rec, fs.Schedule(interval_ms=1000, concurrent=True))
    assert sorted(t for _, _, t in rec.starts) == [0, 0, 0, 1000, 1000, 1000]
    rec = Recorder(1)
    fs.simulate(reqs, rec, fs.Schedule(interval_ms=1000, concurrent=False))
    by_group: dict[int, list[float]] = {}
    for _, g, t in rec.starts:
        by_group.setdefault(g, []).append(t)
    for times in by_group.values():  # 10 steps of 20 ms each, the next sibling a tick after
        assert np.diff(times).tolist() == [200, 200]


@pytest.mark.parametrize("routing", ["round-robin", "group"])
def test_routing(routing):
    reqs = _requests(4, 4, 5)
    rec = Recorder(4)
    fs.simulate(reqs, rec, fs.Schedule(routing=routing))
    replicas_of: dict[int, set[int]] = {}
    for replica, g, _ in rec.starts:
        replicas_of.setdefault(g, set()).add(replica)
    if routing == "group":
        assert all(len(r) == 1 for r in replicas_of.values()) and len(set().union(*replicas_of.values())) == 4
    else:
        assert all(r == {0, 1, 2, 3} for r in replicas_of.values())


def test_a_late_replica_takes_requests_only_after_it_joined():
    reqs = _requests(8, 2, 5)
    rec = Recorder(3)
    fs.simulate(reqs, rec, fs.Schedule(interval_ms=100, join_after=4, join_window=True))
    assert rec.joined == [(2, 400, True)]
    assert all(t >= 400 for replica, _, t in rec.starts if replica == 2)
    assert any(replica == 2 for replica, _, _ in rec.starts)


def test_fleet_tokens_become_visible_after_the_lag():
    fleet = MatchFleet(2, VOCAB, lag_ms=100)
    prompt = np.array([1, 2], dtype=np.int32)
    fleet.start(0, 7, prompt, 0)
    seq = np.array([1, 2, 10, 11, 12], dtype=np.int32)
    fleet.observe(0, 7, seq, 3, 20)
    for now, expect in ((40, 0), (100, 0), (120, 3)):
        fleet.tick(now)
        assert fleet.pulled_tokens == [0, expect]  # the prompt is not published; nothing comes back to 0
    assert fleet.drafters[1].history_size >= 3
    assert fleet.extra()["pulled_bytes_per_client"] == 4 * 3 / 2


def test_fleet_min_piece_holds_tokens_until_enough_or_the_end():
    fleet = MatchFleet(2, VOCAB, lag_ms=0, min_piece=4)
    fleet.start(0, 1, np.array([5], dtype=np.int32), 0)
    fleet.observe(0, 1, np.array([5, 6, 7], dtype=np.int32), 2, 0)
    fleet.tick(20)
    assert fleet.pulled_tokens[1] == 0
    fleet.finish(0, 1, 20)
    fleet.tick(40)
    assert fleet.pulled_tokens[1] == 2


def _followers(table, ngram):
    tokens, counts = table.lookup(ngram)
    return dict(zip(tokens.tolist(), counts.tolist()))


def test_fleet_counts_reach_every_replica_through_the_draft_view_after_push_refresh_and_pull():
    fleet = MatchFleet(2, VOCAB, lag_ms=1e9, counts=True)  # the history never arrives: counts alone
    counts = fleet.counts
    assert counts is not None and (counts.push_ms, counts.refresh_ms, counts.pull_ms) == (100, 250, 500)
    fleet.start(0, 7, np.array([1, 2], dtype=np.int32), 0)
    # [1] -> 2 four times (the view's 1-gram minimum is 4), [2] -> 3 three times (under it),
    # [1, 2] -> 3 three times (the 2-gram minimum is 3), [3, 1, 2] -> 3 twice (3-grams: 2).
    seq = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    fleet.observe(0, 7, seq, len(seq) - 2, 0)
    fleet.tick(240)  # pushed (replica 0 pushes at 50 + 100 k ms), not yet in the view (refreshed at 250 k)
    assert counts.pushed_rows > 0 and counts.view.published.n_entries == 0
    fleet.tick(260)  # in the view; replica 0 pulls (at 250 + 500 k), replica 1 not yet (at 500 k)
    published = counts.view.published.n_entries
    assert published > 0
    assert (counts.tables[0].n_entries, counts.tables[1].n_entries) == (published, 0)
    fleet.tick(500)
    for table in counts.tables:  # the source's own counts come back to it too, as to a real client
        assert table.n_entries == published
        assert _followers(table, [1]) == {2: 4}
        assert _followers(table, [2]) == {}
        assert _followers(table, [1, 2]) == {3: 3}
        assert _followers(table, [3, 1, 2]) == {3: 2}
    assert fleet.drafters[1].dynamic.n_entries == published
    # Replica 1 drafts from the shared counts for a sequence it never saw (no history, no context).
    assert fleet.drafters[1].draft(99, np.array([5, 3, 1, 2], dtype=np.int32), 1).tolist() == [3]
    assert fleet.extra()["view_rows_pulled_per_client"] == published


def test_a_siloed_replica_gets_its_own_counts_back_and_never_another_replicas():
    silo = MatchSiloed(2, VOCAB)
    seq = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    silo.start(0, 7, seq[:2], 0)
    silo.observe(0, 7, seq, len(seq) - 2, 0)
    silo.tick(1000)
    own, other = (c.tables[0] for c in silo.counts)
    assert _followers(own, [1, 2]) == {3: 3} and other.n_entries == 0


def test_fleet_without_counts_leaves_the_dynamic_table_empty():
    fleet = MatchFleet(2, VOCAB, lag_ms=0)
    assert fleet.counts is None and fleet.drafters[1].dynamic is None
    assert "view_rows_pulled_per_client" not in fleet.extra()


def test_sharing_helps_a_repeated_output_and_prompt_lookup_does_not_share():
    # Every request has the same output after a distinct prompt: the fleet learns it from the
    # others, prompt lookup never does.
    out = np.arange(100, 160, dtype=np.int32)
    reqs = [fs.Request(g, np.array([900 + g], dtype=np.int32), out) for g in range(12)]
    sched = fs.Schedule(interval_ms=2000, routing="round-robin")
    pl = fs.simulate(reqs, PromptLookup(4, VOCAB), sched)
    local = fs.simulate(reqs, MatchLocal(4, VOCAB), sched)
    fleet = fs.simulate(reqs, MatchFleet(4, VOCAB, lag_ms=100), sched)
    assert pl.tokens_per_step == pytest.approx(1.0)
    assert fleet.tokens_per_step > local.tokens_per_step > pl.tokens_per_step


@pytest.mark.parametrize(("args", "message"), [
    (["--workloads", "rollouts"], "unknown workloads ['rollouts']"),
    (["--workloads", "repeated", "--schedules", "concurrent"], "no schedule of repeated contains 'concurrent'"),
    (["--setups", "fleet,sd"], "unknown setups ['sd']"),
])
def test_the_benchmark_refuses_names_it_has_not(args, message, capsys):
    """A misspelt workload, setup or schedule is a usage error naming the choices, not a traceback or an empty run."""
    from bench import bench_fleet_history

    with pytest.raises(SystemExit) as e:
        bench_fleet_history.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
