"""Metrics and call logs of real servers on loopback: calls of every kind, then a scrape of the /metrics port.

The servicers run on a `ServerThread` with the metrics and logging interceptors, either
where the service places them (outside the ErrorInterceptor: ``start_server`` always puts
one ErrorInterceptor outermost, so the "outside" servers get a second, inner one to
observe from outside of) or inside it; both must count the status the client receives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers.corpus import FP, VOCAB, motif_corpus
from helpers.redis_servers import RedisServer
from helpers.service import ServerThread
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ngramcache import CountTable
from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.interceptors.errors import ErrorInterceptor
from ngramcache.cache_service.interceptors.logging import LOG_FIELDS, LoggingInterceptor
from ngramcache.cache_service.interceptors.metrics import OTHER, MetricsInterceptor, rpc_methods
from ngramcache.cache_service.metrics import Metrics, MetricsHttpServer, start_metrics_http_server
from ngramcache.cache_service.namespaces import NamespaceRegistry
from ngramcache.cache_service.servicers.counts import CountsServicer
from ngramcache.cache_service.servicers.drafting import DraftingServicer
from ngramcache.cache_service.servicers.static_files import StaticFilesServicer
from ngramcache.cache_service.static_store import StaticStore
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client._proto.v1 import (
    counts_pb2,
    counts_pb2_grpc,
    drafting_pb2,
    drafting_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.wire.codec import delta_rows_to_bytes, tokens_to_bytes

pytestmark = pytest.mark.integration

SECRET = "s3cr3t-T0KEN-value-9f8e7d"  # sent as `authorization: Bearer ...` with every call
CLIENT_ID = "client-7c1d2e"  # never a label
METADATA = (("authorization", f"Bearer {SECRET}"),)
NAMESPACE = "obs"
RPC_LOGGER = "ngramcache.service.rpc"

DRAFT = "/ngramcache.v1.Drafting/Draft"
SESSION = "/ngramcache.v1.Drafting/Session"
PUSH = "/ngramcache.v1.Counts/Push"
PULL = "/ngramcache.v1.Counts/Pull"
PUBLISH = "/ngramcache.v1.StaticFiles/Publish"


@dataclasses.dataclass
class Observed:
    """The Drafting, Counts and StaticFiles servicers over one store, observed, and the /metrics endpoint."""

    store: CountsStore
    metrics: Metrics
    runner: StoreRunner
    registry: NamespaceRegistry
    server: ServerThread
    http: MetricsHttpServer
    channel: grpc.Channel

    def scrape(self) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
        """The /metrics body and its samples {(name, sorted labels): value} (the body must parse)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http.port}/metrics", timeout=10) as response:
            body: str = response.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(body) for s in family.samples}
        return body, samples

    def value(self, name: str, **labels: str) -> float | None:
        return self.scrape()[1].get((name, tuple(sorted(labels.items()))))

    def close(self) -> None:
        self.http.close()
        self.server.run(self.registry.close())
        self.server.stop()
        self.runner.close()


def observe(store: CountsStore, tmp_path: Path, placement: str) -> Observed:
    metrics = Metrics()
    runner = StoreRunner(store, max_workers=2, metrics=metrics)
    static_store = StaticStore(str(tmp_path / "static"))
    registry = NamespaceRegistry(runner, static_store, mirror_interval=0.05, max_sessions=8, session_memory=1 << 24)
    metrics.watch_namespaces(registry.live)
    drafting = DraftingServicer(registry, max_sessions=8, idle_timeout=30, max_session_tokens=1 << 16,
                                max_step_tokens=1 << 12, max_draft_tokens=1 << 12, metrics=metrics)
    counts = CountsServicer(runner, max_push_rows=1 << 16, max_chunk_rows=1 << 10, metrics=metrics)
    static = StaticFilesServicer(static_store, runner, max_file_bytes=1 << 20)
    methods = rpc_methods("ngramcache.v1.Drafting", "ngramcache.v1.Counts", "ngramcache.v1.StaticFiles")
    observing = [MetricsInterceptor(metrics, methods), LoggingInterceptor(ok_level=logging.INFO)]
    # start_server puts its ErrorInterceptor outermost; "outside" adds one inside the observers.
    interceptors = [*observing, ErrorInterceptor()] if placement == "outside" else observing
    server = ServerThread([(drafting_pb2_grpc.add_DraftingServicer_to_server, drafting),
                           (counts_pb2_grpc.add_CountsServicer_to_server, counts),
                           (static_files_pb2_grpc.add_StaticFilesServicer_to_server, static)],
                          interceptors=interceptors).start()
    http, _ = start_metrics_http_server(metrics, "127.0.0.1", 0)
    return Observed(store, metrics, runner, registry, server, http, server.channel())


