"""Metrics (cache_service/metrics.py) and the observing interceptors' pure parts: names, labels, scrapes, log lines."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import types
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ngramcache.cache_service.interceptors.logging import LOG_FIELDS, LoggingInterceptor, namespace_of
from ngramcache.cache_service.interceptors.metrics import MAX_METHODS, OTHER, MetricsInterceptor, rpc_methods
from ngramcache.cache_service.interceptors.observing import FinishedCall, final_status
from ngramcache.cache_service.metrics import (
    RPC_BUCKETS,
    Metrics,
    is_store_failure,
    store_op,
)
from ngramcache.cache_service.status import REASON_KEY, ServiceError
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client._proto.v1 import admin_pb2, counts_pb2, drafting_pb2, static_files_pb2
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    StoreAuthenticationError,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: Metrics) -> Samples:
    """Every sample of a scrape of `metrics` as {(name, sorted labels): value}; the scrape must parse."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(s: Samples, name: str, **labels: str) -> float | None:
    return s.get((name, tuple(sorted(labels.items()))))


# --------------------------------------------------------------------------- Metrics


def test_a_fresh_scrape_parses_and_names_every_metric() -> None:
    s = samples(Metrics())
    names = {name for name, _ in s}
    # Unlabelled metrics appear at once, labelled ones once they have a child.
    for name in ("ngramcache_sessions_active", "ngramcache_drafts_total", "ngramcache_drafted_tokens_total",
                 "ngramcache_pushed_rows_total", "ngramcache_duplicate_pushes_total"):
        assert name in names
    assert value(s, "ngramcache_sessions_active") == 0


def test_metrics_live_in_their_own_registry() -> None:
    a, b = Metrics(), Metrics()  # no "Duplicated timeseries" error: each has its registry
    a.observe_rpc("/x.Y/Z", "OK", 0.001)
    assert value(samples(a), "ngramcache_rpc_total", method="/x.Y/Z", code="OK") == 1
    assert value(samples(b), "ngramcache_rpc_total", method="/x.Y/Z", code="OK") is None
    assert b"ngramcache_" not in generate_latest(REGISTRY)


def test_rpc_counts_by_method_and_code_and_latency_by_method() -> None:
    m = Metrics()
    m.observe_rpc("/ngramcache.v1.Drafting/Draft", "OK", 0.00004)
    m.observe_rpc("/ngramcache.v1.Drafting/Draft", "OK", 0.002)
    m.observe_rpc("/ngramcache.v1.Drafting/Draft", "INVALID_ARGUMENT", 20.0)
    s = samples(m)
    draft = "/ngramcache.v1.Drafting/Draft"
    assert value(s, "ngramcache_rpc_total", method=draft, code="OK") == 2
    assert value(s, "ngramcache_rpc_total", method=draft, code="INVALID_ARGUMENT") == 1
    assert value(s, "ngramcache_rpc_seconds_count", method=draft) == 3
    assert value(s, "ngramcache_rpc_seconds_sum", method=draft) == pytest.approx(20.00204)
    assert value(s, "ngramcache_rpc_seconds_bucket", method=draft, le="5e-05") == 1
    assert value(s, "ngramcache_rpc_seconds_bucket", method=draft, le="0.0025") == 2
    assert value(s, "ngramcache_rpc_seconds_bucket", method=draft, le="10.0") == 2
    assert value(s, "ngramcache_rpc_seconds_bucket", method=draft, le="+Inf") == 3


def test_latency_buckets_run_from_50_us_to_10_s() -> None:
    assert RPC_BUCKETS[0] == 0.00005 and RPC_BUCKETS[-1] == 10.0
    assert list(RPC_BUCKETS) == sorted(set(RPC_BUCKETS))


