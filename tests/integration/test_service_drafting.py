"""The whole service on loopback: sessions draft what a local Drafter drafts on the same tables.

A real server (create_server, port 0) runs in a thread with its own event loop, over the
embedded counts store and over a real redis-server; the test pushes counts, publishes a
static generation, and compares every session draft with a local `Drafter` built from the
same static file and the same counts, token for token.
"""

from __future__ import annotations

import hashlib
import time

import grpc
import numpy as np
import pytest
from helpers.corpus import FP, VOCAB
from helpers.corpus import motif_corpus as corpus
from helpers.service import ServiceThread

from ngramcache import CountTable, Drafter, StaticCache, build_static_from_tokens
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
from ngramcache.client.wire.codec import bytes_to_tokens, delta_rows_to_bytes, tokens_to_bytes

pytestmark = pytest.mark.integration



@pytest.fixture(params=["embedded", "redis"])
def service(request, tmp_path):
    # Versions advance at every read (epoch_seconds=0), so a mirror sees pushes at once.
    counts = f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0"
    if request.param == "redis":
        counts = request.getfixturevalue("redis_standalone").url + f"?epoch_seconds=0&prefix=t{time.monotonic_ns()}"
    with ServiceThread(tmp_path / "data", counts=counts, mirror_interval=0.05) as svc:
        yield svc


def stubs(port: int):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    return (ch, admin_pb2_grpc.AdminStub(ch), counts_pb2_grpc.CountsStub(ch), drafting_pb2_grpc.DraftingStub(ch),
            static_files_pb2_grpc.StaticFilesStub(ch))


def delta_rows(tokens: np.ndarray) -> np.ndarray:
    t = CountTable()
    t.update(tokens)
    return t.to_rows()


def publish(stub: static_files_pb2_grpc.StaticFilesStub, namespace: str, path, generation: int) -> None:
    data = path.read_bytes()
    header = static_files_pb2.PublishHeader(namespace=namespace, generation=generation, size=len(data),
                                            sha256=hashlib.sha256(data).digest())

    def requests():
        yield static_files_pb2.PublishRequest(header=header)
        for i in range(0, len(data), 1 << 16):
            yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=i, data=data[i:i + (1 << 16)]))

    stub.Publish(requests(), timeout=30)


def test_session_drafts_equal_a_local_drafter_token_for_token(service, tmp_path):
    ch, admin, counts, drafting, static = stubs(service.port)
    admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="code", tokenizer_fingerprint=FP, vocab_size=VOCAB))
    # Dynamic counts from two earlier "generations" of text, pushed as two batches.
    learned = [corpus(1), corpus(2)]
    for seq, tokens in enumerate(learned):
        rows = delta_rows(tokens)
        counts.Push(counts_pb2.PushRequest(namespace="code", client_id="test", seq=seq, tokenizer_fingerprint=FP,
                                           rows=delta_rows_to_bytes(rows)))
    # A static generation of a third text.
    static_path = tmp_path / "g1.ngc"
    build_static_from_tokens([corpus(3)], static_path, vocab_size=VOCAB, fingerprint=FP, generation=1)
    publish(static, "code", static_path, 1)

    # The local reference: the same static file, the same counts.
    dynamic = CountTable()
    for tokens in learned:
        dynamic.update(tokens)
    local = Drafter(static=StaticCache.open(static_path), dynamic=dynamic)

    text = corpus(4, 1500)
    deadline = time.monotonic() + 10
    while True:  # the service's mirror and generation catch up within a few refreshes
        calls = iter([drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace="code", tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=8))])
        opened = next(drafting.Session(calls)).opened
        probe = drafting.Draft(drafting_pb2.DraftRequest(namespace="code", tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                         tokens=tokens_to_bytes(text[:200]), n_draft=8))
        local_probe = local_draft_once(local, text[:200])
        if opened.generation == 1 and bytes_to_tokens(probe.tokens).tolist() == local_probe:
            break
        assert time.monotonic() < deadline, "the service never caught up with the pushed counts and generation"
        time.sleep(0.05)

    steps = [text[:50]] + [text[i:i + 7] for i in range(50, len(text), 7)]

    def requests():
        yield drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace="code", tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=8))
        for s in steps:
            yield drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes(s)))

    replies = list(drafting.Session(requests(), timeout=60))
    assert replies[0].WhichOneof("kind") == "opened"
    drafts = [r.draft for r in replies[1:]]
    assert len(drafts) == len(steps)
    n = 0
    n_nonempty = 0
    for s, d in zip(steps, drafts):
        n += len(s)
        local.accept(7, text[:n])
        want = local.draft(7, text[:n], 8).tolist()
        assert bytes_to_tokens(d.tokens).tolist() == want, f"after {n} tokens"
        assert d.sequence_length == n and d.generation == 1
        n_nonempty += bool(want)
    assert n_nonempty > len(steps) // 4  # the tables are real enough to draft often
    ch.close()


def local_draft_once(d: Drafter, tokens: np.ndarray) -> list[int]:
    d.accept(10**9, tokens)
    try:
        return d.draft(10**9, tokens, 8).tolist()
    finally:
        d.reset(10**9)


