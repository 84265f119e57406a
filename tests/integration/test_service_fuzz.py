"""Fuzzing the service's request decoding and handling: garbage bytes and random well-formed
messages at every RPC, DropNamespace and Watch included, through a real server on loopback.
Every call ends with a status well within its deadline (a hang fails: DEADLINE_EXCEEDED is never
accepted; the only call that may wait is a Watch of an existing namespace with nothing newer than
its after_generation, which is checked), never INTERNAL or UNKNOWN, no crash; the namespace made
first is intact, and the server keeps serving."""

from __future__ import annotations

import hashlib
import random

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.service import ServiceThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramcache import build_static_from_tokens
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    drafting_pb2,
    static_files_pb2,
    static_files_pb2_grpc,
)

pytestmark = pytest.mark.integration

FILES = (drafting_pb2, counts_pb2, static_files_pb2, admin_pb2)
METHODS = [
    (f"/{svc.full_name}/{m.name}", m)
    for pb in FILES for svc in pb.DESCRIPTOR.services_by_name.values() for m in svc.methods
]
# Codes a malformed or random request may get; INTERNAL (a bug), UNKNOWN (an unmapped
# exception) and DEADLINE_EXCEEDED (a handler that hangs) may not.
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED,
}
FP = bytes(32)
DEADLINE = 30.0  # seconds a call may take: far past any answer (PullHistory's long poll is capped at 0.2 s here)
WATCH_WAIT = 2.0  # seconds a Watch is read before it counts as waiting for news
SCRATCH = "scratch"  # what DropNamespace drops: made again before each call, so "ns" stays


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("fuzz")
    with ServiceThread(data / "data", session_idle_timeout=2.0, max_file_bytes=1 << 20,
                       history_max_wait_ms=200) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="ns", tokenizer_fingerprint=FP, vocab_size=50))
        # A generation to watch: a Watch after generation 0 answers at once, one after 1 or more waits for news.
        path = data / "g1.ngc"
        build_static_from_tokens([np.arange(200, dtype=np.int32) % 50], path, vocab_size=50, fingerprint=FP, generation=1)
        blob = path.read_bytes()
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(iter([
            static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace="ns", generation=1, size=len(blob), sha256=hashlib.sha256(blob).digest())),
            static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=0, data=blob))]), timeout=30)
        yield svc, ch
        ch.close()


def latest_generation(ch: grpc.Channel, namespace: str) -> int | None:
    """The namespace's newest generation (None: no such namespace)."""
    try:
        ns = admin_pb2_grpc.AdminStub(ch).GetNamespace(admin_pb2.GetNamespaceRequest(name=namespace), timeout=10)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            return None
        raise
    return int(ns.namespace.latest_generation)


def watch_may_wait(ch: grpc.Channel, payload: bytes) -> bool:
    """Whether a Watch of ``payload`` may rightly wait: it names an existing namespace with nothing newer than its
    after_generation (else it must answer: a generation, or an error)."""
    try:
        request = static_files_pb2.WatchRequest.FromString(payload)
    except Exception:  # not a WatchRequest: the server must refuse it
        return False
    latest = latest_generation(ch, request.namespace)
    return latest is not None and latest <= request.after_generation


def follows(method: _descriptor.MethodDescriptor, payload: bytes) -> bool:
    """Whether a call of ``method`` with ``payload`` may stream for as long as the caller wants."""
    if method.name == "SubscribeHistory":
        return True
    if method.name != "Pull":
        return False
    try:
        return counts_pb2.PullRequest.FromString(payload).follow
    except Exception:  # not a PullRequest: the server must refuse it
        return False


