"""RemoteDrafter against a real service: the same drafts as a local Drafter on the same tables."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
from helpers.corpus import FP, VOCAB
from helpers.corpus import motif_corpus as corpus
from helpers.service import ServiceThread, wait_until

from ngramcache import CountTable, Drafter, RemoteDrafter, StaticCache, build_static_from_tokens
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
from ngramcache.client.kernel.errors import NamespaceNotFoundError, TokenizerMismatchError
from ngramcache.client.wire.codec import delta_rows_to_bytes, tokens_to_bytes

pytestmark = pytest.mark.integration


def open_on_replica(ch: grpc.Channel, namespace: str) -> None:
    """Make ``namespace`` live on the replica (a Draft call), as on a replica already serving it: later pushes and
    generations reach its drafters through the mirror's refreshes and the generation watch, not at once."""
    drafting_pb2_grpc.DraftingStub(ch).Draft(drafting_pb2.DraftRequest(
        namespace=namespace, tokenizer_fingerprint=FP, vocab_size=VOCAB, tokens=tokens_to_bytes(np.array([1], np.int32)),
        n_draft=1), timeout=30)


def wait_for_replica(svc: ServiceThread, namespace: str, *, generation: int, version: int) -> None:
    """Wait until the replica's drafters of ``namespace`` map ``generation`` and its mirror holds the counts up to
    store version ``version`` (a deadline that holds on a loaded machine)."""

    def current() -> bool:
        assert svc.service is not None
        live = svc.service.registry.live().get(namespace)
        return live is not None and live.generation >= generation and (live.mirror.version or 0) >= version

    wait_until(current, 30.0, f"namespace {namespace} on the replica: generation {generation}, counts version {version}")


def sessions_active(svc: ServiceThread) -> float:
    assert svc.service is not None and svc.service.metrics is not None
    return svc.service.metrics.registry.get_sample_value("ngramcache_sessions_active") or 0.0



def test_remote_drafts_equal_local_drafts_and_sessions_recover(tmp_path):
    counts_url = f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0"
    with ServiceThread(tmp_path / "data", counts=counts_url, mirror_interval=0.05, session_idle_timeout=0.5) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="r", tokenizer_fingerprint=FP, vocab_size=VOCAB))
        open_on_replica(ch, "r")
        learned = corpus(1)
        t = CountTable()
        t.update(learned)
        pushed = counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
            namespace="r", tokenizer_fingerprint=FP, client_id="t", seq=0, rows=delta_rows_to_bytes(t.to_rows())))
        path = tmp_path / "g.ngc"
        build_static_from_tokens([corpus(2)], path, vocab_size=VOCAB, fingerprint=FP, generation=1)
        data = path.read_bytes()
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(iter([
            static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace="r", generation=1, size=len(data), sha256=hashlib.sha256(data).digest())),
            static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=0, data=data))]), timeout=10)
        dynamic = CountTable()
        dynamic.update(learned)
        local = Drafter(static=StaticCache.open(path), dynamic=dynamic)
        text = corpus(3, 900)
        assert pushed.applied_units == 1
        assert svc.service is not None
        version = svc.service.runner.store.version("r")  # taken after the push was applied
        wait_for_replica(svc, "r", generation=1, version=version)  # what the exact asserts below need
        with RemoteDrafter(f"127.0.0.1:{svc.port}", "r", (FP, VOCAB)) as remote:
            nonempty = 0
            for n in range(20, len(text), 5):
                local.accept(1, text[:n])
                remote.accept(1, text[:n])
                want = local.draft(1, text[:n], 8).tolist()
                assert remote.draft(1, text[:n], 8).tolist() == want, n
                nonempty += bool(want)
            assert nonempty > 20 and remote.generation == 1
            # An idle session is evicted by the service; the next draft reopens it with the
            # whole sequence and drafts the same.
            wait_until(lambda: sessions_active(svc) == 0, what="the idle session evicted")
            n = len(text)
            local.accept(1, text[:n])
            assert remote.draft(1, text[:n], 8).tolist() == local.draft(1, text[:n], 8).tolist()
            # A rewound sequence starts a new session.
            local.reset(1)
            local.accept(1, text[:30])
            assert remote.draft(1, text[:30], 4).tolist() == local.draft(1, text[:30], 4).tolist()
            assert remote.reset(1) and not remote.reset(1)
        with RemoteDrafter(f"127.0.0.1:{svc.port}", "r", (bytes(32), VOCAB)) as wrong:
            with pytest.raises(TokenizerMismatchError):
                wrong.draft(1, text[:10])
        with RemoteDrafter(f"127.0.0.1:{svc.port}", "nope", (FP, VOCAB)) as missing:
            with pytest.raises(NamespaceNotFoundError):
                missing.draft(1, text[:10])
        ch.close()
