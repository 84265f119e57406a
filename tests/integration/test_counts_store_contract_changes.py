"""The counts store contract, its changes: versions and changes_since, what a mirror follows to stay equal to a full
export, on every backend (test_counts_store_contract.py has the rest)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers.counts import CONTRACT_BACKENDS, FP, VOCAB, apply, batch, exported, random_batch, row

from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.client.kernel.errors import ResyncRequiredError

pytestmark = pytest.mark.integration

BACKENDS = CONTRACT_BACKENDS  # conftest's pytest_generate_tests runs each test that takes `backend` on each of these


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
