"""The draft view followed on one Pull stream (PullRequest.follow) through a real service on loopback: the stream's
batches, quiet batches, resets and errors; a client mirroring through one stream (resumed after a restart, cancelled
without harm); and the fallback to one Pull an answer for a service that ignores ``follow``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio
from helpers.corpus import FAST, FP, VOCAB, motif_corpus
from helpers.draft_view import pull_view, settled_view
from helpers.redis_servers import free_port
from helpers.service import ServiceThread, wait_until

from ngramcache import CountTable, NgramClient
from ngramcache.cache_service.servicers.counts import CountsServicer
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows

pytestmark = pytest.mark.integration

PULL = "/ngramcache.v1.Counts/Pull"
VIEW = {"mirror_interval": 0.05, "view_top_k": 64, "view_min_change_pct": 0, "view_max_rows_per_second": 10**9}
corpus = functools.partial(motif_corpus, noise=True)


def create_namespace(address: str, name: str | None = None) -> str:
    name = name or "f-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


def follow(stub: counts_pb2_grpc.CountsStub, namespace: str, **fields: object) -> Iterator[counts_pb2.PullResponse]:
    stream: Iterator[counts_pb2.PullResponse] = stub.Pull(counts_pb2.PullRequest(
        namespace=namespace, tokenizer_fingerprint=FP, view=counts_pb2.PULL_VIEW_DRAFT, follow=True,
        **fields), timeout=60)  # type: ignore[arg-type]
    return stream


def batch(stream: Iterator[counts_pb2.PullResponse]) -> list[counts_pb2.PullResponse]:
    """The stream's next batch: chunks up to one with complete = true."""
    chunks = [next(stream)]
    while not chunks[-1].complete:
        chunks.append(next(stream))
    return chunks


def rows(chunks: list[counts_pb2.PullResponse]) -> int:
    return sum(len(bytes_to_count_rows(c.rows)) for c in chunks)


def rows_of(table: CountTable) -> list[tuple[int, ...]]:
    return sorted(map(tuple, table.to_rows().tolist()))


def rpcs(svc: ServiceThread, method: str) -> float:
    """Calls of ``method`` the service ended so far, whatever their code."""
    assert svc.service is not None and svc.service.metrics is not None
    return sum(sample.value for metric in svc.service.metrics.registry.collect() for sample in metric.samples
               if sample.name == "ngramcache_rpc_total" and sample.labels.get("method") == method)


def push_text(client: NgramClient, seq: int, text: object) -> None:
    client.drafter().accept(seq, text)  # type: ignore[arg-type]
    wait_until(lambda: client.stats()["pending_rows"] == 0
               and client.stats()["acked_count"] == client.stats()["drained_count"] > 0, what="pushes")


def mirrors_view(client: NgramClient, address: str, namespace: str) -> None:
    view_id, version, served = settled_view(address, namespace)
    wait_until(lambda: client.stats()["view_id"] == view_id and client.stats()["mirror_version"] >= version,
               20.0, "the client's mirror to reach the view")
    assert rows_of(client.drafter().dynamic) == rows_of(served)