def test_drafts_and_pushes() -> None:
    m = Metrics()
    m.drafted(5)
    m.drafted(0)  # a draft with nothing to propose is still a draft
    m.pushed(100, duplicate=False)
    m.pushed(100, duplicate=True)  # a retried batch adds no rows
    s = samples(m)
    assert value(s, "ngramcache_drafts_total") == 2
    assert value(s, "ngramcache_drafted_tokens_total") == 5
    assert value(s, "ngramcache_pushed_rows_total") == 100
    assert value(s, "ngramcache_duplicate_pushes_total") == 1


def test_store_ops_are_named_by_method() -> None:
    class Store:
        def apply(self) -> None: ...

    assert store_op(Store().apply) == "apply"
    assert store_op(next) == "export_next"
    assert store_op(lambda: None) == "other"  # "<lambda>"


def test_only_failures_of_the_store_are_store_errors() -> None:
    assert is_store_failure(BackendUnavailableError("down"))
    assert is_store_failure(StoreAuthenticationError("refused"))
    assert is_store_failure(RuntimeError("a bug"))
    assert not is_store_failure(NamespaceNotFoundError("no such namespace"))  # an answer
    assert not is_store_failure(InvalidArgumentError("bad"))


class _FakeStore:
    def version(self, namespace: str) -> int:
        return 7

    def namespace_info(self, namespace: str) -> None:
        raise NamespaceNotFoundError(namespace)

    def apply(self, namespace: str) -> None:
        raise BackendUnavailableError("connection refused")

    def close(self) -> None:
        pass


def test_store_runner_times_calls_and_counts_failures() -> None:
    m = Metrics()
    store = _FakeStore()
    runner = StoreRunner(store, max_workers=1, metrics=m)  # type: ignore[arg-type]

    async def calls() -> None:
        assert await runner.call(store.version, "a") == 7
        with pytest.raises(NamespaceNotFoundError, match="^a$"):
            await runner.call(store.namespace_info, "a")
        with pytest.raises(BackendUnavailableError, match="^connection refused$"):
            await runner.call(store.apply, "a")

    asyncio.run(calls())
    runner.close()
    s = samples(m)
    for op in ("version", "namespace_info", "apply"):
        assert value(s, "ngramcache_store_seconds_count", op=op) == 1
    assert value(s, "ngramcache_store_errors_total", op="apply") == 1
    assert value(s, "ngramcache_store_errors_total", op="namespace_info") is None


def test_store_runner_without_metrics_is_unchanged() -> None:
    store = _FakeStore()
    runner = StoreRunner(store, max_workers=1)  # type: ignore[arg-type]
    assert asyncio.run(runner.call(store.version, "a")) == 7
    runner.close()


def test_sessions_are_read_at_scrape_time() -> None:
    m = Metrics()
    open_sessions = [3]
    m.watch_sessions(lambda: open_sessions[0])
    assert value(samples(m), "ngramcache_sessions_active") == 3
    open_sessions[0] = 1
    assert value(samples(m), "ngramcache_sessions_active") == 1


def _live_namespace(last_refresh: float, rows: int, generation: int, errors: int = 0) -> Any:
    return types.SimpleNamespace(mirror=types.SimpleNamespace(last_refresh=last_refresh, errors=errors),
                                 dynamic=types.SimpleNamespace(n_entries=rows), generation=generation)


def test_namespaces_are_read_at_scrape_time_and_vanish_when_dropped() -> None:
    m = Metrics()
    live = {"chat": _live_namespace(time.monotonic() - 2.5, rows=40, generation=3, errors=1),
            "code": _live_namespace(time.monotonic(), rows=0, generation=0)}
    m.watch_namespaces(lambda: dict(live))
    s = samples(m)
    assert value(s, "ngramcache_namespaces_live") == 2
    assert 2.5 <= value(s, "ngramcache_mirror_lag_seconds", namespace="chat") < 10  # type: ignore[operator]
    assert value(s, "ngramcache_mirror_rows", namespace="chat") == 40
    assert value(s, "ngramcache_mirror_errors_total", namespace="chat") == 1
    assert value(s, "ngramcache_generation", namespace="chat") == 3
    assert value(s, "ngramcache_generation", namespace="code") == 0
    del live["chat"]
    s = samples(m)
    assert value(s, "ngramcache_namespaces_live") == 1
    assert value(s, "ngramcache_mirror_rows", namespace="chat") is None
    with pytest.raises(RuntimeError, match="^watch_namespaces was already called on this Metrics$"):
        m.watch_namespaces(lambda: {})