def test_session_errors_end_the_stream_and_the_server_keeps_serving(service):
    ch, admin, _, drafting, _ = stubs(service.port)
    admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="s", tokenizer_fingerprint=FP, vocab_size=VOCAB))
    opener = drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="s", tokenizer_fingerprint=FP,
                                                                       vocab_size=VOCAB, n_draft=4))
    cases = [
        ([drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=b""))], grpc.StatusCode.INVALID_ARGUMENT),
        ([drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="nope", tokenizer_fingerprint=FP,
                                                                    vocab_size=VOCAB, n_draft=4))],
         grpc.StatusCode.NOT_FOUND),
        ([drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="s", tokenizer_fingerprint=b"\1" * 32,
                                                                    vocab_size=VOCAB, n_draft=4))],
         grpc.StatusCode.FAILED_PRECONDITION),
        ([opener, drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes([1, VOCAB])))],
         grpc.StatusCode.INVALID_ARGUMENT),
        ([opener, drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=b"\0\0\0"))],
         grpc.StatusCode.INVALID_ARGUMENT),
        ([opener, drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=b"", n_draft=1000))],
         grpc.StatusCode.INVALID_ARGUMENT),
        ([opener, opener], grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for reqs, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(drafting.Session(iter(reqs), timeout=10))
        assert e.value.code() == code, (reqs, e.value.details())
    mismatch = [m for m in _trailing(drafting, [cases[2][0][0]]) if m.key == "ngc-error-reason"]
    assert mismatch and mismatch[0].value == "TOKENIZER_MISMATCH"
    # Still serving: a normal session works.
    replies = list(drafting.Session(iter([opener, drafting_pb2.SessionRequest(
        step=drafting_pb2.SessionStep(tokens=tokens_to_bytes([1, 2, 3, 1, 2])))]), timeout=10))
    assert replies[-1].draft.sequence_length == 5
    ch.close()


def _trailing(drafting, reqs):
    with pytest.raises(grpc.RpcError) as e:
        list(drafting.Session(iter(reqs), timeout=10))
    return e.value.trailing_metadata() or ()


def test_an_idle_session_ends_aborted_and_frees_its_slot(tmp_path):
    import queue

    with ServiceThread(tmp_path / "data", session_idle_timeout=0.3, max_sessions=1) as svc:
        ch, admin, _, drafting, _ = stubs(svc.port)
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="i", tokenizer_fingerprint=FP, vocab_size=VOCAB))
        q: queue.Queue = queue.Queue()
        q.put(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="i", tokenizer_fingerprint=FP,
                                                                        vocab_size=VOCAB, n_draft=4)))
        call = drafting.Session(iter(q.get, None), timeout=20)
        assert next(call).opened.idle_timeout_ms == 300
        with pytest.raises(grpc.RpcError) as full:  # max_sessions=1: a second one is refused meanwhile
            list(drafting.Session(iter([q.queue[0] if q.queue else drafting_pb2.SessionRequest(
                open=drafting_pb2.SessionOpen(namespace="i", tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=4))]),
                timeout=10))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "maximum of 1 sessions" in full.value.details()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(call)  # no step within 0.3 s
        assert e.value.code() == grpc.StatusCode.ABORTED and time.monotonic() - t0 < 5
        assert ("ngc-error-reason", "SESSION_EVICTED") in [(m.key, m.value) for m in e.value.trailing_metadata()]
        q.put(None)
        # Its slot is free again (max_sessions=1): a new session opens and drafts.
        replies = list(drafting.Session(iter([
            drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="i", tokenizer_fingerprint=FP,
                                                                      vocab_size=VOCAB, n_draft=4)),
            drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes([1, 2, 1, 2])))]),
            timeout=10))
        assert replies[-1].draft.sequence_length == 4
        ch.close()


def test_session_limit_per_client(tmp_path):
    """Sessions beyond max_sessions_per_client (per bearer token, here per address) get
    RESOURCE_EXHAUSTED at `open`; the others go on, and closing frees slots."""
    import queue

    with ServiceThread(tmp_path / "data", max_sessions=300, max_sessions_per_client=200,
                       max_streams_per_connection=1000) as svc:
        ch, admin, _, drafting, _ = stubs(svc.port)
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="l", tokenizer_fingerprint=FP, vocab_size=VOCAB))
        opener = drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="l", tokenizer_fingerprint=FP,
                                                                           vocab_size=VOCAB, n_draft=4))
        held = []
        channels = [grpc.insecure_channel(f"127.0.0.1:{svc.port}") for _ in range(4)]
        refused = 0
        for k in range(260):
            q: queue.Queue = queue.Queue()
            q.put(opener)
            call = drafting_pb2_grpc.DraftingStub(channels[k % 4]).Session(iter(q.get, None), timeout=60)
            try:
                next(call)
                held.append((q, call))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "this client holds its maximum of 200 sessions" in e.details()
                refused += 1
        assert len(held) == 200 and refused == 60
        for q, call in held[:50]:  # closing frees slots
            q.put(None)
            list(call)
        q2: queue.Queue = queue.Queue()
        q2.put(opener)
        call = drafting.Session(iter(q2.get, None), timeout=10)
        assert next(call).opened.session_id
        q2.put(None)
        list(call)
        for q, call in held[50:]:
            q.put(None)
            list(call)
        for c in channels:
            c.close()
        ch.close()
