"""A client that drops its call at any moment cannot crash `ngramcache serve`: every streaming RPC and reflection, cancelled again and again, with every interceptor on."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.service import start_serve, stop_serve

from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    drafting_pb2,
    drafting_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.wire.codec import tokens_to_bytes

pytestmark = pytest.mark.integration

FP = bytes(32)
ROUNDS = 60


class Requests:
    """A request stream the test feeds one message at a time (so the call is cancelled mid-stream)."""

    def __init__(self) -> None:
        self._q: queue.Queue[object] = queue.Queue()

    def send(self, message: object) -> None:
        self._q.put(message)

    def close(self) -> None:
        self._q.put(None)

    def __iter__(self):
        while (m := self._q.get()) is not None:
            yield m


def cancel_reflection(ch: grpc.Channel) -> None:
    requests = Requests()
    call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter(requests))
    requests.send(reflection_pb2.ServerReflectionRequest(list_services=""))
    next(call)
    call.cancel()
    requests.close()


def cancel_session(ch: grpc.Channel) -> None:
    requests = Requests()
    call = drafting_pb2_grpc.DraftingStub(ch).Session(iter(requests))
    requests.send(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
        namespace="ns", tokenizer_fingerprint=FP, vocab_size=100, n_draft=4)))
    next(call)
    requests.send(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes([1, 2, 3, 1, 2]))))
    next(call)
    call.cancel()
    requests.close()


def cancel_pull(ch: grpc.Channel) -> None:
    call = counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(namespace="ns", tokenizer_fingerprint=FP))
    call.cancel()


def cancel_watch(ch: grpc.Channel) -> None:
    call = static_files_pb2_grpc.StaticFilesStub(ch).Watch(static_files_pb2.WatchRequest(namespace="ns"))
    time.sleep(0.002)
    call.cancel()


def cancel_fetch(ch: grpc.Channel) -> None:
    call = static_files_pb2_grpc.StaticFilesStub(ch).Fetch(static_files_pb2.FetchRequest(namespace="ns", generation=1))
    call.cancel()


def cancel_publish(ch: grpc.Channel) -> None:
    requests = Requests()
    future = static_files_pb2_grpc.StaticFilesStub(ch).Publish.future(iter(requests))
    requests.send(static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(namespace="ns")))
    time.sleep(0.002)
    future.cancel()
    requests.close()


CANCELLERS = [cancel_reflection, cancel_session, cancel_pull, cancel_watch, cancel_fetch, cancel_publish]


def serving(ch: grpc.Channel) -> bool:
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_cancelled_streams_never_crash_the_server(tmp_path):
    # The default server: logging at INFO logs every CANCELLED call, metrics observe every call.
    p, port = start_serve(tmp_path / "data")
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(ch).result(timeout=10)
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="ns", tokenizer_fingerprint=FP, vocab_size=100))
        errors: list[BaseException] = []

        def hammer(cancel) -> None:
            for _ in range(ROUNDS):
                try:
                    cancel(ch)
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                        errors.append(e)
                except BaseException as e:
                    errors.append(e)
                if p.poll() is not None:
                    return

        threads = [threading.Thread(target=hammer, args=(c,)) for c in CANCELLERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert p.poll() is None, f"the server died (exit {p.returncode})"
        assert serving(ch)
        assert not errors, errors[:3]
        ch.close()
    finally:
        rc, err = stop_serve(p)
    assert rc == 0 and "Segmentation fault" not in err and "Traceback" not in err, err[-3000:]