# --------------------------------------------------------------------------- interceptor parts


class _Context:
    """The few ServicerContext methods the observing interceptors read."""

    def __init__(self, code: grpc.StatusCode | None = None, remaining: float | None = None,
                 trailing: tuple[tuple[str, str], ...] = (), peer: str = "ipv4:127.0.0.1:5555") -> None:
        self._code, self._remaining, self._trailing, self._peer = code, remaining, trailing, peer

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:
        return self._remaining

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def peer(self) -> str:
        return self._peer


class _AbortError(Exception):
    pass


_AbortError.__module__ = "grpc._cython.cygrpc"  # what context.abort raises, as the interceptor sees it


def test_final_status() -> None:
    ok = grpc.StatusCode.OK
    ctx: Any = _Context()
    assert final_status(None, ctx) == (ok, None)
    assert final_status(None, _Context(grpc.StatusCode.ALREADY_EXISTS)) == (grpc.StatusCode.ALREADY_EXISTS, None)  # set_code
    aborted = _Context(grpc.StatusCode.NOT_FOUND, trailing=(("authorization", "x"), (REASON_KEY, "NAMESPACE_NOT_FOUND")))
    assert final_status(_AbortError(), aborted) == (grpc.StatusCode.NOT_FOUND, "NAMESPACE_NOT_FOUND")
    assert final_status(_AbortError(), ctx) == (grpc.StatusCode.UNKNOWN, None)
    # Raised inside the ErrorInterceptor: what status_of will send.
    assert final_status(NamespaceNotFoundError("x"), ctx) == (grpc.StatusCode.NOT_FOUND, "NAMESPACE_NOT_FOUND")
    assert final_status(InvalidArgumentError("x"), ctx) == (grpc.StatusCode.INVALID_ARGUMENT, None)
    assert final_status(ServiceError(grpc.StatusCode.ABORTED, "idle"), ctx) == (grpc.StatusCode.ABORTED, None)
    assert final_status(KeyError("bug"), ctx) == (grpc.StatusCode.INTERNAL, None)
    assert final_status(asyncio.CancelledError(), _Context(remaining=5.0)) == (grpc.StatusCode.CANCELLED, None)
    assert final_status(asyncio.CancelledError(), _Context(remaining=0.0)) == (grpc.StatusCode.DEADLINE_EXCEEDED, None)
    assert final_status(GeneratorExit(), ctx) == (grpc.StatusCode.CANCELLED, None)


