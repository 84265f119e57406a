"""Pushes of many clients aggregated by the service (PushBatcher + apply_group), through a real server on every backend: totals equal what was acknowledged."""

from __future__ import annotations

import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.counts import FP, as_counter
from helpers.service import ServiceThread

from ngramcache import CountTable
from ngramcache.cache_service.counts.store import CountsStore, GroupItem, ItemOutcome
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.rows import COUNT, KEY_WIDTH
from ngramcache.client.wire.codec import bytes_to_count_rows, delta_rows_to_bytes

pytestmark = pytest.mark.integration

VOCAB = 256  # byte tokens
CLIENTS = 8
BATCH_ROWS = 1500


def real_batches(files: int, first: int) -> list[np.ndarray]:
    """Delta batches of real n-grams: standard-library files counted as llama.cpp counts a sequence (1..4-grams of bytes)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 6000)[first:first + files]
    out: list[np.ndarray] = []
    for path in paths:
        table = CountTable()
        table.update(np.frombuffer(path.read_bytes()[:12_000], dtype=np.uint8).astype(np.int32))
        rows = table.to_rows()
        out += [np.ascontiguousarray(rows[i:i + BATCH_ROWS]) for i in range(0, len(rows), BATCH_ROWS)]
    return out


class SlowStore:
    """Counts apply_group calls and their items; every third call is slowed so short deadlines expire mid-call."""

    def __init__(self, store: CountsStore, delay: float) -> None:
        self.calls: list[int] = []
        self._lock = threading.Lock()
        apply_group = store.apply_group

        def slow(namespace: str, items: Sequence[GroupItem]) -> list[ItemOutcome]:
            with self._lock:
                self.calls.append(len(items))
                slow_this = len(self.calls) % 3 == 0
            outcomes = apply_group(namespace, items)
            if slow_this:
                time.sleep(delay)  # the reply is late: the sender's deadline may pass after the batch was applied
            return outcomes

        store.apply_group = slow  # type: ignore[method-assign]  # the service's store, seen by its PushBatcher


@pytest.fixture
def service(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[ServiceThread]:
    url = None if backend == "embedded" else request.getfixturevalue(f"redis_{backend}").url
    with ServiceThread(tmp_path, counts=url) as running:
        yield running


def pulled(stub: counts_pb2_grpc.CountsStub, namespace: str) -> Counter[tuple[int, ...]]:
    total: Counter[tuple[int, ...]] = Counter()
    for chunk in stub.Pull(counts_pb2.PullRequest(namespace=namespace, tokenizer_fingerprint=FP), timeout=60):
        for r in bytes_to_count_rows(chunk.rows).tolist():
            key = tuple(r[:KEY_WIDTH])
            assert key not in total
            total[key] = r[COUNT]
    return total


RETRY_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_eight_clients_pushing_overlapping_ngrams_with_retries_count_exactly_what_was_acknowledged(
        service: ServiceThread) -> None:
    assert service.service is not None
    store = service.service.runner.store
    slow = SlowStore(store, delay=0.3)
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    admin_pb2_grpc.AdminStub(channel).CreateNamespace(admin_pb2.CreateNamespaceRequest(
        name="agg", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=30)
    data = {c: real_batches(3, 3 * c) for c in range(CLIENTS)}
    acknowledged: dict[tuple[str, int], np.ndarray] = {}
    # Per batch: its units, and the units each reply said it applied. On a Cluster a batch is a
    # unit per shard, deduplicated per shard, so two groups holding the same batch at once may
    # each apply some of its units (neither reply is then a whole duplicate): exactly once is per unit.
    units: dict[tuple[str, int], int] = {}
    applied_units: Counter[tuple[str, int]] = Counter()
    stats = Counter[str]()
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(CLIENTS)

    def request(client_id: str, seq: int, deltas: np.ndarray) -> counts_pb2.PushRequest:
        return counts_pb2.PushRequest(namespace="agg", tokenizer_fingerprint=FP, client_id=client_id, seq=seq,
                                      rows=delta_rows_to_bytes(deltas))

    def client(c: int) -> None:
        try:
            stub = counts_pb2_grpc.CountsStub(grpc.insecure_channel(f"127.0.0.1:{service.port}"))
            client_id = f"worker-{c}"
            barrier.wait()
            in_flight: list[tuple[int, Future[Any]]] = []
            for seq, deltas in enumerate(data[c]):
                # Two pushes in flight per client; every fourth batch is sent twice at once (a
                # sender that retried too early); every fifth with a deadline that may expire.
                timeout = 0.05 if seq % 5 == 0 else 30
                in_flight.append((seq, stub.Push.future(request(client_id, seq, deltas), timeout=timeout)))
                if seq % 4 == 0:
                    in_flight.append((seq, stub.Push.future(request(client_id, seq, deltas), timeout=30)))
                while len(in_flight) > 2 or (in_flight and seq == len(data[c]) - 1):
                    sent, future = in_flight.pop(0)
                    try:
                        reply = future.result()
                    except grpc.RpcError as exc:
                        # Expired, or shed because it could not meet its deadline (OVERLOADED: nothing applied).
                        assert exc.code() in RETRY_CODES, exc
                        with lock:
                            stats["deadline exceeded"] += 1
                        while True:  # what a sender does: the same batch again until acknowledged
                            try:
                                reply = stub.Push(request(client_id, sent, data[c][sent]), timeout=30)
                                break
                            except grpc.RpcError as again:
                                assert again.code() in RETRY_CODES, again
                    with lock:
                        stats["duplicate" if reply.duplicate else "applied"] += 1
                        acknowledged[client_id, sent] = data[c][sent]
                        units[client_id, sent] = reply.units
                        applied_units[client_id, sent] += reply.applied_units
            # An acknowledged batch sent again long after: a duplicate.
            assert stub.Push(request(client_id, 1, data[c][1]), timeout=30).duplicate
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(acknowledged) == sum(len(b) for b in data.values())
    expected: Counter[tuple[int, ...]] = Counter()
    for deltas in acknowledged.values():
        expected.update(as_counter(deltas))
    assert pulled(counts_pb2_grpc.CountsStub(channel), "agg") == expected
    # Every unit of every batch applied exactly once, however often it was sent (a reply lost to
    # its deadline is not seen, so at most once in the replies seen)...
    over = {key: (applied_units[key], units[key]) for key in units if applied_units[key] > units[key]}
    assert not over, f"(applied units seen, units) of batches applied more than once: {over}"
    assert all(units.values()) and stats["duplicate"] > 0
    # ...and the service did aggregate: fewer store calls than pushes, some with several clients' batches.
    assert max(slow.calls) > 1 and len(slow.calls) < sum(slow.calls)
    channel.close()