def test_a_follow_stream_sends_each_update_a_quiet_batch_and_a_reset(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", **VIEW) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with grpc.insecure_channel(address) as ch, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a:
            stub = counts_pb2_grpc.CountsStub(ch)
            stream = follow(stub, ns, wait_ms=400)
            first = batch(stream)  # no since_version: the whole view
            assert all(c.reset for c in first) and rows(first) == 0
            view_id, version = first[-1].view_id, first[-1].version
            push_text(a, 1, corpus(1, 600))
            # The next updates arrive on the same stream as changes of the same view.
            got = 0
            while got == 0:
                chunks = batch(stream)
                assert not any(c.reset for c in chunks) and chunks[-1].view_id == view_id
                assert chunks[-1].version >= version
                version, got = chunks[-1].version, rows(chunks)
            # Quiet: an empty complete chunk after wait_ms, same version.
            settled = settled_view(address, ns)[1]
            while version < settled:
                version = batch(stream)[-1].version
            for _ in range(4):  # the empty batches sent while the test was settling come at once; then one a wait
                start = time.monotonic()
                quiet = batch(stream)
                took = time.monotonic() - start
                assert len(quiet) == 1 and quiet[0].complete and not quiet[0].rows and not quiet[0].reset
                # Latency is this check's point: a quiet batch comes each wait_ms (0.4 s), not only at the stream's
                # 60 s deadline. 20 s is 10x the bound it had (2 s, reached on a loaded machine).
                assert quiet[0].version == version and took < 20.0, took
                if took > 0.3:
                    break
            assert took > 0.3, took
            # The view rebuilt (a new incarnation): the whole view again on the same stream, with reset.
            assert svc.service is not None
            registry = svc.service.registry

            async def rebuild() -> None:
                view = (await registry.get(ns)).view
                assert view is not None
                view.install(*view.build(view.full, view.scale))

            svc.run(rebuild())
            again = batch(stream)
            new_id, _, served = pull_view(address, ns)
            assert all(c.reset for c in again) and again[-1].view_id == new_id != view_id
            assert rows(again) == served.n_entries > 0
            stream.cancel()  # type: ignore[attr-defined]
            # Errors as for Pull.
            with pytest.raises(grpc.RpcError) as e:
                batch(follow(stub, "nope"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
            assert e.value.details() == "no counts namespace 'nope'"  # type: ignore[attr-defined]
            with pytest.raises(grpc.RpcError) as e:
                batch(stub.Pull(counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=b"\x01" * 32,
                                                       view=counts_pb2.PULL_VIEW_DRAFT, follow=True), timeout=10))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            assert e.value.details() == (f"namespace '{ns}' is bound to tokenizer {FP.hex()[:16]}..., not "  # type: ignore[attr-defined]
                                         f"{'01' * 8}...")


def test_counts_reach_another_client_through_one_stream(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", **VIEW) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
            for trial in range(3):
                push_text(a, trial, corpus(trial + 1, 800))
                mirrors_view(b, address, ns)
                assert b.stats()["mirror_pulls"] == 1  # one stream the whole time
            assert b.stats()["pulled_rows"] > 0
            assert a.stats()["mirror_pulls"] == 1


def test_a_quiet_view_keeps_its_stream_open(tmp_path: Path) -> None:
    """The service's empty batches come pull_interval + the wait apart: a client with a short rpc_timeout does not
    take that silence for a hung replica (it would reopen its stream)."""
    with ServiceThread(tmp_path / "data", **VIEW) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b",
                         **{**FAST, "pull_interval": 0.9, "rpc_timeout": 0.5}) as b:
            wait_until(lambda: b.stats()["mirror_pulls"] == 1 and b.stats()["view_id"] != "", 10.0, "B's stream")
            time.sleep(7.0)  # two quiet batches (0.9 + 2 s apart)
            assert b.stats()["mirror_pulls"] == 1


async def _pull_view_ignoring_follow(self: CountsServicer, request: counts_pb2.PullRequest, chunk_rows: int,
                                     context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullResponse]:
    older = counts_pb2.PullRequest()
    older.CopyFrom(request)
    older.ClearField("follow")  # what a service from before the field does: one answer, then the stream ends
    async for chunk in _PULL_VIEW(self, older, chunk_rows, context):
        yield chunk


_PULL_VIEW = CountsServicer._pull_view


def test_a_service_that_ignores_follow_is_mirrored_by_one_pull_an_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(CountsServicer, "_pull_view", _pull_view_ignoring_follow)
    caplog.set_level(logging.INFO, logger="ngramcache.client.sync")
    with ServiceThread(tmp_path / "data", **VIEW) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
            for trial in range(2):
                push_text(a, trial, corpus(trial + 1, 800))
                mirrors_view(b, address, ns)
            assert b.stats()["mirror_pulls"] >= 2 and rpcs(svc, PULL) >= 2
    failures = [r.getMessage() for r in caplog.records if "mirror failed" in r.getMessage()]
    assert failures == []  # a stream that ends after its answer is no error


def test_a_following_client_resumes_after_a_service_restart(tmp_path: Path, redis_standalone: object) -> None:
    port = free_port()
    url = redis_standalone.url  # type: ignore[attr-defined]

    def service() -> ServiceThread:
        svc = ServiceThread(tmp_path / "data", counts=url, **VIEW)
        svc.config = dataclasses.replace(svc.config, port=port)
        return svc

    address = f"127.0.0.1:{port}"
    with service():
        ns = create_namespace(address, "restart-follow")
        reader = NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST)
        try:
            with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a:
                push_text(a, 0, corpus(1, 800))
            mirrors_view(reader, address, ns)
            # One stream while the service lives (its stop ends the stream, and the client reopens it at once).
            assert reader.stats()["mirror_pulls"] == 1
        except BaseException:
            reader.close()
            raise
    try:
        with service():
            with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a2", **FAST) as a:
                push_text(a, 1, corpus(2, 800))
            mirrors_view(reader, address, ns)  # a new service, a new view: reloaded on the reopened stream
            assert reader.stats()["mirror_pulls"] >= 2 and reader.stats()["resyncs"] >= 1
    finally:
        reader.close()


def test_a_cancelled_follow_stream_leaves_the_service_answering(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", **VIEW) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with grpc.insecure_channel(address) as ch, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a:
            stub = counts_pb2_grpc.CountsStub(ch)
            waiting = [follow(stub, ns, wait_ms=5000) for _ in range(4)]
            for s in waiting:
                batch(s)  # each now waits for the view's next update
            for s in waiting:
                s.cancel()  # type: ignore[attr-defined]
            other = follow(stub, ns, wait_ms=5000)
            batch(other)
            push_text(a, 1, corpus(1, 600))
            got = batch(other)
            assert rows(got) > 0 and not got[-1].reset
            other.cancel()  # type: ignore[attr-defined]
            assert pull_view(address, ns)[2].n_entries > 0  # a plain Pull answers
            # The cancelled streams' handlers ended (the service counts a call when it ends): the 5 streams and the
            # plain Pull ("a" follows the view on its own stream, still open).
            wait_until(lambda: rpcs(svc, PULL) == 6, 5.0, "the cancelled streams to end")