def test_rpc_methods_come_from_the_descriptors() -> None:
    from grpc_health.v1 import health_pb2  # loads the service's descriptor

    assert health_pb2.DESCRIPTOR.services_by_name["Health"]
    methods = rpc_methods("ngramcache.v1.Drafting", "grpc.health.v1.Health")
    assert {m for m in methods if "Drafting" in m} == {"/ngramcache.v1.Drafting/Session", "/ngramcache.v1.Drafting/Draft"}
    assert {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"} <= methods
    with pytest.raises(KeyError, match="no.Such"):
        rpc_methods("no.Such")


def _call(method: str, code: grpc.StatusCode = grpc.StatusCode.OK, request: Any = None,
          seconds: float = 0.001) -> FinishedCall:
    return FinishedCall(method, code, seconds, True, request, peer="ipv4:127.0.0.1:5555")


def test_method_labels_are_bounded() -> None:
    m = Metrics()
    listed = MetricsInterceptor(m, methods={"/a.B/C"})
    listed.finished(_call("/a.B/C"))
    listed.finished(_call("/evil.Service/Random123"))
    unlisted = MetricsInterceptor(m)
    for i in range(MAX_METHODS + 10):
        unlisted.finished(_call(f"/x.Y/M{i}"))
    unlisted.finished(FinishedCall("/unknown/method", grpc.StatusCode.UNIMPLEMENTED, 0.0, False))
    s = samples(m)
    assert value(s, "ngramcache_rpc_total", method="/a.B/C", code="OK") == 1
    assert value(s, "ngramcache_rpc_total", method=OTHER, code="OK") == 1 + 10
    assert value(s, "ngramcache_rpc_total", method=OTHER, code="UNIMPLEMENTED") == 1
    methods = {dict(labels)["method"] for name, labels in s if name == "ngramcache_rpc_total"}
    assert len(methods) == 1 + MAX_METHODS + 1


FP = bytes(32)


def test_namespace_of_requests() -> None:
    assert namespace_of(drafting_pb2.DraftRequest(namespace="chat", tokens=b"\x01\x00\x00\x00")) == "chat"
    assert namespace_of(counts_pb2.PushRequest(namespace="chat", client_id="c1")) == "chat"
    assert namespace_of(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="chat"))) == "chat"
    assert namespace_of(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=b""))) is None
    assert namespace_of(static_files_pb2.PublishRequest(
        header=static_files_pb2.PublishHeader(namespace="chat"))) == "chat"
    assert namespace_of(admin_pb2.CreateNamespaceRequest(name="chat")) == "chat"
    assert namespace_of(admin_pb2.GetServerInfoRequest()) is None
    assert namespace_of(drafting_pb2.DraftRequest(namespace="")) is None
    assert namespace_of(drafting_pb2.DraftRequest(namespace="Bearer abc\ndef")) is None  # not a name: not logged
    assert namespace_of(None) is None
    assert namespace_of(object()) is None


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ngramcache.service.rpc"]


def test_log_lines_levels_and_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ngramcache.service.rpc")
    interceptor = LoggingInterceptor()
    interceptor.finished(_call("/ngramcache.v1.Drafting/Draft", request=drafting_pb2.DraftRequest(namespace="chat"),
                               seconds=0.0021))
    interceptor.finished(FinishedCall("/ngramcache.v1.Drafting/Draft", grpc.StatusCode.NOT_FOUND, 0.001, True,
                                      drafting_pb2.DraftRequest(namespace="gone"), "NAMESPACE_NOT_FOUND",
                                      "ipv4:127.0.0.1:5555"))
    ok, error = _records(caplog)
    assert ok.levelno == logging.DEBUG and error.levelno == logging.INFO
    assert ok.getMessage() == "rpc /ngramcache.v1.Drafting/Draft OK 2.100 ms peer=ipv4:127.0.0.1:5555 namespace=chat"
    assert error.getMessage().endswith("namespace=gone reason=NAMESPACE_NOT_FOUND")
    fields = {k: getattr(error, k) for k in LOG_FIELDS}
    assert fields == {"grpc_method": "/ngramcache.v1.Drafting/Draft", "grpc_code": "NOT_FOUND", "duration_ms": 1.0,
                      "peer": "ipv4:127.0.0.1:5555", "namespace": "gone", "reason": "NAMESPACE_NOT_FOUND"}
    json.dumps(fields)  # what a JSON formatter does with them


def test_ok_calls_log_at_the_configured_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ngramcache.service.rpc")
    LoggingInterceptor().finished(_call("/a.B/C"))
    assert _records(caplog) == []  # DEBUG by default: dropped at INFO
    LoggingInterceptor(ok_level=logging.INFO).finished(_call("/a.B/C"))
    assert [r.levelno for r in _records(caplog)] == [logging.INFO]


def test_client_controlled_text_is_logged_printable_and_short(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ngramcache.service.rpc")
    LoggingInterceptor().finished(FinishedCall("/x\n/forged line" + "y" * 500, grpc.StatusCode.UNIMPLEMENTED, 0.0, False))
    (record,) = _records(caplog)
    assert "\n" not in record.getMessage() and len(record.grpc_method) < 300  # type: ignore[attr-defined]
    assert record.peer is None  # type: ignore[attr-defined]