@pytest.fixture(params=["outside", "inside"])
def observed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Observed]:
    store = open_counts_store(None, epoch_seconds=0, default_buckets=256)
    store.create_namespace(NAMESPACE, FP, VOCAB)
    obs = observe(store, tmp_path, request.param)
    yield obs
    obs.close()


corpus = functools.partial(motif_corpus, 1, n=3000, motifs=10)

def push_request(rows: bytes, seq: int) -> counts_pb2.PushRequest:
    return counts_pb2.PushRequest(namespace=NAMESPACE, tokenizer_fingerprint=FP, client_id=CLIENT_ID, seq=seq, rows=rows)


def rpc_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == RPC_LOGGER]


def store_ops(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
              prefix: str = "") -> dict[str, float]:
    """{op: value} of a store metric's samples whose op starts with `prefix`."""
    return {dict(labels)["op"]: v for (n, labels), v in samples.items()
            if n == name and dict(labels)["op"].startswith(prefix)}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_calls_of_every_kind_are_counted_timed_and_logged(observed: Observed,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=RPC_LOGGER)
    drafting = drafting_pb2_grpc.DraftingStub(observed.channel)
    counts = counts_pb2_grpc.CountsStub(observed.channel)
    static = static_files_pb2_grpc.StaticFilesStub(observed.channel)
    expected: Counter[tuple[str, str]] = Counter()
    tokens = corpus()
    table = CountTable()
    table.update(tokens)
    deltas = table.to_rows()

    # unary-unary: OK, a duplicate (OK), INVALID_ARGUMENT (not a whole number of rows)
    counts.Push(push_request(delta_rows_to_bytes(deltas), 1), metadata=METADATA, timeout=30)
    assert counts.Push(push_request(delta_rows_to_bytes(deltas), 1), metadata=METADATA, timeout=30).duplicate
    with pytest.raises(grpc.RpcError) as bad_push:
        counts.Push(push_request(b"\x00" * 5, 2), metadata=METADATA, timeout=30)
    assert bad_push.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected.update({(PUSH, "OK"): 2, (PUSH, "INVALID_ARGUMENT"): 1})

    drafted = 0
    draft = drafting.Draft(drafting_pb2.DraftRequest(namespace=NAMESPACE, tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                     tokens=tokens_to_bytes(tokens[:40]), n_draft=8),
                           metadata=METADATA, timeout=30)
    drafted += len(draft.tokens) // 4
    for request, code in ((drafting_pb2.DraftRequest(namespace=NAMESPACE, tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                      tokens=tokens_to_bytes(tokens[:4]), n_draft=0),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (drafting_pb2.DraftRequest(namespace="no-such-ns", tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                     tokens=tokens_to_bytes(tokens[:4]), n_draft=4),
                           grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as failed:
            drafting.Draft(request, metadata=METADATA, timeout=30)
        assert failed.value.code() == code
    expected.update({(DRAFT, "OK"): 1, (DRAFT, "INVALID_ARGUMENT"): 1, (DRAFT, "NOT_FOUND"): 1})

    # stream-stream: a session of three steps, 0.2 s apart; open while we scrape
    requests: queue.Queue[drafting_pb2.SessionRequest | None] = queue.Queue()
    requests.put(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
        namespace=NAMESPACE, tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=8)))
    responses = drafting.Session(iter(requests.get, None), metadata=METADATA, timeout=30)
    assert next(responses).WhichOneof("kind") == "opened"
    assert observed.value("ngramcache_sessions_active") == 1
    for step in range(3):
        requests.put(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(
            tokens=tokens_to_bytes(tokens[step * 30:(step + 1) * 30]))))
        drafted += len(next(responses).draft.tokens) // 4
        time.sleep(0.2)
    requests.put(None)  # half-close: the session ends OK
    assert list(responses) == []
    expected[(SESSION, "OK")] += 1

    # unary-stream: a Pull; stream-unary: a Publish that does not start with its header
    assert list(counts.Pull(counts_pb2.PullRequest(namespace=NAMESPACE, tokenizer_fingerprint=FP),
                            metadata=METADATA, timeout=30))[-1].complete
    with pytest.raises(grpc.RpcError) as bad_publish:
        static.Publish(iter([static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(data=b"x"))]),
                       metadata=METADATA, timeout=30)
    assert bad_publish.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected.update({(PULL, "OK"): 1, (PUBLISH, "INVALID_ARGUMENT"): 1})

    # a method no handler serves: gRPC answers UNIMPLEMENTED, counted as `other`
    unknown = observed.channel.unary_unary("/evil.Service/Method")
    with pytest.raises(grpc.RpcError) as unimplemented:
        unknown(b"", metadata=METADATA, timeout=30)
    assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
    expected[(OTHER, "UNIMPLEMENTED")] += 1

    # the mirror catches up with the pushed rows
    wait_for(lambda: observed.value("ngramcache_mirror_rows", namespace=NAMESPACE) == len(deltas), "the mirror")
    body, samples = observed.scrape()
    got = Counter({(dict(labels)["method"], dict(labels)["code"]): int(v)
                   for (name, labels), v in samples.items() if name == "ngramcache_rpc_total"})
    assert got == expected
    for method in (PUSH, DRAFT, SESSION, PULL, PUBLISH):
        calls = sum(n for (m, _), n in expected.items() if m == method)
        assert samples[("ngramcache_rpc_seconds_count", (("method", method),))] == calls
    # a stream's latency is the whole call's: three steps 0.2 s apart
    assert samples[("ngramcache_rpc_seconds_sum", (("method", SESSION),))] >= 0.6
    assert samples[("ngramcache_rpc_seconds_bucket", (("le", "0.5"), ("method", SESSION)))] == 0

    def sample(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert sample("ngramcache_drafts_total") == 1 + 3
    assert sample("ngramcache_drafted_tokens_total") == drafted > 0
    assert sample("ngramcache_pushed_rows_total") == len(deltas)
    assert sample("ngramcache_duplicate_pushes_total") == 1
    assert sample("ngramcache_sessions_active") == 0
    assert store_ops(samples, "ngramcache_store_seconds_count")  # every store call is timed by op
    assert sum(store_ops(samples, "ngramcache_store_seconds_count", "apply").values()) >= 1  # apply or apply_group
    assert not [k for k in samples if k[0] == "ngramcache_store_errors_total"]  # answers only, no failures
    assert sample("ngramcache_namespaces_live") == 1  # no-such-ns never became live
    assert 0 <= sample("ngramcache_mirror_lag_seconds", namespace=NAMESPACE) < 5  # type: ignore[operator]
    assert sample("ngramcache_generation", namespace=NAMESPACE) == 0
    assert sample("ngramcache_mirror_errors_total", namespace=NAMESPACE) == 0

    # one log line per call, at INFO (ok_level INFO here, errors INFO by default)
    records = rpc_records(caplog)
    assert Counter((r.grpc_method, r.grpc_code) for r in records  # type: ignore[attr-defined]
                   if r.grpc_method.startswith("/ngramcache.")) == expected - Counter({(OTHER, "UNIMPLEMENTED"): 1})  # type: ignore[attr-defined]
    assert all(r.levelno == logging.INFO and all(hasattr(r, f) for f in LOG_FIELDS) for r in records)
    not_found = [r for r in records if r.grpc_code == "NOT_FOUND"]  # type: ignore[attr-defined]
    assert [(r.namespace, r.reason) for r in not_found] == [("no-such-ns", "NAMESPACE_NOT_FOUND")]  # type: ignore[attr-defined]
    session = next(r for r in records if r.grpc_method == SESSION)  # type: ignore[attr-defined]
    assert session.namespace == NAMESPACE and session.duration_ms >= 600  # type: ignore[attr-defined]
    assert session.peer.startswith("ipv4:127.0.0.1:")  # type: ignore[attr-defined]

    # no secret anywhere: not the bearer token, not the client id
    everything = caplog.text + "".join(repr(vars(r)) for r in caplog.records)
    assert SECRET not in everything and SECRET not in body
    assert CLIENT_ID not in body and "evil.Service" not in body


def test_store_failures_are_counted_by_op(tmp_path: Path) -> None:
    with RedisServer() as redis:
        store = open_counts_store(redis.url, epoch_seconds=0, retries=0, socket_timeout=1, connect_timeout=0.5)
        store.create_namespace(NAMESPACE, FP, VOCAB)
        obs = observe(store, tmp_path, "outside")
        try:
            redis.kill()
            counts = counts_pb2_grpc.CountsStub(obs.channel)
            table = CountTable()
            table.update(corpus(n=60))
            with pytest.raises(grpc.RpcError) as down:
                counts.Push(push_request(delta_rows_to_bytes(table.to_rows()), 1), metadata=METADATA, timeout=30)
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            samples = obs.scrape()[1]
            errors = store_ops(samples, "ngramcache_store_errors_total")
            assert list(errors.values()) == [1] and next(iter(errors)).startswith("apply")  # apply or apply_group
            assert store_ops(samples, "ngramcache_store_seconds_count", "apply") == errors
            assert obs.value("ngramcache_rpc_total", method=PUSH, code="UNAVAILABLE") == 1
        finally:
            obs.close()


def test_reader_writer_streams_deadlines_and_cancellations() -> None:
    """Health.Watch writes with context.write (a coroutine, not a generator); ended by deadline, then by cancel."""
    metrics = Metrics()

    async def main() -> None:
        server = aio.server(interceptors=[MetricsInterceptor(metrics)])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=0.3)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                assert await watch.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                await asyncio.sleep(0.2)  # the server ends a call after its client does
        finally:
            await server.stop(None)

    asyncio.run(main())
    rpc = {tuple(sorted(s.labels.items())): s.value
           for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in family.samples
           if s.name == "ngramcache_rpc_total"}
    watch = "/grpc.health.v1.Health/Watch"
    assert rpc == {(("code", "DEADLINE_EXCEEDED"), ("method", watch)): 1,
                   (("code", "CANCELLED"), ("method", watch)): 1,
                   (("code", "OK"), ("method", "/grpc.health.v1.Health/Check")): 1}


