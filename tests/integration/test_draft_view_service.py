"""Clients mirroring the service's draft view (real service on loopback, embedded store or a real redis-server)."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB, motif_corpus
from helpers.draft_view import pull_view, settled_view
from helpers.service import ServiceThread, wait_until

from ngramcache import CountTable, NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows

pytestmark = pytest.mark.integration



corpus = functools.partial(motif_corpus, noise=True)

def create_namespace(address: str) -> str:
    name = "v-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


def store_rows(address: str, namespace: str) -> int:
    with grpc.insecure_channel(address) as ch:
        chunks = counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(
            namespace=namespace, tokenizer_fingerprint=FP), timeout=30)
        return sum(len(bytes_to_count_rows(c.rows)) for c in chunks)


def rows_of(table: CountTable) -> list[tuple[int, ...]]:
    return sorted(map(tuple, table.to_rows().tolist()))


def test_a_draft_view_mirror_drafts_exactly_like_a_full_mirror_with_fewer_rows(tmp_path: Path) -> None:
    """top_k 64, min_change_pct 0 and no rate budget keep everything that can draft: the drafts are identical."""
    with ServiceThread(tmp_path / "data", mirror_interval=0.05, view_top_k=64, view_min_change_pct=0,
                       view_max_rows_per_second=10**9) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "p", **FAST) as pusher, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "f", mirror="full", **FAST) as full, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "d", **FAST) as view:
            text = corpus(1)
            for i in range(100, len(text), 100):
                pusher.drafter().accept(1, text[:i])
            pusher.drafter().accept(1, text)
            wait_until(lambda: pusher.stats()["pending_rows"] == 0
                       and pusher.stats()["acked_count"] == pusher.stats()["drained_count"] > 0, what="pushes")
            stored = store_rows(address, ns)
            wait_until(lambda: full.stats()["mirror_rows"] == stored, what="the full mirror to hold every stored row")
            view_id, version, served = settled_view(address, ns)
            wait_until(lambda: view.stats()["view_id"] == view_id and view.stats()["mirror_version"] >= version,
                       what="the draft mirror to reach the view")
            assert rows_of(view.drafter().dynamic) == rows_of(served)
            full_rows, view_rows = full.stats()["mirror_rows"], view.stats()["mirror_rows"]
            assert 0 < view_rows < full_rows
            probe = corpus(2, 3000)  # the same motifs, other noise
            drafted = 0
            for i in range(8, len(probe), 7):
                a = full.drafter().draft(10_000 + i, probe[:i], 8)
                b = view.drafter().draft(10_000 + i, probe[:i], 8)
                assert a.tolist() == b.tolist(), f"prefix {i}"
                drafted += len(a)
            assert drafted > 100
            assert view.stats()["pulled_bytes"] < full.stats()["pulled_bytes"]


def test_counts_republished_only_when_they_move_by_min_change_pct(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", mirror_interval=0.05, view_min_change_pct=50) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create_namespace(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "p", **FAST) as pusher, \
                NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "d", **FAST) as view:
            seq = np.array([3, 4] * 2, dtype=np.int32)
            for i in range(1, 41):
                pusher.drafter().accept(i, seq)  # each sequence counts (3) -> 4 once
                wait_until(lambda i=i: pusher.stats()["acked_count"] == pusher.stats()["drained_count"]
                           and pusher.stats()["drained_count"] > 0, what="the push")
            # Wait for the condition, not a clock: the service's view settled, and the client's mirror holds it.
            view_id, version, served = settled_view(address, ns)
            wait_until(lambda: view.stats()["view_id"] == view_id and view.stats()["mirror_version"] >= version, 30.0,
                       "the draft mirror to reach the view")
            assert rows_of(view.drafter().dynamic) == rows_of(served)
            tokens, counts = view.drafter().dynamic.lookup([3])
            assert tokens.tolist() == [4]
            true = 40
            assert abs(true - int(counts[0])) * 100 <= 50 * int(counts[0])
            pulled = view.stats()["pulled_rows"]
            assert pulled < 40  # not one row per change


def test_moving_to_another_replica_reloads_the_view(tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    url = redis_standalone.url
    with ServiceThread(tmp_path / "one", counts=url, mirror_interval=0.05) as one, \
            ServiceThread(tmp_path / "two", counts=url, mirror_interval=0.05) as two:
        a1, a2 = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
        ns = create_namespace(a1)
        with NgramClient(a1, ns, (FP, VOCAB), cache_dir=tmp_path / "p", **FAST) as pusher:
            pusher.drafter().accept(1, corpus(3, 2000))
            wait_until(lambda: pusher.stats()["acked_count"] == pusher.stats()["drained_count"] > 0, what="pushes")
        client = NgramClient([a1, a2], ns, (FP, VOCAB), cache_dir=tmp_path / "c", **FAST)
        try:
            first = client.stats()["view_id"]
            assert first == pull_view(a1, ns)[0]
            one.__exit__(None, None, None)  # replica one goes away
            view_id, _, served = settled_view(a2, ns)
            wait_until(lambda: client.stats()["view_id"] == view_id, 20.0, "the client to move to replica two")
            assert client.stats()["resyncs"] >= 1
            assert rows_of(client.drafter().dynamic) == rows_of(served)
            assert len(rows_of(served)) > 0
        finally:
            client.close()
