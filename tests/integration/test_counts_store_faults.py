"""Fault tests with real servers: retries after timeouts and SIGKILL restarts count once, concurrent writers are exact, credentials never leak."""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from helpers.counts import FP, VOCAB, apply, as_counter, batch, exported, random_batch, row
from helpers.redis_servers import RedisClusterProcesses, RedisServer

from ngramcache.cache_service.counts.config import CountsStoreConfig
from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem
from ngramcache.client.kernel.errors import BackendUnavailableError, StoreAuthenticationError, TokenizerMismatchError

pytestmark = pytest.mark.integration

DURABLE = ["--appendonly", "yes", "--appendfsync", "always"]


def apply_until_acknowledged(store: CountsStore, namespace: str, client_id: str, seq: int,
                             deltas: np.ndarray, deadline: float) -> int:
    """What a sender does: retry the same (client_id, seq, deltas) until acknowledged; return the failed attempts."""
    failures = 0
    while True:
        try:
            apply(store, namespace, client_id, seq, deltas)
            return failures
        except BackendUnavailableError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def apply_group_until_acknowledged(store: CountsStore, namespace: str, items: list[GroupItem],
                                   deadline: float) -> int:
    """The same for a group (what the service's push batcher does for its callers): retry it whole until acknowledged."""
    failures = 0
    while True:
        try:
            outcomes = store.apply_group(namespace, items)
            assert all(isinstance(o, ApplyResult) for o in outcomes), outcomes
            return failures
        except BackendUnavailableError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def ingest_with_a_sigkill(store: CountsStore, namespace: str, kill_and_restart: Callable[[], None],
                          batches: int = 40, group: int = 0) -> Counter:
    """Ingest ``batches`` batches from a thread, SIGKILL + restart a server mid-way, return the expected totals.

    ``group`` > 0: the batches go in `apply_group` calls of ``group`` batches, one per client id.
    """
    rng = np.random.default_rng(99)
    data = [random_batch(rng, 1500, hot=60) for _ in range(batches)]
    progress = {"done": 0, "failures": 0}
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            deadline = time.monotonic() + 60
            if group:
                for start in range(0, batches, group):
                    items = [GroupItem(f"writer-{i % group}", i // group, data[i])
                             for i in range(start, min(start + group, batches))]
                    progress["failures"] += apply_group_until_acknowledged(store, namespace, items, deadline)
                    progress["done"] = start + len(items)
                return
            for seq, deltas in enumerate(data):
                progress["failures"] += apply_until_acknowledged(store, namespace, "writer", seq, deltas, deadline)
                progress["done"] = seq + 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    while progress["done"] < batches // 3 and thread.is_alive():
        time.sleep(0.005)
    kill_and_restart()
    thread.join(90)
    assert not errors, errors
    assert progress["done"] == batches
    assert progress["failures"] > 0, "the kill did not interrupt ingestion"
    expected: Counter = Counter()
    for deltas in data:
        expected.update(as_counter(deltas))
    return expected


# --------------------------------------------------------------------------- lost replies and restarts


def test_retry_after_a_timeout_counts_once(tmp_path: object) -> None:
    """The script reaches the server, the reply is lost to a timeout; the retry is a duplicate."""
    with RedisServer(args=DURABLE) as server:
        store = open_counts_store(server.url, socket_timeout=0.3, retries=0)
        ns = "faults"
        store.create_namespace(ns, FP, VOCAB)
        warm_up = batch([row([1], 1)])
        apply(store, ns, "c", 6, warm_up)  # loads the script: the next call really runs it
        deltas = random_batch(np.random.default_rng(2), 2000)
        server.signal(signal.SIGSTOP)
        try:
            with pytest.raises(BackendUnavailableError) as caught:
                apply(store, ns, "c", 7, deltas)
            assert caught.value.retriable
        finally:
            server.signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:  # the server now runs the script it had buffered; our retry must not add it again
            try:
                again = apply(store, ns, "c", 7, deltas)
                break
            except BackendUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert again.duplicate
        assert exported(store, ns) == as_counter(deltas) + as_counter(warm_up)
        store.close()


def test_a_group_retried_after_a_timeout_counts_once() -> None:
    """The group's script reaches the server, the reply is lost to a timeout; the retried group is all duplicates."""
    with RedisServer(args=DURABLE) as server:
        store = open_counts_store(server.url, socket_timeout=0.3, retries=0)
        ns = "faults"
        store.create_namespace(ns, FP, VOCAB)
        apply(store, ns, "c0", 6, batch([row([1], 1)]))  # loads the script: the next call really runs it
        rng = np.random.default_rng(3)
        items = [GroupItem(f"c{c}", 7, random_batch(rng, 1000, hot=30)) for c in range(4)]
        server.signal(signal.SIGSTOP)
        try:
            with pytest.raises(BackendUnavailableError):
                store.apply_group(ns, items)
        finally:
            server.signal(signal.SIGCONT)
        apply_group_until_acknowledged(store, ns, items, time.monotonic() + 10)
        again = store.apply_group(ns, items)
        assert all(isinstance(o, ApplyResult) and o.duplicate for o in again)
        expected = as_counter(batch([row([1], 1)]))
        for item in items:
            expected.update(as_counter(item.deltas))
        assert exported(store, ns) == expected
        store.close()


@pytest.mark.parametrize("group", [0, 4], ids=["batches", "groups"])
def test_batches_retried_across_a_sigkill_restart_count_once_standalone(group: int) -> None:
    with RedisServer(args=DURABLE) as server:
        store = open_counts_store(server.url, socket_timeout=2, retries=1)
        ns = "faults"
        store.create_namespace(ns, FP, VOCAB, buckets=512)

        def kill_and_restart() -> None:
            server.kill()
            time.sleep(0.2)
            server.start()

        expected = ingest_with_a_sigkill(store, ns, kill_and_restart, group=group)
        assert exported(store, ns) == expected
        store.close()


@pytest.mark.parametrize("group", [0, 4], ids=["batches", "groups"])
def test_batches_retried_across_a_sigkill_restart_count_once_cluster(group: int) -> None:
    with RedisClusterProcesses(masters=3, args=DURABLE) as cluster:
        store = open_counts_store(cluster.url, socket_timeout=2, retries=1)
        ns = "faults"
        info = store.create_namespace(ns, FP, VOCAB, buckets=512)
        assert info.shards == 64  # a batch spans shards on all three masters

        def kill_and_restart() -> None:
            victim = cluster.nodes[1]
            victim.kill()
            time.sleep(0.2)
            victim.start()
            cluster.wait_ok()

        expected = ingest_with_a_sigkill(store, ns, kill_and_restart, group=group)
        assert exported(store, ns) == expected
        store.close()


def test_scripts_flushed_from_the_server_are_reloaded(redis_standalone: RedisServer) -> None:
    store = open_counts_store(redis_standalone.url, epoch_seconds=0)
    ns = "t-" + uuid.uuid4().hex[:12]
    try:
        store.create_namespace(ns, FP, VOCAB)
        admin = redis_standalone.client()
        admin.script_flush()
        admin.close()
        apply(store, ns, "c", 1, batch([row([1, 2], 3, 4)]))
        assert store.lookup(ns, [1, 2]) == {3: 4}
        assert store.changes_since(ns, store.version(ns)).version > 0
    finally:
        store.drop_namespace(ns)
        store.close()


# --------------------------------------------------------------------------- concurrency


def test_eight_concurrent_writers_with_overlapping_keys_give_exact_totals(
        make_store: Callable[..., CountsStore], namespace: str, backend: str) -> None:
    # Threads share a store; on Redis, two stores (two connection pools) share the server too.
    stores = [make_store()] * 2 if backend == "embedded" else [make_store(), make_store()]
    stores[0].create_namespace(namespace, FP, VOCAB, buckets=64)
    per_writer = 10
    data = {w: [random_batch(np.random.default_rng(1000 * w + i), 300, hot=12) for i in range(per_writer)]
            for w in range(8)}
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            store = stores[w % 2]
            barrier.wait()
            for seq, deltas in enumerate(data[w]):
                apply(store, namespace, f"writer-{w}", seq, deltas)
                if seq % 4 == 0:  # and a retry now and then, which must not count
                    assert apply(store, namespace, f"writer-{w}", seq, deltas).duplicate
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    expected: Counter = Counter()
    for batches in data.values():
        for deltas in batches:
            expected.update(as_counter(deltas))
    assert exported(stores[1], namespace) == expected


def test_concurrent_groups_with_overlapping_keys_and_retries_give_exact_totals(
        make_store: Callable[..., CountsStore], namespace: str, backend: str) -> None:
    """Four threads apply groups of three senders each; a group is sometimes retried whole or in part, or
    mixed with another thread's batches: every (client_id, seq) counts once."""
    stores = [make_store()] * 2 if backend == "embedded" else [make_store(), make_store()]
    stores[0].create_namespace(namespace, FP, VOCAB, buckets=64)
    data = {(t, c, seq): random_batch(np.random.default_rng(hash((t, c, seq)) % 2**32), 200, hot=10)
            for t in range(4) for c in range(3) for seq in range(8)}
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            store = stores[t % 2]
            barrier.wait()
            for seq in range(8):
                items = [GroupItem(f"t{t}-c{c}", seq, data[t, c, seq]) for c in range(3)]
                if seq % 3 == 1:  # a retry of the previous group's first batch rides along
                    items.append(GroupItem(f"t{t}-c0", seq - 1, data[t, 0, seq - 1]))
                if seq % 3 == 2:  # and another thread's batch, which that thread sends too
                    other = (t + 1) % 4
                    items.append(GroupItem(f"t{other}-c1", seq, data[other, 1, seq]))
                outcomes = store.apply_group(namespace, items)
                assert all(isinstance(o, ApplyResult) for o in outcomes), outcomes
                if seq % 4 == 0:
                    assert all(isinstance(o, ApplyResult) and o.duplicate for o in store.apply_group(namespace, items))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    expected: Counter = Counter()
    for deltas in data.values():
        expected.update(as_counter(deltas))
    assert exported(stores[1], namespace) == expected


def test_concurrent_readers_and_writers_keep_mirrors_exact(make_store: Callable[..., CountsStore],
                                                           namespace: str) -> None:
    store = make_store()
    store.create_namespace(namespace, FP, VOCAB, buckets=256)
    version = store.version(namespace)
    mirror: Counter = Counter()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            rng = np.random.default_rng(w)
            for seq in range(12):
                apply(store, namespace, f"w{w}", seq, random_batch(rng, 200, hot=100))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # a reader polling while writers write
        change = store.changes_since(namespace, version)
        for r in change.rows.tolist():
            mirror[tuple(r[:6])] = r[6]
        version = change.version
        time.sleep(0.001)
    stop.set()
    assert not errors, errors
    change = store.changes_since(namespace, version)
    for r in change.rows.tolist():
        mirror[tuple(r[:6])] = r[6]
    assert mirror == exported(store, namespace)


# Shared stores only: an embedded store is one per process, so nothing else can recreate a
# namespace underneath it.
@pytest.mark.parametrize("backend", ["standalone", "cluster"])
def test_namespace_recreated_under_a_cached_handle(make_store: Callable[..., CountsStore], namespace: str,
                                                   backend: str) -> None:
    a, b = make_store(), make_store()
    a.create_namespace(namespace, FP, VOCAB)
    apply(a, namespace, "c", 1, batch([row([1], 2)]))
    b.drop_namespace(namespace)
    b.create_namespace(namespace, bytes(32), 1000)
    with pytest.raises(TokenizerMismatchError):
        apply(a, namespace, "c", 2, batch([row([1], 2)]), fingerprint=FP)
    apply(a, namespace, "c", 3, batch([row([1], 2)]))  # valid for the new vocabulary too
    assert b.lookup(namespace, [1]) == {2: 1}
    assert a.namespace_info(namespace).vocab_size == 1000


# --------------------------------------------------------------------------- credentials


SECRET = "s3cr3t-Pa55word-" + uuid.uuid4().hex[:8]


def test_credentials_never_appear_in_errors_reprs_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with RedisServer(args=["--requirepass", SECRET]) as server:
        good_url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        seen: list[str] = []

        store = open_counts_store(good_url)
        store.create_namespace("auth", FP, VOCAB)
        apply(store, "auth", "c", 1, batch([row([1], 2)]))
        assert store.lookup("auth", [1]) == {2: 1}
        seen += [repr(store), str(store), repr(store.config), str(CountsStoreConfig.from_url(good_url))]
        store.close()

        for url in (f"redis://:wrong-{SECRET}@127.0.0.1:{server.port}/0",
                    f"redis://default:wrong-{SECRET}@127.0.0.1:{server.port}/0"):
            with pytest.raises(StoreAuthenticationError) as caught:
                open_counts_store(url)
            assert not caught.value.retriable
            seen += [str(caught.value), repr(caught.value), repr(caught.value.__cause__),
                     repr(caught.value.__context__)]

        with pytest.raises(StoreAuthenticationError) as caught:  # no password at all
            open_counts_store(server.url)
        seen.append(str(caught.value))

    dead = f"redis://user:{SECRET}@127.0.0.1:{server.port}/0"  # the server is gone now
    with pytest.raises(BackendUnavailableError) as unreachable:
        open_counts_store(dead, retries=0, connect_timeout=0.5)
    assert unreachable.value.retriable
    seen += [str(unreachable.value), repr(unreachable.value)]
    with pytest.raises(BackendUnavailableError) as unreachable_cluster:
        open_counts_store(f"redis+cluster://user:{SECRET}@127.0.0.1:{server.port}", retries=0, connect_timeout=0.5)
    seen += [str(unreachable_cluster.value), repr(unreachable_cluster.value)]
    seen += [record.getMessage() for record in caplog.records]
    seen.append(caplog.text)
    assert any("***" in text for text in seen)
    for text in seen:
        assert SECRET not in text, text
