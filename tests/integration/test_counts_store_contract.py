"""One contract for every counts store backend: embedded, a real standalone redis-server, a real 3-master Redis
Cluster, a primary and replica under Sentinel. Here namespaces and the write path (apply, apply_group, lookup);
the changes a mirror follows are in test_counts_store_contract_changes.py, the rebuild leases in
test_counts_store_contract_leases.py."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from helpers.counts import CONTRACT_BACKENDS, FP, OTHER_FP, VOCAB, apply, as_counter, batch, exported, random_batch, row

from ngramcache.cache_service.counts.layout import fields_and_buckets
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem, ItemOutcome
from ngramcache.client.kernel.errors import (
    BatchTooOldError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    ResyncRequiredError,
    TokenizerMismatchError,
)
from ngramcache.client.kernel.rows import MAX_VOCAB

pytestmark = pytest.mark.integration

BACKENDS = CONTRACT_BACKENDS  # conftest's pytest_generate_tests runs each test that takes `backend` on each of these


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