def call_raw(ch: grpc.Channel, path: str, method: _descriptor.MethodDescriptor, payloads: list[bytes]) -> grpc.StatusCode:
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    try:
        if method.client_streaming and method.server_streaming:
            list(ch.stream_stream(path, request_serializer=ident, response_deserializer=ident)(iter(payloads),
                                                                                                timeout=DEADLINE))
        elif method.client_streaming:
            ch.stream_unary(path, request_serializer=ident, response_deserializer=ident)(iter(payloads), timeout=DEADLINE)
        elif method.name == "Watch":  # streams for as long as the caller wants: its first answer, or a wait
            stream = ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)(payloads[0],
                                                                                                 timeout=WATCH_WAIT)
            try:
                next(stream, None)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and watch_may_wait(ch, payloads[0]):
                    return grpc.StatusCode.OK  # waiting for news, as it should
                raise
            stream.cancel()
        elif method.server_streaming and follows(method, payloads[0]):
            # SubscribeHistory and a Pull with follow stream until the caller cancels: their first message (an
            # error ends the call before it), then a cancel.
            stream = ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)(payloads[0],
                                                                                                 timeout=DEADLINE)
            next(stream, None)
            stream.cancel()
        elif method.server_streaming:
            list(ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)(payloads[0],
                                                                                               timeout=DEADLINE))
        else:
            ch.unary_unary(path, request_serializer=ident, response_deserializer=ident)(payloads[0], timeout=DEADLINE)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def random_message(desc: _descriptor.Descriptor, rnd: random.Random, depth: int = 0) -> Message:
    """A message of type `desc` with random values, biased to the edges services check."""
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(desc)()
    names = ["ns", "", "nope", "a" * 65, "../x", "ns\x00", "ünï"]
    for f in desc.fields:
        if f.containing_oneof is not None and rnd.random() < 0.5:
            continue
        if rnd.random() < 0.2:
            continue
        t = f.type
        if t == f.TYPE_MESSAGE:
            if depth < 3 and not f.is_repeated:
                getattr(msg, f.name).CopyFrom(random_message(f.message_type, rnd, depth + 1))
            continue
        if f.is_repeated:
            continue
        if t == f.TYPE_STRING:
            value: object = rnd.choice(names)
        elif t == f.TYPE_BYTES:
            value = rnd.choice([b"", FP, bytes(rnd.randrange(256) for _ in range(rnd.choice([1, 3, 4, 28, 31, 32, 56, 64])))])
        elif t == f.TYPE_BOOL:
            value = rnd.random() < 0.5
        elif t in (f.TYPE_UINT32, f.TYPE_FIXED32):
            value = rnd.choice([0, 1, 8, 50, 256, 257, 1 << 24, (1 << 32) - 1])
        elif t in (f.TYPE_UINT64, f.TYPE_FIXED64):
            value = rnd.choice([0, 1, 2, 1 << 40, (1 << 64) - 1])
        elif t in (f.TYPE_INT32, f.TYPE_SINT32, f.TYPE_INT64, f.TYPE_SINT64):
            value = rnd.choice([0, -1, 1, 1 << 30])
        elif t == f.TYPE_ENUM:
            value = rnd.choice([v.number for v in f.enum_type.values])
        else:
            continue
        setattr(msg, f.name, value)
    return msg


def still_serving(ch: grpc.Channel) -> None:
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(index=st.integers(0, len(METHODS) - 1), payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_garbage_bytes_get_a_status_and_the_server_keeps_serving(server, index, payloads):
    _, ch = server
    path, method = METHODS[index]
    code = call_raw(ch, path, method, payloads)
    assert code in ALLOWED, (path, code)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(index=st.integers(0, len(METHODS) - 1), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_random_messages_get_an_expected_status(server, index, seed, n):
    _, ch = server
    path, method = METHODS[index]
    rnd = random.Random(seed)
    messages = [random_message(method.input_type, rnd) for _ in range(n)]
    if method.name == "DropNamespace":  # dropping is its purpose: a namespace made for it, never "ns"
        admin = admin_pb2_grpc.AdminStub(ch)
        if latest_generation(ch, SCRATCH) is None:
            admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=SCRATCH, tokenizer_fingerprint=FP, vocab_size=50),
                                  timeout=10)
        for m in messages:
            if m.name == "ns":
                m.name = SCRATCH
    code = call_raw(ch, path, method, [m.SerializeToString() for m in messages])
    assert code in ALLOWED, (path, code)


def test_after_the_fuzzing_the_server_serves_and_namespace_is_intact(server):
    _, ch = server
    still_serving(ch)
    ns = admin_pb2_grpc.AdminStub(ch).GetNamespace(admin_pb2.GetNamespaceRequest(name="ns"), timeout=5)
    assert ns.namespace.vocab_size == 50
