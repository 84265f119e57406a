"""What an idle NgramClient costs the service: its calls per second, against the real service on loopback.

A fleet's fixed cost is its idle clients' calls times the clients (at 64 clients on
two cores they can take most of the CPU); changes must still reach a waiting client at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.sync.mirror import PULL_WAIT_MS

pytestmark = pytest.mark.integration

PULL = "/ngramcache.v1.Counts/Pull"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceThread]:
    with ServiceThread(tmp_path / "data", counts=f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0",
                       mirror_interval=0.05) as svc:
        yield svc


def namespace(svc: ServiceThread) -> str:
    name = "idle-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


def pulls(svc: ServiceThread) -> float:
    """Counts Pull calls the service ended so far."""
    assert svc.service is not None and svc.service.metrics is not None
    value = svc.service.metrics.registry.get_sample_value("ngramcache_rpc_total", {"method": PULL, "code": "OK"})
    return value or 0.0


def test_an_idle_client_follows_the_draft_view_on_one_stream(tmp_path: Path, service: ServiceThread) -> None:
    ns = namespace(service)
    with NgramClient(f"127.0.0.1:{service.port}", ns, (FP, VOCAB), cache_dir=tmp_path / "c", **FAST) as client:
        wait_until(lambda: client.stats()["mirror_version"] is not None, 10.0, "the first pull")
        time.sleep(0.5)
        before, opened, t0 = pulls(service), client.stats()["mirror_pulls"], time.monotonic()
        time.sleep(3.0)
        ended, seconds = pulls(service) - before, time.monotonic() - t0
        # Polling every pull_interval (0.1 s) made about 30 calls in 3 s, a long poll of PULL_WAIT_MS one per wait;
        # following the view, the one stream stays open: no Pull starts or ends.
        assert opened == 1 and client.stats()["mirror_pulls"] == 1 and ended == 0, \
            f"in {seconds:.1f} s: {ended:.0f} Pull calls ended, {client.stats()['mirror_pulls']} opened in all"


def test_a_change_reaches_a_waiting_client_at_once(tmp_path: Path, service: ServiceThread) -> None:
    ns = namespace(service)
    address = f"127.0.0.1:{service.port}"
    with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
            NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
        wait_until(lambda: b.stats()["mirror_version"] is not None, 10.0, "B's first pull")
        time.sleep(1.0)  # B's pull now waits on the service
        text = np.array([5, 6, 7, 8, 9, 10, 11, 12] * 4, dtype=np.int32)
        probe = np.array([1, 5, 6, 7], dtype=np.int32)
        assert b.drafter().draft(2, probe, 4).size == 0
        t0 = time.monotonic()
        a.drafter().accept(1, text)
        wait_until(lambda: b.drafter().draft(2, probe, 4).size > 0, 5.0, "B to draft A's counts")
        took = time.monotonic() - t0
        # A's push (push_interval 0.05 s), the service's mirror (0.05 s), then B's waiting pull answers: well
        # under the wait of PULL_WAIT_MS, which would be the delay if the waiting pull were not woken.
        assert took < PULL_WAIT_MS / 1000 / 2, f"A's counts reached B after {took:.2f} s"


def calls(svc: ServiceThread, method: str) -> float:
    assert svc.service is not None and svc.service.metrics is not None
    value = svc.service.metrics.registry.get_sample_value("ngramcache_rpc_total", {"method": method, "code": "OK"})
    return value or 0.0


def test_an_idle_match_client_makes_few_calls_a_second(tmp_path: Path, service: ServiceThread) -> None:
    ns = namespace(service)
    with NgramClient(f"127.0.0.1:{service.port}", ns, (FP, VOCAB), cache_dir=tmp_path / "c", mode="match",
                     **FAST) as client:
        wait_until(lambda: client.stats()["mirror_version"] is not None, 10.0, "the first pull")
        time.sleep(1.0)
        methods = ("/ngramcache.v1.Counts/Pull", "/ngramcache.v1.Counts/PullHistory",
                   "/ngramcache.v1.Counts/SubscribeHistory")
        streams = ("mirror_pulls", "history_tail_streams")
        before, opened, t0 = [calls(service, m) for m in methods], [client.stats()[k] for k in streams], \
            time.monotonic()
        time.sleep(4.5)
        seconds = time.monotonic() - t0
        made = {m.rsplit("/", 1)[1]: calls(service, m) - b for m, b in zip(methods, before)}
        now = [client.stats()[k] for k in streams]
        # The draft view and the history's tail each on one stream that stays open: no call starts or ends
        # (polling every pull_interval made about 45 Pulls in 4.5 s; long polls, 3 Pulls and 2 PullHistory).
        assert opened == [1, 1] and now == [1, 1], f"streams opened {opened} then {now}"
        assert made == {"Pull": 0, "PullHistory": 0, "SubscribeHistory": 0}, f"in {seconds:.1f} s: {made}"


def test_a_draft_view_pull_makes_no_store_call(service: ServiceThread) -> None:
    ns = namespace(service)
    assert service.service is not None and service.service.metrics is not None
    registry = service.service.metrics.registry

    def store_calls() -> float:
        return registry.get_sample_value("ngramcache_store_seconds_count", {"op": "namespace_info"}) or 0.0

    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as ch:
        stub = counts_pb2_grpc.CountsStub(ch)

        def pull(fingerprint: bytes = FP, **fields: object) -> list[counts_pb2.PullResponse]:
            return list(stub.Pull(counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=fingerprint,
                                                         view=counts_pb2.PULL_VIEW_DRAFT, **fields),  # type: ignore[arg-type]
                                  timeout=10))

        last = pull()[-1]
        before = store_calls()
        for _ in range(20):
            last = pull(since_version=last.version, view_id=last.view_id)[-1]
        # Each Pull read the namespace's record from the store before (20 calls here): the replica's registry
        # holds it.
        assert store_calls() - before == 0
        with pytest.raises(grpc.RpcError) as refused:
            pull(since_version=last.version, view_id=last.view_id, fingerprint=bytes(32))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is bound to tokenizer" in (refused.value.details() or "")


def test_a_waiting_pull_is_capped_and_cancellable(service: ServiceThread) -> None:
    """wait_ms is the client's to choose but not unbounded: the largest value waits the server's cap (5 s); a
    client that cancels a waiting Pull leaves the service answering the next one."""
    ns = namespace(service)
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as ch:
        stub = counts_pb2_grpc.CountsStub(ch)

        def request(last: counts_pb2.PullResponse, wait_ms: int) -> counts_pb2.PullRequest:
            return counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=FP, view=counts_pb2.PULL_VIEW_DRAFT,
                                          since_version=last.version, view_id=last.view_id, wait_ms=wait_ms)

        last = list(stub.Pull(counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=FP,
                                                     view=counts_pb2.PULL_VIEW_DRAFT), timeout=10))[-1]
        t0 = time.monotonic()
        answer = list(stub.Pull(request(last, 2**32 - 1), timeout=30))
        took = time.monotonic() - t0
        assert 4.5 < took < 15.0, f"a Pull asking to wait 2**32-1 ms answered after {took:.1f} s (cap 5 s)"
        assert answer[-1].version == last.version and answer[-1].complete
        waiting = stub.Pull(request(last, 5000), timeout=30)
        time.sleep(0.3)
        waiting.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            list(waiting)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        answer = list(stub.Pull(request(last, 0), timeout=10))
        assert answer[-1].version == last.version and answer[-1].complete
