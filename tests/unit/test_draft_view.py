"""The draft view: CountTable.view_diff against a reference, removals, and DraftView's change log."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramcache import CountTable, InvalidArgumentError
from ngramcache.cache_service.draft_view import DraftView, ViewPolicy


def table_dict(table: CountTable) -> dict[tuple[int, ...], dict[int, int]]:
    out: dict[tuple[int, ...], dict[int, int]] = {}
    for r in table.to_rows():
        out.setdefault(tuple(int(t) for t in r[1:1 + r[0]]), {})[int(r[5])] = int(r[6])
    return out


def reference_view(full: dict[tuple[int, ...], dict[int, int]], top_k: int, min_total: list[int]):
    view = {}
    for key, followers in full.items():
        if sum(followers.values()) < min_total[len(key) - 1]:
            continue
        best = sorted(followers.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]
        view[key] = dict(best)
    return view


def apply(published: CountTable, rows: np.ndarray) -> None:
    published.assign_rows(rows, zero_removes=True)
    published.check_integrity()


token_lists = st.lists(st.integers(0, 5), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=6), st.integers(1, 4), st.lists(st.integers(1, 6), min_size=4, max_size=4))
def test_view_with_every_change_equals_the_reference(steps, top_k, min_total):
    """With min_change_pct 0, applying each diff keeps the published table exactly the reference view."""
    full, published = CountTable(), CountTable()
    for tokens in steps:
        arr = np.array(tokens, dtype=np.int32)
        before = full.to_rows()
        full.update(arr)
        changed = np.concatenate([before, full.to_rows()]).astype(np.int64)  # keys of the step (a superset)
        apply(published, full.view_diff(published, changed, top_k=top_k, min_total=min_total, min_change_pct=0))
        assert table_dict(published) == reference_view(table_dict(full), top_k, min_total)


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=8), st.integers(0, 100))
def test_counts_in_the_view_stay_within_min_change_pct(steps, pct):
    full, published = CountTable(), CountTable()
    for tokens in steps:
        full.update(np.array(tokens, dtype=np.int32))
        apply(published, full.view_diff(published, full.to_rows().astype(np.int64), top_k=8, min_total=(1, 1, 1, 1),
                                        min_change_pct=pct))
        truth = table_dict(full)
        for key, followers in table_dict(published).items():
            for token, count in followers.items():
                assert abs(truth[key][token] - count) * 100 <= pct * count
        assert set(table_dict(published)) == set(truth)  # every key with a total >= 1 is there


def test_a_key_leaves_the_view_when_outranked_and_zero_removes_it():
    full, published = CountTable(), CountTable()
    full.add([1], 2, 5)
    full.add([1], 3, 4)
    apply(published, full.view_diff(published, None, top_k=1, min_total=(1, 1, 1, 1), min_change_pct=0))
    assert table_dict(published) == {(1,): {2: 5}}
    full.add([1], 3, 2)  # 3 now leads with 6
    rows = full.view_diff(published, None, top_k=1, min_total=(1, 1, 1, 1), min_change_pct=0)
    assert sorted(map(tuple, rows[:, 5:].tolist())) == [(2, 0), (3, 6)]
    apply(published, rows)
    assert table_dict(published) == {(1,): {3: 6}}
    assert published.n_entries == 1


def test_removing_every_follower_leaves_the_key_unfound_and_reinsertable():
    t = CountTable()
    t.add([7, 8], 9, 3)
    t.assign_rows(np.array([[2, 7, 8, -1, -1, 9, 0]], dtype=np.int64), zero_removes=True)
    assert t.n_entries == 0 and len(t.to_rows()) == 0
    tokens, counts = t.lookup([7, 8])
    assert len(tokens) == 0 and len(counts) == 0
    t.check_integrity()
    t.assign_rows(np.array([[2, 7, 8, -1, -1, 9, 2]], dtype=np.int64))
    assert table_dict(t) == {(7, 8): {9: 2}}
    t.check_integrity()


def test_zero_counts_are_refused_without_zero_removes():
    with pytest.raises(InvalidArgumentError, match="count 0"):
        CountTable().assign_rows(np.array([[1, 1, -1, -1, -1, 2, 0]], dtype=np.int64))


def test_view_diff_checks_its_arguments():
    t = CountTable()
    with pytest.raises(InvalidArgumentError, match="another table"):
        t.view_diff(t)
    with pytest.raises(InvalidArgumentError, match="top_k"):
        t.view_diff(CountTable(), top_k=0)
    with pytest.raises(InvalidArgumentError, match="min_total"):
        t.view_diff(CountTable(), min_total=(1, 2))
    with pytest.raises(InvalidArgumentError, match="vocabulary|outside"):
        t.view_diff(CountTable(), np.array([[1, -5, -1, -1, -1, 0, 1]], dtype=np.int64))


def test_draft_view_log_serves_changes_and_reloads_when_it_cannot():
    full = CountTable()
    full.add([1], 2, 10)
    view = DraftView(full, ViewPolicy(top_k=2, min_total=(1, 1, 1, 1), min_change_pct=0, max_rows=100, log_rows=3))
    first_id = view.view_id
    _, version, rows = view.export_rows()
    assert version == 1 and table_dict_from_rows(rows) == {(1,): {2: 10}}
    for count in (11, 12, 13, 14):
        full.add([1], 2, 1)
        changed = full.to_rows().astype(np.int64)
        view.apply(*view.diff(changed, 1.0))
        assert view.version == count - 9 and view.scale == 1
    assert table_dict_from_rows(view.changes_since(first_id, 4)) == {(1,): {2: 14}}
    assert len(view.changes_since(first_id, view.version)) == 0
    assert view.changes_since(first_id, 1) is None  # trimmed from the 3-row log
    assert view.changes_since("another replica", 4) is None
    assert view.changes_since(first_id, 99) is None


def test_draft_view_over_max_rows_doubles_its_key_minimum():
    full = CountTable()
    for token in range(10):
        full.add([token], 0, token + 1)  # keys with totals 1..10
    view = DraftView(full, ViewPolicy(top_k=1, min_total=(1, 1, 1, 1), min_change_pct=0, max_rows=4))
    assert view.scale == 8  # 10 keys, then 3 (totals >= 8 at scale 8)
    assert view.published.n_entries <= 4
    assert set(table_dict(view.published)) == {(7,), (8,), (9,)}


def test_draft_view_over_its_rate_removes_the_keys_under_twice_the_minimum():
    full = CountTable()
    policy = ViewPolicy(top_k=1, min_total=(1, 1, 1, 1), min_change_pct=0, max_rows=100, max_rows_per_second=5,
                        burst_seconds=1, settle_seconds=30)
    view = DraftView(full, policy)
    for token in range(4):
        full.add([token], 0, 1)
    view.apply(*view.diff(full.to_rows().astype(np.int64), 1.0))  # 4 rows: within 5 rows/s
    assert view.scale == 1 and set(table_dict(view.published)) == {(0,), (1,), (2,), (3,)}
    for token in range(10):
        full.add([token], 0, 1 if token < 2 else 2)  # 10 more rows: over the rate
    rows, scale = view.diff(full.to_rows().astype(np.int64), 1.0)
    view.apply(rows, scale)
    assert scale == 2  # totals: tokens 0-1 have 2, 2-3 have 3, 4-9 have 2: all >= 2 still
    assert set(table_dict(view.published)) == {(t,) for t in range(10)}
    full.add([50], 0, 1)
    for token in range(20, 30):
        full.add([token], 0, 4)
    rows, scale = view.diff(full.to_rows().astype(np.int64), 0.5)  # 10 rows in 0.5 s: over 5 rows/s
    view.apply(rows, scale)
    assert scale == 4  # the keys under 4 leave in the same change
    assert set(table_dict(view.published)) == {(t,) for t in range(20, 30)}
    assert view.changes_since(view.view_id, 2) is not None  # no reload: clients follow the log
    for _ in range(3):  # quiet for settle_seconds: the minimum halves if what comes back fits
        rows, scale = view.diff(np.empty((0, 7), dtype=np.int64), 10.0)
        view.apply(rows, scale)
    assert view.scale == 2
    assert set(table_dict(view.published)) == {(t,) for t in [*range(10), *range(20, 30)]}


def table_dict_from_rows(rows: np.ndarray) -> dict[tuple[int, ...], dict[int, int]]:
    t = CountTable()
    t.assign_rows(np.ascontiguousarray(rows, dtype=np.int64), zero_removes=True)
    return table_dict(t)


def test_wait_newer_returns_at_the_next_change_and_at_once_when_behind():
    full = CountTable()
    full.add([1], 2, 10)
    view = DraftView(full, ViewPolicy(top_k=2, min_total=(1, 1, 1, 1), min_change_pct=0, max_rows=100))

    async def scenario() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await view.wait_newer(view.view_id, view.version, 0.2)  # nothing changes: the whole wait
        idle = loop.time() - t0

        def change() -> None:
            full.add([1], 2, 5)
            view.apply(*view.diff(full.to_rows().astype(np.int64), 1.0))

        version = view.version
        loop.call_later(0.05, change)
        t0 = loop.time()
        await view.wait_newer(view.view_id, version, 5.0)  # woken by the change, not the 5 s
        woken = loop.time() - t0
        t0 = loop.time()
        await view.wait_newer(view.view_id, version, 5.0)  # already past that version
        behind = loop.time() - t0
        t0 = loop.time()
        await view.wait_newer("another replica", view.version, 5.0)  # another incarnation: reload at once
        other = loop.time() - t0
        return idle, woken, behind, other

    idle, woken, behind, other = asyncio.run(scenario())
    assert idle >= 0.19
    assert 0.04 <= woken < 1.0
    assert view.version == 2
    assert behind < 0.05 and other < 0.05