def test_the_whole_service_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    from helpers.service import ServiceThread

    from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, drafting_pb2, drafting_pb2_grpc
    from ngramcache.client.wire.codec import tokens_to_bytes

    with ServiceThread(tmp_path / "data", metrics_port=0) as svc:
        assert svc.service is not None and svc.service.metrics_port > 0
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="m", tokenizer_fingerprint=bytes(32), vocab_size=10))
        opener = drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace="m", tokenizer_fingerprint=bytes(32), vocab_size=10, n_draft=4))
        step = drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes([1, 2, 1, 2, 1, 2])))
        replies = list(drafting_pb2_grpc.DraftingStub(ch).Session(iter([opener, step]), timeout=10))
        drafted = len(replies[-1].draft.tokens) // 4
        from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc

        counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
            namespace="m", tokenizer_fingerprint=bytes(32), client_id="c", seq=0,
            rows=np.array([[2, 1, 2, -1, -1, 1, 3]], dtype="<i4").tobytes()), timeout=10)
        status = admin_pb2_grpc.AdminStub(ch).StartRebuild(admin_pb2.StartRebuildRequest(namespace="m", wait=True),
                                                            timeout=60)
        assert status.state == "done" and status.generation == 1
        ch.close()
        text = urllib.request.urlopen(f"http://127.0.0.1:{svc.service.metrics_port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("ngramcache_rpc_total", (("code", "OK"), ("method", "/ngramcache.v1.Drafting/Session")))] == 1
    assert samples[("ngramcache_drafted_tokens_total", ())] == drafted > 0
    assert ("ngramcache_generation", (("namespace", "m"),)) in samples
    assert samples[("ngramcache_rebuilds_completed_total", ())] == 1
    assert samples[("ngramcache_rebuilds_failed_total", ())] == 0
    assert samples[("ngramcache_rebuild_running", (("namespace", "m"),))] == 0
    assert ("ngramcache_rebuild_last_seconds", (("namespace", "m"),)) in samples
