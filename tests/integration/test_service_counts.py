"""The Counts service over a real gRPC server on loopback, in front of every counts store backend (embedded, a real redis-server, a real Redis Cluster)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.counts import FP, OTHER_FP, VOCAB, as_counter, batch, exported, random_batch, row
from helpers.redis_servers import RedisServer
from helpers.service import ServerThread

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.servicers.counts import DEFAULT_CHUNK_ROWS, CountsServicer
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.rows import COUNT, KEY_WIDTH
from ngramcache.client.wire.codec import bytes_to_count_rows, delta_rows_to_bytes

pytestmark = pytest.mark.integration

REASON = "ngc-error-reason"
MAX_PUSH_ROWS = 1000
MAX_CHUNK_ROWS = 100


@dataclasses.dataclass
class CountsService:
    """A CountsServicer on a real server in front of one store, and a stub to it."""

    store: CountsStore
    stub: counts_pb2_grpc.CountsStub
    server: ServerThread
    servicer: CountsServicer
    names: list[str] = dataclasses.field(default_factory=list)

    def namespace(self, fingerprint: bytes = FP, vocab_size: int = VOCAB, **options: Any) -> str:
        """A new namespace in the store, dropped after the test."""
        name = "s-" + uuid.uuid4().hex[:12]
        self.store.create_namespace(name, fingerprint, vocab_size, **options)
        self.names.append(name)
        return name

    def push(self, namespace: str, client_id: str, seq: int, deltas: np.ndarray, *,
             fingerprint: bytes = FP) -> counts_pb2.PushResponse:
        return self.push_raw(namespace, client_id, seq, delta_rows_to_bytes(deltas), fingerprint=fingerprint)

    def push_raw(self, namespace: str, client_id: str, seq: int, rows: bytes, *,
                 fingerprint: bytes = FP) -> counts_pb2.PushResponse:
        response: counts_pb2.PushResponse = self.stub.Push(counts_pb2.PushRequest(
            namespace=namespace, tokenizer_fingerprint=fingerprint, client_id=client_id, seq=seq, rows=rows),
            timeout=30)
        return response

    def pull(self, namespace: str, since: int | None = None, *, max_chunk_rows: int = 0,
             fingerprint: bytes = FP) -> list[counts_pb2.PullResponse]:
        request = counts_pb2.PullRequest(namespace=namespace, tokenizer_fingerprint=fingerprint,
                                         max_chunk_rows=max_chunk_rows)
        if since is not None:
            request.since_version = since
        return list(self.stub.Pull(request, timeout=30))


def served(store: CountsStore, *, max_push_rows: int = MAX_PUSH_ROWS,
           max_chunk_rows: int = MAX_CHUNK_ROWS) -> tuple[CountsService, StoreRunner]:
    runner = StoreRunner(store, max_workers=2)
    servicer = CountsServicer(runner, max_push_rows=max_push_rows, max_chunk_rows=max_chunk_rows)
    server = ServerThread([(counts_pb2_grpc.add_CountsServicer_to_server, servicer)]).start()
    return CountsService(store, counts_pb2_grpc.CountsStub(server.channel()), server, servicer), runner


@pytest.fixture
def make_service(make_store: Callable[..., CountsStore]) -> Iterator[Callable[..., CountsService]]:
    """``make_service(**store_options)``: a served store on the parametrized backend, stopped after the test."""
    running: list[tuple[CountsService, StoreRunner]] = []

    def make(*, max_push_rows: int = MAX_PUSH_ROWS, max_chunk_rows: int = MAX_CHUNK_ROWS,
             **store_options: Any) -> CountsService:
        running.append(served(make_store(**store_options), max_push_rows=max_push_rows,
                              max_chunk_rows=max_chunk_rows))
        return running[-1][0]

    yield make
    for service, runner in running:
        for name in service.names:
            service.store.drop_namespace(name)
        service.server.stop()
        runner.close()


@pytest.fixture
def service(make_service: Callable[..., CountsService]) -> CountsService:
    return make_service()


def totals(chunks: list[counts_pb2.PullResponse]) -> Counter[tuple[int, ...]]:
    """The counts of a Pull as {entry: count}, checking that no entry repeats."""
    result: Counter[tuple[int, ...]] = Counter()
    for chunk in chunks:
        for r in bytes_to_count_rows(chunk.rows).tolist():
            key = tuple(r[:KEY_WIDTH])
            assert key not in result
            result[key] = r[COUNT]
    return result


def check_chunks(chunks: list[counts_pb2.PullResponse], max_rows: int) -> int:
    """Assert the chunk contract (size, one version, only the last complete); return the version."""
    assert chunks, "a Pull answers at least one chunk"
    assert [c.complete for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len({c.version for c in chunks}) == 1
    for c in chunks:
        assert 0 < len(bytes_to_count_rows(c.rows)) <= max_rows or len(chunks) == 1
    return chunks[0].version


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def reason(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(REASON)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- Push


def test_push_then_pull_returns_what_was_pushed(service: CountsService) -> None:
    ns = service.namespace()
    rng = np.random.default_rng(1)
    expected: Counter[tuple[int, ...]] = Counter()
    for seq in range(5):
        deltas = random_batch(rng, 300)
        reply = service.push(ns, "worker-1", seq, deltas)
        assert not reply.duplicate and reply.applied_units == reply.units >= 1 and reply.duplicate_units == 0
        assert reply.entries == len(as_counter(deltas))
        assert reply.version == 0  # deprecated: no store call fills it any more
        expected.update(as_counter(deltas))
    chunks = service.pull(ns)
    check_chunks(chunks, MAX_CHUNK_ROWS)
    assert totals(chunks) == expected == exported(service.store, ns)


def test_a_retried_push_counts_once(service: CountsService) -> None:
    ns = service.namespace()
    deltas = random_batch(np.random.default_rng(2), 400)
    first = service.push(ns, "c", 7, deltas)
    again = service.push(ns, "c", 7, deltas)
    assert not first.duplicate and first.applied_units == first.units
    assert again.duplicate and again.applied_units == 0 and again.duplicate_units == again.units == first.units
    other = service.push(ns, "other", 7, deltas)  # another sender's seq 7 is another batch
    assert not other.duplicate
    # Acked: (c, 7) and (other, 7), each once however often it was sent.
    assert totals(service.pull(ns)) == Counter({k: 2 * v for k, v in as_counter(deltas).items()})


def test_an_empty_push_changes_nothing(service: CountsService) -> None:
    ns = service.namespace()
    reply = service.push(ns, "c", 1, batch([]))
    assert (reply.duplicate, reply.units, reply.applied_units, reply.entries) == (False, 0, 0, 0)
    assert totals(service.pull(ns)) == Counter()


GOOD_ROW = row([1, 2], 3)
# name -> (PushRequest changes, status code, reason)
BAD_PUSHES: dict[str, tuple[dict[str, Any], grpc.StatusCode, str | None]] = {
    "bad row (n=0)": ({"rows": [0, -1, -1, -1, -1, 1, 1]}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "bad row (count 0)": ({"rows": [1, 5, -1, -1, -1, 1, 0]}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "token outside the vocabulary": ({"rows": [2, 1, VOCAB, -1, -1, 1, 1]}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "follower outside the vocabulary": ({"rows": [1, 1, -1, -1, -1, VOCAB, 1]},
                                        grpc.StatusCode.INVALID_ARGUMENT, None),
    "rows not a multiple of 28 bytes": ({"cut": 5}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "other fingerprint": ({"tokenizer_fingerprint": OTHER_FP}, grpc.StatusCode.FAILED_PRECONDITION,
                          "TOKENIZER_MISMATCH"),
    "malformed fingerprint": ({"tokenizer_fingerprint": b"short"}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "no fingerprint": ({"tokenizer_fingerprint": b""}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "malformed client_id": ({"client_id": "has space"}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "seq of 2**53": ({"seq": 2**53}, grpc.StatusCode.INVALID_ARGUMENT, None),
    "too many rows": ({"extra_rows": MAX_PUSH_ROWS}, grpc.StatusCode.RESOURCE_EXHAUSTED, "LIMIT"),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES), ids=list(BAD_PUSHES))
def test_a_bad_push_gets_its_status_and_changes_nothing(service: CountsService, case: str) -> None:
    ns = service.namespace()
    before_deltas = random_batch(np.random.default_rng(3), 200)
    service.push(ns, "c", 1, before_deltas)
    before = totals(service.pull(ns))
    version = service.pull(ns)[-1].version
    changes, code, why = BAD_PUSHES[case]
    good = random_batch(np.random.default_rng(4), 300)
    rows = good
    if "rows" in changes:
        rows = np.concatenate([good, batch([changes["rows"]])])  # the bad row comes last
    if "extra_rows" in changes:
        rows = np.concatenate([good, np.repeat(good[:1], changes["extra_rows"], axis=0)])
    raw = delta_rows_to_bytes(rows)
    if "cut" in changes:
        raw = raw[:-changes["cut"]]
    request = {"namespace": ns, "tokenizer_fingerprint": FP, "client_id": "c", "seq": 2, "rows": raw}
    request.update({k: v for k, v in changes.items() if k in ("tokenizer_fingerprint", "client_id", "seq")})
    err = rpc_error(lambda: service.stub.Push(counts_pb2.PushRequest(**request), timeout=30))
    assert err.code() == code, err.details()
    assert reason(err) == why
    if "rows" in changes:
        assert "row 300" in (err.details() or "")  # the message names the first bad row
    assert totals(service.pull(ns)) == before
    assert len(bytes_to_count_rows(b"".join(c.rows for c in service.pull(ns, version)))) == 0
    # Nothing was recorded either: the same (client_id, seq) with a good batch applies.
    assert not service.push(ns, "c", 2, good).duplicate
    assert totals(service.pull(ns)) == before + as_counter(good)


def test_a_push_older_than_the_dedup_window_is_refused(make_service: Callable[..., CountsService]) -> None:
    service = make_service(dedup_window=4)
    ns = service.namespace()
    one = batch([row([1], 2)])
    service.push(ns, "c", 10, one)
    err = rpc_error(lambda: service.push(ns, "c", 6, one))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "BATCH_TOO_OLD"
    assert totals(service.pull(ns)) == as_counter(one)


def test_the_push_limit_is_capped_at_the_stores_batch_limit(make_service: Callable[..., CountsService]) -> None:
    service = make_service(max_push_rows=10**9, max_batch_rows=50)
    assert service.servicer.max_push_rows == 50
    ns = service.namespace()
    err = rpc_error(lambda: service.push(ns, "c", 1, np.repeat(batch([row([1], 2)]), 51, axis=0)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason(err) == "LIMIT"
    assert service.push(ns, "c", 1, np.repeat(batch([row([1], 2)]), 50, axis=0)).applied_units >= 1


def test_unknown_namespace_is_not_found(service: CountsService) -> None:
    missing = "s-missing-" + uuid.uuid4().hex[:8]
    for call in (lambda: service.push(missing, "c", 1, batch([row([1], 2)])),
                 lambda: service.push(missing, "c", 1, batch([])),
                 lambda: service.pull(missing),
                 lambda: service.pull(missing, 12345)):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND and reason(err) == "NAMESPACE_NOT_FOUND"
    err = rpc_error(lambda: service.push("bad name", "c", 1, batch([])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


# --------------------------------------------------------------------------- Pull


def test_pull_chunks_are_bounded_and_only_the_last_is_complete(make_service: Callable[..., CountsService]) -> None:
    service = make_service(max_chunk_rows=64)
    ns = service.namespace(buckets=1024)
    rng = np.random.default_rng(5)
    expected: Counter[tuple[int, ...]] = Counter()
    for seq in range(4):
        deltas = random_batch(rng, 250, hot=400)
        expected.update(as_counter(deltas))
        service.push(ns, "c", seq, deltas)
    assert len(expected) > 5 * 64
    for asked, bound in ((7, 7), (64, 64), (0, 64), (10**6, 64)):  # 0: the default, capped like the rest
        chunks = service.pull(ns, max_chunk_rows=asked)
        check_chunks(chunks, bound)
        assert len(chunks) >= len(expected) // bound
        assert totals(chunks) == expected


def test_pull_chunks_default_to_16384_rows(make_service: Callable[..., CountsService]) -> None:
    service = make_service(max_chunk_rows=10**6, max_push_rows=50_000)
    ns = service.namespace(buckets=1024)
    deltas = random_batch(np.random.default_rng(8), 40_000, hot=5000)
    service.push(ns, "c", 1, deltas)
    expected = as_counter(deltas)
    assert len(expected) > 2 * DEFAULT_CHUNK_ROWS
    chunks = service.pull(ns)
    check_chunks(chunks, DEFAULT_CHUNK_ROWS)
    assert [len(bytes_to_count_rows(c.rows)) for c in chunks[:-1]] == [DEFAULT_CHUNK_ROWS] * (len(chunks) - 1)
    assert totals(chunks) == expected


def test_an_empty_namespace_pulls_one_empty_complete_chunk(service: CountsService) -> None:
    ns = service.namespace()
    chunks = service.pull(ns)
    assert len(chunks) == 1 and chunks[0].complete and chunks[0].rows == b"" and chunks[0].version > 0
    time.sleep(0.002)
    quiet = service.pull(ns, chunks[0].version)
    assert len(quiet) == 1 and quiet[0].complete and quiet[0].rows == b""


def test_mirror_by_export_then_changes_since_and_resume_a_broken_stream(service: CountsService) -> None:
    ns = service.namespace(buckets=1024)
    rng = np.random.default_rng(6)
    for seq in range(3):
        service.push(ns, "a", seq, random_batch(rng, 300, hot=300))
    first = service.pull(ns, max_chunk_rows=50)
    mirror = totals(first)
    version = check_chunks(first, 50)
    for round_ in range(3):
        for seq in range(2):
            service.push(ns, f"w{round_}", seq, random_batch(rng, 80, hot=300))
        time.sleep(0.002)
        # A stream broken after its first chunk: pull again from the same version.
        request = counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=FP, since_version=version,
                                         max_chunk_rows=5)
        stream = service.stub.Pull(request, timeout=30)
        partial = next(stream)
        assert not partial.complete
        stream.cancel()
        chunks = service.pull(ns, version, max_chunk_rows=5)
        new_version = check_chunks(chunks, 5)
        assert new_version >= version
        for r in bytes_to_count_rows(b"".join(c.rows for c in chunks)).tolist():
            mirror[tuple(r[:KEY_WIDTH])] = r[COUNT]  # upsert absolute counts
        assert mirror == exported(service.store, ns)
        version = new_version


def test_pull_since_a_version_the_store_no_longer_keeps_is_out_of_range(
        make_service: Callable[..., CountsService]) -> None:
    service = make_service(history_epochs=2)
    ns = service.namespace()
    old = service.pull(ns)[-1].version
    for seq in range(5):
        time.sleep(0.002)
        service.push(ns, "c", seq, batch([row([seq], 1)]))
        service.store.version(ns)  # each version read (a mirror's Pull) opens a new epoch
    latest = service.pull(ns)[-1].version
    for since in (old, latest + 10**9):
        err = rpc_error(lambda since=since: service.pull(ns, since))  # type: ignore[misc]
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and reason(err) == "RESYNC_REQUIRED"
    # The resync: a full export and its version work.
    assert totals(service.pull(ns)) == Counter({(1, s, -1, -1, -1, 1): 1 for s in range(5)})


def test_pull_of_a_recreated_namespace_asks_for_resync(service: CountsService) -> None:
    ns = service.namespace()
    service.push(ns, "c", 1, batch([row([1], 2)]))
    version = service.pull(ns)[-1].version
    service.store.drop_namespace(ns)
    time.sleep(0.002)
    service.store.create_namespace(ns, FP, VOCAB)
    err = rpc_error(lambda: service.pull(ns, version))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE and reason(err) == "RESYNC_REQUIRED"
    assert totals(service.pull(ns)) == Counter()


def test_pull_checks_the_tokenizer(service: CountsService) -> None:
    ns = service.namespace()
    err = rpc_error(lambda: service.pull(ns, fingerprint=OTHER_FP))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and reason(err) == "TOKENIZER_MISMATCH"
    err = rpc_error(lambda: service.pull(ns, fingerprint=b""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("recreate", [False, True], ids=["dropped", "recreated"])
def test_a_namespace_dropped_during_an_export_ends_the_pull_not_found(
        service: CountsService, monkeypatch: pytest.MonkeyPatch, recreate: bool) -> None:
    ns = service.namespace(buckets=256)
    service.push(ns, "c", 1, random_batch(np.random.default_rng(9), 600, hot=300))
    store = service.store
    export = store.export

    def export_then_drop(namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        parts = export(namespace, chunk_rows=chunk_rows)
        yield next(parts)
        store.drop_namespace(namespace)
        if recreate:
            store.create_namespace(namespace, FP, VOCAB)
        yield from parts

    monkeypatch.setattr(store, "export", export_then_drop)
    err = rpc_error(lambda: service.pull(ns, max_chunk_rows=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND and reason(err) == "NAMESPACE_NOT_FOUND"


# --------------------------------------------------------------------------- the store going away


def test_a_stopped_redis_gives_unavailable_and_the_service_recovers() -> None:
    with RedisServer(args=["--appendonly", "yes", "--appendfsync", "always"]) as redis_server:
        store = open_counts_store(redis_server.url, epoch_seconds=0, socket_timeout=1, connect_timeout=0.5,
                                  retries=1)
        service, runner = served(store)
        ns = service.namespace()
        try:
            first = batch([row([1, 2], 3, 4)])
            service.push(ns, "c", 1, first)
            redis_server.stop()
            second = batch([row([1, 2], 3, 1), row([7], 8)])
            for call in (lambda: service.push(ns, "c", 2, second), lambda: service.pull(ns)):
                err = rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                assert "password" not in (err.details() or "")
            redis_server.start()
            deadline = time.monotonic() + 20
            while True:  # what a sender does: retry the same batch until acknowledged
                try:
                    service.push(ns, "c", 2, second)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    time.sleep(0.1)
            assert service.push(ns, "c", 2, second).duplicate
            assert totals(service.pull(ns)) == as_counter(first) + as_counter(second)
        finally:
            service.store.drop_namespace(ns)
            service.server.stop()
            runner.close()
