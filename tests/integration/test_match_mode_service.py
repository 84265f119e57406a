"""The match mode through a real service: Session and Draft with DRAFT_MODE_MATCH (lines and
trees) draft as a local match-mode Drafter on the same tables; bad modes are refused; a
synced NgramClient drafts in the match mode from a generation with a corpus index."""

from __future__ import annotations

import functools
import hashlib

import grpc
import pytest
from helpers.corpus import FP, VOCAB, motif_corpus
from helpers.service import ServiceThread, wait_until

from ngramcache import CountTable, Drafter, NgramClient, RemoteDrafter, StaticCache, build_static_from_tokens
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    drafting_pb2,
    drafting_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

pytestmark = pytest.mark.integration



corpus = functools.partial(motif_corpus, longest=11, per=7)

def publish(ch: grpc.Channel, path, generation: int) -> None:
    data = path.read_bytes()
    static_files_pb2_grpc.StaticFilesStub(ch).Publish(iter([
        static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
            namespace="m", generation=generation, size=len(data), sha256=hashlib.sha256(data).digest())),
        static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=0, data=data))]), timeout=10)


def generation_on_replica(svc: ServiceThread, namespace: str) -> int:
    """The static generation the replica's drafters of ``namespace`` map (0: none, or not live)."""
    assert svc.service is not None
    live = svc.service.registry.live().get(namespace)
    return 0 if live is None else live.generation


def test_sessions_and_draft_in_the_match_mode(tmp_path):
    counts_url = f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0"
    with ServiceThread(tmp_path / "data", counts=counts_url, mirror_interval=0.05) as svc:
        address = f"127.0.0.1:{svc.port}"
        ch = grpc.insecure_channel(address)
        admin = admin_pb2_grpc.AdminStub(ch)
        info = admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
        assert {"drafting.match_mode", "drafting.tree"} <= set(info.capabilities)
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="m", tokenizer_fingerprint=FP, vocab_size=VOCAB))
        # Live on the replica before the publish, as on a replica already serving it: the generation reaches its
        # drafters through the generation watch, not at once.
        drafting_pb2_grpc.DraftingStub(ch).Draft(drafting_pb2.DraftRequest(
            namespace="m", tokenizer_fingerprint=FP, vocab_size=VOCAB, tokens=tokens_to_bytes(corpus(3, 700)[:5]), n_draft=1),
            timeout=30)
        path = tmp_path / "g.ngc"
        build_static_from_tokens([corpus(2)], path, vocab_size=VOCAB, fingerprint=FP, generation=1, corpus_index=True)
        publish(ch, path, 1)
        local = Drafter(static=StaticCache.open(path), dynamic=CountTable(), mode="match")
        text = corpus(3, 700)
        wait_until(lambda: generation_on_replica(svc, "m") == 1, 30.0, "generation 1 mapped by the replica's drafters")
        with RemoteDrafter(address, "m", (FP, VOCAB), mode="match") as remote:
            assert remote.mode == "match"
            drafted = 0
            for n in range(20, len(text), 5):
                local.accept(1, text[:n])
                want = local.draft(1, text[:n], 8).tolist()
                assert remote.draft(1, text[:n], 8).tolist() == want, n
                drafted += len(want)
                if n % 50 == 0:  # a tree on the same step: the same tree
                    tokens, parents = remote.draft_tree(1, text[:n], 12)
                    want_tokens, want_parents = local.draft_tree(1, text[:n], 12)
                    assert tokens.tolist() == want_tokens.tolist() and parents.tolist() == want_parents.tolist()
                    assert 0 < len(tokens) <= 12
            assert drafted > 200 and remote.generation == 1
        with RemoteDrafter(address, "m", (FP, VOCAB)) as compatible:
            with pytest.raises(InvalidArgumentError, match="match mode"):
                compatible.draft_tree(1, text[:30], 8)
        with pytest.raises(InvalidArgumentError, match="mode must be"):
            RemoteDrafter(address, "m", (FP, VOCAB), mode="fast")

        stub = drafting_pb2_grpc.DraftingStub(ch)
        reply = stub.Draft(drafting_pb2.DraftRequest(namespace="m", tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                     tokens=tokens_to_bytes(text[:200]), n_draft=8,
                                                     mode=drafting_pb2.DRAFT_MODE_MATCH), timeout=10)
        assert len(bytes_to_tokens(reply.tokens)) > 0  # its history holds the session's text
        # An unknown mode, and a tree in a compatible session, are INVALID_ARGUMENT; the
        # service keeps answering.
        with pytest.raises(grpc.RpcError) as e:
            stub.Draft(drafting_pb2.DraftRequest(namespace="m", tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                 tokens=tokens_to_bytes(text[:20]), n_draft=8, mode=7), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "DraftMode" in e.value.details()
        requests = iter([
            drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="m", tokenizer_fingerprint=FP,
                                                                     vocab_size=VOCAB, n_draft=8)),
            drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes(text[:20]), tree_budget=8)),
        ])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Session(requests, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "DRAFT_MODE_MATCH" in e.value.details()
        reply = stub.Draft(drafting_pb2.DraftRequest(namespace="m", tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                     tokens=tokens_to_bytes(text[:200]), n_draft=8), timeout=10)
        assert reply.generation == 1

        # A synced client in the match mode drafts from the installed generation's index.
        with NgramClient(address, "m", (FP, VOCAB), cache_dir=tmp_path / "cache", mode="match",
                         pull_interval=0.1, push_interval=0.05) as nc:
            d = nc.drafter()
            assert d.mode == "match" and d.static is not None and d.static.index_depth > 0
            probe = corpus(2, 300)[:150]  # the corpus itself: long matches in the index
            d.accept(4, probe)
            assert len(d.draft(4, probe, 8)) > 0
        with pytest.raises(InvalidArgumentError, match="mode must be"):
            NgramClient(address, "m", (FP, VOCAB), cache_dir=tmp_path / "cache", mode="fast")
        ch.close()
