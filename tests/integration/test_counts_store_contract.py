"""One contract for every counts store backend: embedded, a real standalone redis-server, a real 3-master Redis Cluster, a primary and replica under Sentinel."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from helpers.counts import FP, OTHER_FP, VOCAB, apply, as_counter, batch, exported, random_batch, row

from ngramcache.cache_service.counts.layout import fields_and_buckets
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem, ItemOutcome
from ngramcache.client.kernel.errors import (
    BatchTooOldError,
    GenerationNotNewerError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    ResyncRequiredError,
    TokenizerMismatchError,
)
from ngramcache.client.kernel.rows import MAX_VOCAB

pytestmark = pytest.mark.integration

# conftest's backends and Sentinel: the contract holds through redis+sentinel:// too (conftest's
# pytest_generate_tests reads this).
BACKENDS = ("embedded", "standalone", "cluster", "sentinel")


# --------------------------------------------------------------------------- namespaces


def test_create_namespace_is_idempotent_and_bound_to_its_tokenizer(store: CountsStore, namespace: str) -> None:
    info = store.create_namespace(namespace, FP, VOCAB)
    assert info.name == namespace and info.fingerprint == FP.hex() and info.vocab_size == VOCAB
    assert info.token_width == 3
    assert store.create_namespace(namespace, FP.hex().upper(), VOCAB) == info
    assert store.namespace_info(namespace) == info
    with pytest.raises(TokenizerMismatchError):
        store.create_namespace(namespace, OTHER_FP, VOCAB)
    with pytest.raises(TokenizerMismatchError):
        store.create_namespace(namespace, FP, VOCAB + 1)
    with pytest.raises(TokenizerMismatchError):
        apply(store, namespace, "c", 1, batch([row([1], 2)]), fingerprint=OTHER_FP)
    assert exported(store, namespace) == Counter()


def test_ensure_namespace_says_whether_it_created(store: CountsStore, namespace: str) -> None:
    info, created = store.ensure_namespace(namespace, FP, VOCAB)
    assert created and info == store.namespace_info(namespace)
    assert store.ensure_namespace(namespace, FP, VOCAB, buckets=2) == (info, False)
    with pytest.raises(TokenizerMismatchError):
        store.ensure_namespace(namespace, OTHER_FP, VOCAB)


def test_list_namespaces_pages_by_name(store: CountsStore) -> None:
    tag = "l-" + uuid.uuid4().hex[:8]
    names = [f"{tag}-{suffix}" for suffix in ("b", "a", "c.1", "c-0", "A", "d_9")]
    try:
        infos = {name: store.create_namespace(name, FP, VOCAB) for name in names}
        everything = store.list_namespaces()
        assert [i.name for i in everything] == sorted(i.name for i in everything)
        mine = [i for i in everything if i.name.startswith(tag)]
        assert mine == [infos[name] for name in sorted(names)]
        paged: list[str] = []
        after = tag
        while True:
            page = store.list_namespaces(after=after, limit=2)
            assert len(page) <= 2
            paged += [i.name for i in page if i.name.startswith(tag)]
            if len(page) < 2 or not page[-1].name.startswith(tag):
                break
            after = page[-1].name
        assert paged == sorted(names)
        store.drop_namespace(names[0])
        assert names[0] not in {i.name for i in store.list_namespaces(after=tag)}
        for bad_after, bad_limit in (("a b", None), ("", 0)):
            with pytest.raises(InvalidArgumentError):
                store.list_namespaces(after=bad_after, limit=bad_limit)
    finally:
        for name in names:
            store.drop_namespace(name)


def test_unknown_namespace_and_bad_names(store: CountsStore, namespace: str) -> None:
    with pytest.raises(NamespaceNotFoundError):
        store.namespace_info(namespace)
    with pytest.raises(NamespaceNotFoundError):
        apply(store, namespace, "c", 1, batch([row([1], 2)]))
    with pytest.raises(NamespaceNotFoundError):
        store.lookup(namespace, [1])
    for bad in ("", "a b", "x{y}", "a/b", "*", "n" * 65):
        with pytest.raises(InvalidArgumentError):
            store.create_namespace(bad, FP, VOCAB)
    with pytest.raises(InvalidArgumentError):
        store.create_namespace(namespace, b"short", VOCAB)
    with pytest.raises(InvalidArgumentError):
        store.create_namespace(namespace, FP, 0)


def test_vocab_size_is_limited_to_the_core_limit(store: CountsStore, namespace: str) -> None:
    """A namespace takes at most MAX_VOCAB (2**24) tokens, like the core and the static format."""
    for too_big in (MAX_VOCAB + 1, 2**31 - 1):
        with pytest.raises(InvalidArgumentError, match="vocab_size"):
            store.create_namespace(namespace, FP, too_big)
    with pytest.raises(NamespaceNotFoundError):
        store.namespace_info(namespace)
    info = store.create_namespace(namespace, FP, MAX_VOCAB)
    assert info.token_width == 3
    apply(store, namespace, "c", 1, batch([row([MAX_VOCAB - 1], MAX_VOCAB - 1, 2)]))
    assert store.lookup(namespace, [MAX_VOCAB - 1]) == {MAX_VOCAB - 1: 2}
    with pytest.raises(InvalidArgumentError):
        apply(store, namespace, "c", 2, batch([row([MAX_VOCAB], 1)]))


def test_drop_and_recreate_starts_empty_and_invalidates_versions(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    apply(store, namespace, "c", 1, batch([row([1, 2], 3, 5)]))
    version = store.version(namespace)
    assert store.drop_namespace(namespace) is True
    assert store.drop_namespace(namespace) is False
    with pytest.raises(NamespaceNotFoundError):
        store.lookup(namespace, [1, 2])
    time.sleep(0.002)
    store.create_namespace(namespace, OTHER_FP, 1000)
    assert store.lookup(namespace, [1, 2]) == {}
    assert exported(store, namespace) == Counter()
    with pytest.raises(ResyncRequiredError):
        store.changes_since(namespace, version)
    # (client, seq) of the old incarnation is new to this one
    assert apply(store, namespace, "c", 1, batch([row([1, 2], 3, 5)])).applied == 1


# --------------------------------------------------------------------------- apply / lookup


def test_apply_sums_repeats_and_lookup_reads_followers(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    result = apply(store, namespace, "c", 1, batch([
        row([5, 7], 9, 3), row([5, 7], 9, 2), row([5, 7], 11), row([5], 8),
        row([1, 2, 3, 4], 5, 10), row([VOCAB - 1], VOCAB - 1, 7), row([5, 7, 1], 9),
    ]))
    assert (result.applied, result.duplicates, result.entries) == (result.units, 0, 6)
    assert store.lookup(namespace, [5, 7]) == {9: 5, 11: 1}
    assert store.lookup(namespace, [5]) == {8: 1}
    assert store.lookup(namespace, [5, 7, 1]) == {9: 1}
    assert store.lookup(namespace, [1, 2, 3, 4]) == {5: 10}
    assert store.lookup(namespace, [VOCAB - 1]) == {VOCAB - 1: 7}
    assert store.lookup(namespace, [7]) == {}
    apply(store, namespace, "c", 2, batch([row([5, 7], 9, 1)]))
    assert store.lookup(namespace, [5, 7]) == {9: 6, 11: 1}
    for bad in ([], [1, 2, 3, 4, 5], [VOCAB], [-1]):
        with pytest.raises(InvalidArgumentError):
            store.lookup(namespace, bad)


def test_export_equals_the_sum_of_random_batches(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    rng = np.random.default_rng(7)
    expected: Counter = Counter()
    for seq in range(12):
        deltas = random_batch(rng, 400)
        expected.update(as_counter(deltas))
        apply(store, namespace, "writer", seq, deltas)
    assert exported(store, namespace) == expected
    assert exported(store, namespace, chunk_rows=50) == expected
    chunks = list(store.export(namespace, chunk_rows=50))
    assert len(chunks) > 1
    key = next(iter(expected))
    n = key[0]
    followers = {k[5]: c for k, c in expected.items() if k[:1 + n] == key[:1 + n] and k[0] == n}
    assert store.lookup(namespace, list(key[1:1 + n])) == followers


def test_same_batch_twice_counts_once(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    deltas = random_batch(np.random.default_rng(1), 500)
    first = apply(store, namespace, "c", 42, deltas)
    again = apply(store, namespace, "c", 42, deltas)
    assert first.applied == first.units >= 1 and first.duplicates == 0
    assert again.duplicate and again.applied == 0
    assert apply(store, namespace, "other-client", 42, deltas).applied == first.units
    expected = as_counter(deltas)
    assert exported(store, namespace) == Counter({k: 2 * v for k, v in expected.items()})


def test_out_of_order_seqs_within_the_window_and_too_old(make_store: Callable[..., CountsStore],
                                                        namespace: str) -> None:
    store = make_store(dedup_window=8)
    store.create_namespace(namespace, FP, VOCAB)
    one = batch([row([1], 2)])
    for seq in (5, 3, 9, 4):
        assert apply(store, namespace, "c", seq, one).applied == 1
    assert apply(store, namespace, "c", 3, one).duplicate
    assert apply(store, namespace, "c", 2, one).applied == 1  # 2 > 9 - 8
    with pytest.raises(BatchTooOldError):
        apply(store, namespace, "c", 1, one)  # 1 <= 9 - 8: cannot tell, refused
    assert store.lookup(namespace, [1]) == {2: 5}
    assert apply(store, namespace, "c", 20, one).applied == 1
    with pytest.raises(BatchTooOldError):
        apply(store, namespace, "c", 9, one)
    assert store.lookup(namespace, [1]) == {2: 6}


def test_empty_batch_is_a_no_op(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    result = apply(store, namespace, "c", 1, batch([]))
    assert (result.units, result.applied, result.entries) == (0, 0, 0)
    assert exported(store, namespace) == Counter()


BAD_BATCHES = {
    "n=0": [0, -1, -1, -1, -1, 1, 1],
    "n=5": [5, 1, 2, 3, 4, 1, 1],
    "token >= vocab": [2, 1, VOCAB, -1, -1, 1, 1],
    "negative token": [2, -1, 3, -1, -1, 1, 1],
    "unused slot not -1": [1, 1, 0, -1, -1, 1, 1],
    "follower >= vocab": [1, 1, -1, -1, -1, VOCAB, 1],
    "negative follower": [1, 1, -1, -1, -1, -5, 1],
    "count 0": [1, 1, -1, -1, -1, 1, 0],
    "negative count": [1, 1, -1, -1, -1, 1, -3],
}


@pytest.mark.parametrize("bad", list(BAD_BATCHES), ids=list(BAD_BATCHES))
def test_a_bad_batch_is_refused_whole_and_changes_nothing(store: CountsStore, namespace: str, bad: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    good = random_batch(np.random.default_rng(3), 300)
    apply(store, namespace, "c", 1, good)
    before = exported(store, namespace)
    version = store.version(namespace)
    changes_before = store.changes_since(namespace, version).buckets.tolist()
    mixed = np.concatenate([random_batch(np.random.default_rng(4), 300), batch([BAD_BATCHES[bad]])])
    with pytest.raises(InvalidArgumentError, match="row 300"):
        apply(store, namespace, "c", 2, mixed)
    assert exported(store, namespace) == before
    assert store.changes_since(namespace, version).buckets.tolist() == changes_before
    # the refused seq was not consumed: a good batch with it applies
    assert apply(store, namespace, "c", 2, good).applied >= 1


def test_malformed_arrays_and_arguments_are_refused(make_store: Callable[..., CountsStore], namespace: str) -> None:
    store = make_store(max_batch_rows=10)
    store.create_namespace(namespace, FP, VOCAB)
    ok = batch([row([1], 2)])
    for deltas in (ok.astype(np.int64), ok[:, :6].copy(), ok.tolist(), np.asfortranarray(np.repeat(ok, 3, 0)),
                   np.repeat(ok, 11, axis=0), ok.reshape(-1)):
        with pytest.raises(InvalidArgumentError):
            apply(store, namespace, "c", 1, deltas)  # type: ignore[arg-type]
    for client_id, seq in (("", 1), ("has space", 1), ("c", -1), ("c", 2**53), ("c", 1.5), ("c", True)):
        with pytest.raises(InvalidArgumentError):
            apply(store, namespace, client_id, seq, ok)  # type: ignore[arg-type]
    assert exported(store, namespace) == Counter()
    assert apply(store, namespace, "c", 1, ok).applied == 1


# --------------------------------------------------------------------------- changes_since


def test_changes_since_mirror_applied_to_an_older_copy_equals_a_full_export(store: CountsStore,
                                                                           namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB, buckets=1024)
    rng = np.random.default_rng(11)
    for seq in range(5):
        apply(store, namespace, "a", seq, random_batch(rng, 300, hot=200))
    version = store.version(namespace)  # version first, then export: the resync procedure
    mirror = exported(store, namespace)
    for round_ in range(4):
        for seq in range(3):
            apply(store, namespace, f"w{round_}", seq, random_batch(rng, 50, hot=200))
        if round_ % 2:
            time.sleep(0.002)  # let the epoch advance between some rounds
        change = store.changes_since(namespace, version)
        assert change.rows.dtype == np.int64
        assert 0 < len(change.buckets) < 1024
        assert np.all(np.diff(change.buckets.astype(np.int64)) > 0)
        for r in change.rows.tolist():
            mirror[tuple(r[:6])] = r[6]  # upsert absolute counts
        assert mirror == exported(store, namespace)
        assert change.version >= version
        version = change.version
    # Nothing written since: a later version sees no changed bucket.
    time.sleep(0.002)
    quiet = store.changes_since(namespace, store.version(namespace))
    assert len(quiet.buckets) == 0 and len(quiet.rows) == 0


def test_changes_since_only_returns_changed_buckets(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB, buckets=4096)
    rng = np.random.default_rng(5)
    apply(store, namespace, "a", 1, random_batch(rng, 2000, hot=3000))
    version = store.version(namespace)
    apply(store, namespace, "a", 2, batch([row([1, 2], 3), row([4], 5)]))
    change = store.changes_since(namespace, version)
    assert 1 <= len(change.buckets) <= 2
    keys = {tuple(r[:6]) for r in change.rows.tolist()}
    assert (2, 1, 2, -1, -1, 3) in keys and (1, 4, -1, -1, -1, 5) in keys


def test_changes_since_too_old_or_from_the_future_asks_for_resync(make_store: Callable[..., CountsStore],
                                                                  namespace: str) -> None:
    store = make_store(history_epochs=3)
    store.create_namespace(namespace, FP, VOCAB)
    old = store.version(namespace)
    for seq in range(6):
        time.sleep(0.002)
        apply(store, namespace, "c", seq, batch([row([seq], 1)]))
        latest = store.changes_since(namespace, store.version(namespace)).version
    with pytest.raises(ResyncRequiredError):
        store.changes_since(namespace, old)
    with pytest.raises(ResyncRequiredError):
        store.changes_since(namespace, latest + 10**9)
    store.changes_since(namespace, latest)  # still within history


def test_versions_advance_at_most_once_per_epoch(make_store: Callable[..., CountsStore], namespace: str) -> None:
    store = make_store(epoch_seconds=3600)
    store.create_namespace(namespace, FP, VOCAB)
    first = store.version(namespace)
    apply(store, namespace, "c", 1, batch([row([1], 2)]))
    assert store.version(namespace) == first
    change = store.changes_since(namespace, first)  # the open epoch is included
    assert change.version == first and len(change.rows) == 1


# --------------------------------------------------------------------------- apply_group


def results(outcomes: list[ItemOutcome]) -> list[ApplyResult]:
    """The outcomes of a group where every item must have been accepted."""
    for outcome in outcomes:
        assert isinstance(outcome, ApplyResult), outcome
    return [o for o in outcomes if isinstance(o, ApplyResult)]


def test_apply_group_sums_many_clients_exactly_once(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    rng = np.random.default_rng(21)
    items = [GroupItem(f"client-{c}", 1, random_batch(rng, 300, hot=15), FP) for c in range(6)]
    version = store.version(namespace)
    first = results(store.apply_group(namespace, items))
    expected: Counter = Counter()
    for item, result in zip(items, first):
        assert result.applied == result.units >= 1 and result.duplicates == 0
        assert result.entries == len(as_counter(item.deltas))
        expected.update(as_counter(item.deltas))
    assert exported(store, namespace) == expected
    key = next(iter(expected))
    n = key[0]
    assert store.lookup(namespace, list(key[1:1 + n]))[key[5]] == expected[key]
    change = store.changes_since(namespace, version)
    assert {tuple(r[:6]): r[6] for r in change.rows.tolist()} == expected
    # The same group again (a retry after a lost reply): every item a duplicate, nothing added.
    again = results(store.apply_group(namespace, items))
    assert all(r.duplicate and r.entries == f.entries for r, f in zip(again, first))
    # New batches and retried ones mixed: only the new ones count.
    newer = [GroupItem(f"client-{c}", 2, random_batch(rng, 200, hot=15)) for c in range(3)]
    mixed = results(store.apply_group(namespace, [items[4], newer[0], items[0], newer[1], newer[2]]))
    assert [r.duplicate for r in mixed] == [True, False, True, False, False]
    for item in newer:
        expected.update(as_counter(item.deltas))
    assert exported(store, namespace) == expected


def test_apply_group_a_pair_repeated_inside_a_group_counts_once(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    rng = np.random.default_rng(22)
    a, b = random_batch(rng, 200), random_batch(rng, 200)
    bad = np.concatenate([a[:5], batch([BAD_BATCHES["n=0"]])])
    outcomes = store.apply_group(namespace, [
        GroupItem("a", 1, a), GroupItem("b", 1, b), GroupItem("a", 1, a), GroupItem("a", 1, a),
        GroupItem("c", 7, bad), GroupItem("c", 7, b),  # the first is refused: the repeat is new
    ])
    assert isinstance(outcomes[4], InvalidArgumentError)
    first, other, repeat, repeat2, _, c7 = (o if isinstance(o, ApplyResult) else None for o in outcomes)
    assert first is not None and other is not None and repeat is not None and repeat2 is not None
    assert c7 is not None
    assert first.applied == first.units and other.applied == other.units and c7.applied == c7.units
    assert repeat.duplicate and repeat2.duplicate
    assert exported(store, namespace) == as_counter(a) + as_counter(b) + as_counter(b)


def test_apply_group_and_apply_see_each_others_batches(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    rng = np.random.default_rng(23)
    a1, a2, b1 = random_batch(rng, 150), random_batch(rng, 150), random_batch(rng, 150)
    apply(store, namespace, "a", 1, a1)
    outcomes = results(store.apply_group(namespace, [GroupItem("a", 1, a1), GroupItem("a", 2, a2),
                                                     GroupItem("b", 1, b1)]))
    assert [r.duplicate for r in outcomes] == [True, False, False]
    assert outcomes[1].applied == outcomes[1].units and outcomes[2].applied == outcomes[2].units
    assert apply(store, namespace, "b", 1, b1).duplicate
    assert results(store.apply_group(namespace, [GroupItem("a", 2, a2), GroupItem("a", 3, a1)]))[0].duplicate
    assert exported(store, namespace) == as_counter(a1) + as_counter(a2) + as_counter(b1) + as_counter(a1)


def test_apply_group_refuses_bad_items_alone(make_store: Callable[..., CountsStore], namespace: str) -> None:
    store = make_store(dedup_window=4, max_batch_rows=1000)
    store.create_namespace(namespace, FP, VOCAB)
    rng = np.random.default_rng(24)
    good = [random_batch(rng, 100) for _ in range(3)]
    apply(store, namespace, "old", 10, good[0])
    with_bad_row = np.concatenate([good[1], batch([BAD_BATCHES["token >= vocab"]])])
    items = [
        GroupItem("g0", 1, good[0], FP),
        GroupItem("bad-row", 1, with_bad_row),
        GroupItem("other-tokenizer", 1, good[1], OTHER_FP),
        GroupItem("no-fingerprint", 1, good[1], b""),
        GroupItem("has space", 1, good[1]),
        GroupItem("bad-seq", -1, good[1]),
        GroupItem("too-many", 1, np.repeat(good[1], 11, axis=0)),
        GroupItem("wrong-dtype", 1, good[1].astype(np.int64)),
        GroupItem("old", 5, good[0][::-1].copy()),  # 5 <= 10 - 4 on every shard of seq 10: too old to tell
        GroupItem("empty", 1, batch([])),
        GroupItem("g1", 1, good[2]),
    ]
    outcomes = store.apply_group(namespace, items)
    kinds = [type(o).__name__ for o in outcomes]
    assert kinds == ["ApplyResult", "InvalidArgumentError", "TokenizerMismatchError", "InvalidArgumentError",
                     "InvalidArgumentError", "InvalidArgumentError", "InvalidArgumentError", "InvalidArgumentError",
                     "BatchTooOldError", "ApplyResult", "ApplyResult"]
    assert "row 100" in str(outcomes[1])
    assert outcomes[9] == ApplyResult(0, 0, 0, 0)
    assert exported(store, namespace) == as_counter(good[0]) + as_counter(good[0]) + as_counter(good[2])
    # Nothing of a refused item was recorded: its (client_id, seq) with a good batch applies.
    assert not apply(store, namespace, "bad-row", 1, good[1]).duplicate
    assert not apply(store, namespace, "other-tokenizer", 1, good[1], fingerprint=FP).duplicate


def test_apply_group_of_unknown_namespace_raises(store: CountsStore, namespace: str) -> None:
    with pytest.raises(NamespaceNotFoundError):
        store.apply_group(namespace, [GroupItem("a", 1, batch([row([1], 2)]))])
    with pytest.raises(NamespaceNotFoundError):
        store.apply_group(namespace, [GroupItem("a", 1, batch([]))])
    with pytest.raises(InvalidArgumentError):
        store.apply_group("bad name", [GroupItem("a", 1, batch([]))])
    assert store.apply_group(namespace, []) == []


def test_apply_group_sums_beyond_what_one_unit_adds_exactly_are_split(store: CountsStore, namespace: str) -> None:
    store.create_namespace(namespace, FP, VOCAB)
    big = np.repeat(batch([row([3, 4], 5, 2**31 - 1)]), 20_000, axis=0)  # 4.3e13 an item, 1.3e14 for three
    too_big = np.repeat(batch([row([3, 4], 5, 2**31 - 1)]), 50_000, axis=0)  # 1.07e14 in one entry: refused
    outcomes = store.apply_group(namespace, [GroupItem("a", 1, big), GroupItem("b", 1, too_big),
                                             GroupItem("c", 1, big), GroupItem("d", 1, big)])
    assert isinstance(outcomes[1], InvalidArgumentError)
    assert [r.applied for r in results([outcomes[0], *outcomes[2:]])] == [1, 1, 1]
    assert store.lookup(namespace, [3, 4]) == {5: 3 * 20_000 * (2**31 - 1)}


def test_apply_group_applies_exactly_the_units_an_interrupted_attempt_missed(store: CountsStore,
                                                                            namespace: str) -> None:
    """A batch applied on one shard only (an attempt interrupted mid-way on a Cluster) is completed by a group."""
    info = store.create_namespace(namespace, FP, VOCAB)
    full = random_batch(np.random.default_rng(25), 400, hot=60)
    _, _, buckets = fields_and_buckets(full, info)
    shard = buckets % info.shards
    part = np.ascontiguousarray(full[shard == shard[0]])  # all of it on one shard
    assert apply(store, namespace, "a", 1, part).applied == 1
    a, b = results(store.apply_group(namespace, [GroupItem("a", 1, full), GroupItem("b", 1, full.copy())]))
    assert a.units == len(set(shard.tolist())) and a.duplicates == 1 and a.applied == a.units - 1
    assert b.applied == b.units == a.units
    assert exported(store, namespace) == Counter({k: 2 * v for k, v in as_counter(full).items()})


# --------------------------------------------------------------------------- rebuild leases


def test_one_lease_holder_at_a_time_with_growing_fencing_tokens(store: CountsStore, namespace: str) -> None:
    from ngramcache.client.kernel.errors import LeaseHeldError

    a = store.acquire_lease(namespace, "replica-a", 10_000)
    with pytest.raises(LeaseHeldError, match="replica-a"):
        store.acquire_lease(namespace, "replica-b", 10_000)
    assert store.renew_lease(a, 10_000)
    assert store.release_lease(a)
    assert not store.release_lease(a) and not store.renew_lease(a, 1000)
    b = store.acquire_lease(namespace, "replica-b", 10_000)
    assert b.token > a.token
    again = store.acquire_lease(namespace, "replica-b", 10_000)  # the holder itself: a new token
    assert again.token > b.token and not store.renew_lease(b, 1000)
    store.release_lease(again)


def test_an_expired_lease_cannot_commit_and_generations_only_grow(store: CountsStore, namespace: str) -> None:
    from ngramcache.client.kernel.errors import LeaseLostError

    assert store.committed_generation(namespace).generation == 0
    old = store.acquire_lease(namespace, "paused-leader", 150)
    time.sleep(0.3)  # the old leader pauses past its lease
    new = store.acquire_lease(namespace, "new-leader", 10_000)
    store.commit_generation(new, 7, "10.0.0.2:50051")
    committed = store.committed_generation(namespace)
    assert (committed.generation, committed.location, committed.token) == (7, "10.0.0.2:50051", new.token)
    with pytest.raises(LeaseLostError):
        store.commit_generation(old, 8, "10.0.0.1:50051")  # resumes and tries to publish: fenced off
    with pytest.raises(GenerationNotNewerError, match="7"):
        store.commit_generation(new, 7, "10.0.0.2:50051")
    store.commit_generation(new, 9, "here", "publish")
    assert (store.committed_generation(namespace).generation, store.committed_generation(namespace).kind) == (9, "publish")
    assert not store.renew_lease(old, 1000)
    store.release_lease(new)


def test_the_corpus_base_is_the_latest_published_generation_and_rebuilds_carry_it(
        store: CountsStore, namespace: str) -> None:
    def base() -> tuple[int, str, str]:
        c = store.committed_generation(namespace)
        return c.base, c.base_location, c.kind

    assert base() == (0, "", "rebuild")  # nothing committed: no base
    lease = store.acquire_lease(namespace, "replica-a", 10_000)
    store.commit_generation(lease, 2, "builder:1")  # a rebuild before any publish: still none
    assert base() == (0, "", "rebuild")
    store.commit_generation(lease, 3, "publisher:1", "publish")
    assert base() == (3, "publisher:1", "publish")
    store.commit_generation(lease, 4, "builder:2")
    store.commit_generation(lease, 5, "builder:3")  # carried unchanged by every rebuild
    committed = store.committed_generation(namespace)
    assert (committed.generation, committed.location, committed.kind) == (5, "builder:3", "rebuild")
    assert base() == (3, "publisher:1", "rebuild")
    store.commit_generation(lease, 6, "publisher:2", "publish")  # a newer corpus replaces it
    assert base() == (6, "publisher:2", "publish")
    store.commit_generation(lease, 7, "builder:1", keep_base=False)  # the operator drops it (--no-base)
    assert base() == (0, "", "rebuild")
    store.commit_generation(lease, 8, "builder:1")
    assert base() == (0, "", "rebuild")
    store.commit_generation(lease, 9, "publisher:1", "publish")
    store.release_lease(lease)

    # A dropped namespace forgets its base (its files are gone) but keeps its numbers growing.
    store.create_namespace(namespace, FP, VOCAB)
    assert store.drop_namespace(namespace)
    committed = store.committed_generation(namespace)
    assert (committed.generation, committed.base, committed.base_location) == (9, 0, "")


def test_a_committed_record_from_before_bases_reads_a_publish_as_its_own_base(
        store: CountsStore, namespace: str, backend: str) -> None:
    """Records stored before the base existed (Redis hashes without its fields) still read, and carry."""
    if backend == "embedded":
        pytest.skip("the embedded store keeps no records from an older version (its snapshot had none)")
    from ngramcache.cache_service.counts import schema

    gen_key = schema.lease_keys(store.config.prefix, namespace)[2]
    client = store._conn.client  # type: ignore[attr-defined]  # the Redis backend's connection
    client.hset(gen_key, mapping={"generation": 4, "location": "old:1", "token": 1, "kind": "publish"})
    committed = store.committed_generation(namespace)
    assert (committed.generation, committed.base, committed.base_location) == (4, 4, "old:1")
    lease = store.acquire_lease(namespace, "replica-a", 10_000)
    store.commit_generation(lease, 5, "builder:1")
    committed = store.committed_generation(namespace)
    assert (committed.generation, committed.kind, committed.base, committed.base_location) == (5, "rebuild", 4, "old:1")
    store.release_lease(lease)
    client.delete(gen_key)
    client.hset(gen_key, mapping={"generation": 6, "location": "old:2", "token": 1, "kind": "rebuild"})
    assert store.committed_generation(namespace).base == 0  # a rebuild's record without a base: none known


def test_the_embedded_store_keeps_the_committed_generation_and_its_base_in_its_snapshot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ngramcache.cache_service.counts.factory import open_counts_store

    url = f"embedded://{tmp_path / 'counts.snapshot'}"
    with open_counts_store(url, **TEST_OPTIONS_EMBEDDED) as store:
        store.create_namespace("kept", FP, VOCAB)
        lease = store.acquire_lease("kept", "replica-a", 10_000)
        store.commit_generation(lease, 3, "publisher:1", "publish")
        store.commit_generation(lease, 4, "builder:1")
    with open_counts_store(url, **TEST_OPTIONS_EMBEDDED) as store:  # a restart
        committed = store.committed_generation("kept")
        assert (committed.generation, committed.location, committed.kind) == (4, "builder:1", "rebuild")
        assert (committed.base, committed.base_location) == (3, "publisher:1")
        lease = store.acquire_lease("kept", "replica-a", 10_000)
        with pytest.raises(GenerationNotNewerError):
            store.commit_generation(lease, 4, "builder:1")


TEST_OPTIONS_EMBEDDED = {"epoch_seconds": 0, "default_buckets": 256}


def test_lease_arguments_are_checked(store: CountsStore, namespace: str) -> None:
    for holder, ttl in (("", 1000), ("a|b", 1000), ("a", 0), ("a", True)):
        with pytest.raises(InvalidArgumentError):
            store.acquire_lease(namespace, holder, ttl)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        store.acquire_lease("bad name!", "a", 1000)
