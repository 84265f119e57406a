"""The fleet history's SubscribeHistory stream through a real service on loopback: the RPC's pages, cursors and errors,
the client mirror reading its tail from one stream (resumed after a restart, cancelled without harm), and the fallback
to PullHistory long polls for a service without the stream."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from helpers.redis_servers import free_port
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient
from ngramcache.cache_service.servicers.counts import CountsServicer
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

pytestmark = pytest.mark.integration

FP = b"\x05" * 32
VOCAB = 1000
FAST = {"pull_interval": 0.05, "push_interval": 0.02, "connect_timeout": 5.0, "ready_timeout": 20.0,
        "close_timeout": 5.0, "mode": "match"}
PULL_HISTORY = "/ngramcache.v1.Counts/PullHistory"
SUBSCRIBE = "/ngramcache.v1.Counts/SubscribeHistory"


def embedded(tmp_path: Path, query: str = "") -> str:
    return f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0{query}"


def record(seq: int, *tokens: int, offset: int = 0, group: str = "") -> counts_pb2.HistoryRecord:
    return counts_pb2.HistoryRecord(seq=seq, group=group, offset=offset,
                                    tokens=tokens_to_bytes(np.array(tokens, dtype=np.int32)))


def create(address: str, name: str) -> None:
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
            name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)


def push(stub: counts_pb2_grpc.CountsStub, client: str, seq: int, *records: counts_pb2.HistoryRecord,
         ns: str = "h") -> None:
    stub.PushHistory(counts_pb2.PushHistoryRequest(namespace=ns, tokenizer_fingerprint=FP, client_id=client, seq=seq,
                                                   records=list(records)), timeout=10)


def subscribe(stub: counts_pb2_grpc.CountsStub, after: str = "", **fields: object) -> Iterator[counts_pb2.PullHistoryResponse]:
    fields = {"namespace": "h", "tokenizer_fingerprint": FP, **fields}
    stream: Iterator[counts_pb2.PullHistoryResponse] = stub.SubscribeHistory(
        counts_pb2.PullHistoryRequest(after=after, **fields), timeout=30)  # type: ignore[arg-type]
    return stream


def rpcs(svc: ServiceThread, method: str) -> float:
    """Calls of ``method`` the service ended so far, whatever their code."""
    assert svc.service is not None and svc.service.metrics is not None
    total = 0.0
    for metric in svc.service.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "ngramcache_rpc_total" and sample.labels.get("method") == method:
                total += sample.value
    return total


def shape(page: counts_pb2.PullHistoryResponse) -> list[tuple[str, int, list[int]]]:
    return [(r.client_id, r.seq, bytes_to_tokens(r.tokens).tolist()) for r in page.records]


def test_subscribe_history_pages_cursors_filters_and_errors(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        ch = grpc.insecure_channel(address)
        stub = counts_pb2_grpc.CountsStub(ch)
        push(stub, "a", 0, record(1, 1, 2, 3, group="g"), record(1, 4, 5, offset=3, group="g"))
        push(stub, "b", 0, record(7, 9, 9, group="other"))

        stream = subscribe(stub, wait_ms=300)
        first = next(stream)
        assert shape(first) == [("a", 1, [1, 2, 3]), ("a", 1, [4, 5]), ("b", 7, [9, 9])] and not first.gap
        # Nothing new: an empty message after wait_ms (not before; the stream's 30 s deadline bounds the wait), the
        # cursor unchanged; then a push arrives on the same stream, after the empty messages sent meanwhile.
        started = time.monotonic()
        idle = next(stream)
        assert idle.records == [] and idle.cursor == first.cursor and time.monotonic() - started > 0.2
        threading.Timer(0.2, lambda: push(stub, "c", 0, record(3, 42))).start()
        news = next(stream)
        while not news.records:
            assert news.cursor == first.cursor
            news = next(stream)
        assert shape(news) == [("c", 3, [42])]
        stream.cancel()  # type: ignore[attr-defined]

        # max_records bounds each message; the next one goes on from its cursor.
        paged = subscribe(stub, max_records=2)
        assert [r.seq for r in next(paged).records] == [1, 1]
        assert [r.seq for r in next(paged).records] == [7, 3]
        paged.cancel()  # type: ignore[attr-defined]

        # exclude_client_id: the caller's records are skipped, the cursor moves past them.
        mine = subscribe(stub, exclude_client_id="a", wait_ms=300)
        page = next(mine)
        assert [r.client_id for r in page.records] == ["b", "c"] and page.cursor == news.cursor
        push(stub, "a", 1, record(4, 7))
        skipped = next(mine)
        assert skipped.records == [] and skipped.cursor != news.cursor  # past a's record, nothing sent
        mine.cancel()  # type: ignore[attr-defined]
        groups = subscribe(stub, groups=["g"])
        assert [r.group for r in next(groups).records] == ["g", "g"]
        groups.cancel()  # type: ignore[attr-defined]

        def code(**fields: object) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as caught:
                next(subscribe(stub, **fields))
            return caught.value.code(), caught.value.details() or ""

        assert code(after="not a cursor") == (grpc.StatusCode.INVALID_ARGUMENT, "malformed history cursor 'not a cursor'")
        assert code(namespace="nope") == (grpc.StatusCode.NOT_FOUND, "no counts namespace 'nope'")
        assert code(tokenizer_fingerprint=b"\x06" * 32) == (
            grpc.StatusCode.FAILED_PRECONDITION, "namespace 'h' is bound to tokenizer 0505050505050505..., not "
            "0606060606060606...")
        ch.close()


def test_a_cursor_the_ring_and_the_store_no_longer_reach_gives_a_gap(tmp_path: Path) -> None:
    # A store keeping 100 tokens and a replica's tail keeping about one record: the first cursor falls out of both.
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path, "&history_max_bytes=400"),
                       history_tail_bytes=256) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        with grpc.insecure_channel(address) as ch:
            stub = counts_pb2_grpc.CountsStub(ch)
            push(stub, "a", 0, record(0, *range(30)))
            stream = subscribe(stub)
            start = next(stream).cursor
            stream.cancel()  # type: ignore[attr-defined]
            for b in range(1, 12):
                push(stub, "a", b, record(b, *range(30)))
            behind = subscribe(stub, after=start)
            page = next(behind)
            assert page.gap and [r.seq for r in page.records] == [9, 10, 11]
            behind.cancel()  # type: ignore[attr-defined]


def test_a_record_reaches_another_client_through_its_stream_with_no_unary_tail_call(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        with NgramClient(address, "h", (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
                NgramClient(address, "h", (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
            wait_until(lambda: b.stats()["history_tail_streams"] == 1, 10.0, "B's stream")
            time.sleep(0.5)
            unary = rpcs(svc, PULL_HISTORY)
            rng = np.random.default_rng(5)
            for trial in range(3):
                text = rng.integers(0, VOCAB, 64, dtype=np.int32)
                a.drafter().accept(trial, text)
                # Pulled counts can draft the sequence before the history lands: wait on the history itself.
                wait_until(lambda: b.stats()["history_appended_tokens"] >= 64 * (trial + 1), 10.0,  # noqa: B023
                           "B appending A's sequence")
                assert b.drafter().draft(100 + trial, text[:24], 8).tolist() == text[24:32].tolist()
            stats = b.stats()
            assert stats["history_pulled_tokens"] == 3 * 64 and stats["history_appended_tokens"] == 3 * 64
            assert stats["history_tail_streams"] == 1  # one stream the whole time
            assert rpcs(svc, PULL_HISTORY) == unary  # and no PullHistory call (B publishes nothing: no group pull)


def test_a_cancelled_stream_leaves_the_service_answering(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        with grpc.insecure_channel(address) as ch:
            stub = counts_pb2_grpc.CountsStub(ch)
            push(stub, "a", 0, record(1, 5))
            waiting = [subscribe(stub, wait_ms=5000) for _ in range(4)]
            for s in waiting:
                next(s)  # each now waits on the tail
            for s in waiting:
                s.cancel()  # type: ignore[attr-defined]
            other = subscribe(stub, wait_ms=5000)
            next(other)
            push(stub, "a", 1, record(2, 6))
            assert shape(next(other)) == [("a", 2, [6])]
            other.cancel()  # type: ignore[attr-defined]
            page = stub.PullHistory(counts_pb2.PullHistoryRequest(namespace="h", tokenizer_fingerprint=FP), timeout=10)
            assert [r.seq for r in page.records] == [1, 2]
            # The cancelled streams' handlers ended (the service counts a call when it ends).
            wait_until(lambda: rpcs(svc, SUBSCRIBE) == 5, 5.0, "the cancelled streams to end")


def test_a_streaming_client_resumes_after_a_service_restart_and_appends_nothing_twice(
        tmp_path: Path, redis_standalone: object) -> None:
    port = free_port()
    url = redis_standalone.url  # type: ignore[attr-defined]

    def service() -> ServiceThread:
        svc = ServiceThread(tmp_path / "data", counts=url)
        svc.config = dataclasses.replace(svc.config, port=port)
        return svc

    address = f"127.0.0.1:{port}"
    ns = "restart-stream"
    rng = np.random.default_rng(9)
    texts = [rng.integers(0, VOCAB, 48, dtype=np.int32) for _ in range(4)]
    with service():
        create(address, ns)
        reader = NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST)
        try:
            with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a:
                a.drafter().accept(0, texts[0])
                a.drafter().accept(1, texts[1])
            wait_until(lambda: reader.stats()["history_pulled_tokens"] == 2 * 48, 10.0, "the first records")
        except BaseException:
            reader.close()
            raise
    try:
        assert reader.stats()["history_tail_streams"] == 1
        with service():
            with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a2", **FAST) as a:
                a.drafter().accept(2, texts[2])
                a.drafter().accept(3, texts[3])
            wait_until(lambda: reader.stats()["history_pulled_tokens"] >= 4 * 48, 20.0, "the stream to resume")
            time.sleep(0.3)
            stats = reader.stats()
            # Reopened from its last cursor: the first two records were not read again, each token appended once.
            assert stats["history_tail_streams"] >= 2
            assert stats["history_pulled_tokens"] == stats["history_appended_tokens"] == 4 * 48
            assert stats["history_repeated_tokens"] == 0 and stats["history_gaps"] == 0
    finally:
        reader.close()


async def _no_stream(self: CountsServicer, request: counts_pb2.PullHistoryRequest,
                     context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullHistoryResponse]:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")  # what a server without the RPC answers
    yield counts_pb2.PullHistoryResponse()  # never reached (abort raises): this makes it a stream handler


def test_a_service_without_the_stream_is_mirrored_by_long_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(CountsServicer, "SubscribeHistory", _no_stream, raising=False)  # raising: an older tree has none
    caplog.set_level(logging.INFO, logger="ngramcache.client.sync")
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        with NgramClient(address, "h", (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
                NgramClient(address, "h", (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
            text = np.arange(100, 164, dtype=np.int32)
            a.drafter().accept(0, text)
            # B's pulled counts alone can draft this sequence too: wait on the history it appended, then draft.
            wait_until(lambda: b.stats()["history_appended_tokens"] >= 64, 10.0, "B appending A's history")
            assert b.stats()["history_appended_tokens"] == 64
            assert b.drafter().draft(9, text[:24], 8).tolist() == text[24:32].tolist()
            assert rpcs(svc, PULL_HISTORY) >= 1
    lines = [r.getMessage() for r in caplog.records if "SubscribeHistory" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records if "SubscribeHistory" in
                                   r.getMessage()), lines  # one line per client
    assert lines[0] == (f"ngramcache client: the service at {address} has no SubscribeHistory (an older version); "
                        "fleet history read by PullHistory long polls")


def test_a_stream_whose_reader_does_not_read_is_held_back_and_slows_no_other(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        create(address, "h")
        assert svc.service is not None and svc.service.metrics is not None
        registry = svc.service.metrics.registry

        def served() -> float:
            return registry.get_sample_value("ngramcache_history_served_records_total") or 0.0

        with grpc.insecure_channel(address) as ch, grpc.insecure_channel(address) as other:
            stub = counts_pb2_grpc.CountsStub(ch)
            stalled = subscribe(stub, max_records=1)  # opened, never read past its first message
            push(stub, "a", 0, record(0, *[7] * 4000))
            next(stalled)
            for b in range(1, 21):  # 500 records of 4,000 tokens: 8 MB
                push(stub, "a", b, *[record(b * 100 + i, *[7] * 4000) for i in range(25)])
            reader = subscribe(counts_pb2_grpc.CountsStub(other), max_records=64)
            got, started = 0, time.monotonic()
            while got < 501:
                got += len(next(reader).records)
            assert time.monotonic() - started < 10.0
            time.sleep(0.5)
            # The reader got its 501 records. The stalled stream got what the transports' windows took (about 4 MB,
            # 262 messages of 16 kB in a trial) and the one page its handler holds: not the 500 waiting for it.
            held = served() - 501 - 1
            assert held < 400, held
            reader.cancel()  # type: ignore[attr-defined]
            stalled.cancel()  # type: ignore[attr-defined]


def test_the_stream_reopens_on_the_next_replica_after_a_failover(tmp_path: Path, redis_standalone: object) -> None:
    url = redis_standalone.url  # type: ignore[attr-defined]
    rng = np.random.default_rng(17)
    texts = [rng.integers(0, VOCAB, 40, dtype=np.int32) for _ in range(4)]
    with ServiceThread(tmp_path / "one", counts=url) as first, ServiceThread(tmp_path / "two", counts=url) as second:
        addresses = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
        ns = "failover-stream"
        create(addresses[0], ns)
        with NgramClient(addresses, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **{**FAST, "failover_timeout": 2.0}) as b:
            with NgramClient(addresses[1:], ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a:
                a.drafter().accept(0, texts[0])
                a.drafter().accept(1, texts[1])
                wait_until(lambda: b.stats()["history_pulled_tokens"] == 2 * 40, 10.0, "the first records")
                assert b.stats()["address"] == addresses[0] and b.stats()["history_tail_streams"] == 1
                first.stop(1.0)  # B's replica goes away: its stream ends, B fails over and reopens there
                a.drafter().accept(2, texts[2])
                a.drafter().accept(3, texts[3])
                wait_until(lambda: b.stats()["history_pulled_tokens"] >= 4 * 40, 20.0, "the stream on the other replica")
            time.sleep(0.3)
            s = b.stats()
            assert s["address"] == addresses[1] and s["history_tail_streams"] >= 2, s
            assert s["history_pulled_tokens"] == s["history_appended_tokens"] == 4 * 40 and s["history_gaps"] == 0, s
