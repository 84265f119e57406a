"""The counts store contract, its rebuild leases: one holder at a time, fencing tokens, committed generations and
the corpus base they carry, on every backend (test_counts_store_contract.py has the rest)."""

from __future__ import annotations

import time

import pytest
from helpers.counts import CONTRACT_BACKENDS, FP, VOCAB

from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.client.kernel.errors import GenerationNotNewerError, InvalidArgumentError

pytestmark = pytest.mark.integration

BACKENDS = CONTRACT_BACKENDS  # conftest's pytest_generate_tests runs each test that takes `backend` on each of these


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


# Redis only: the embedded store's snapshots never held records without a base.
@pytest.mark.parametrize("backend", [b for b in CONTRACT_BACKENDS if b != "embedded"])
def test_a_committed_record_from_before_bases_reads_a_publish_as_its_own_base(
        store: CountsStore, namespace: str, backend: str) -> None:
    """Records stored before the base existed (Redis hashes without its fields) still read, and carry."""
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
