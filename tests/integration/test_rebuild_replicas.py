"""Rebuilds with several replicas over one real redis-server and no shared storage: one publisher per generation,
the others fetch it (refusing a corrupt transfer), list a new namespace's generation without a client, and are
held up by no hung builder."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.corpus import FAST, FP, VOCAB
from helpers.rebuild import COPY, base_file, corpus, create, publish, publish_cli, push_all, rebuild_cli
from helpers.service import ServiceThread, start_serve, stop_serve, wait_until

from ngramcache import NgramClient, build_static_from_tokens
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

pytestmark = pytest.mark.integration


def replace_file(path: Path, data: bytes) -> None:
    """Swap the file's content by rename: a process that maps the old file keeps reading it intact."""
    tmp = path.with_name(path.name + ".swap")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_two_replicas_racing_publish_each_generation_once(tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    url = redis_standalone.url
    with ServiceThread(tmp_path / "one", counts=url) as one, ServiceThread(tmp_path / "two", counts=url) as two:
        addresses = [f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"]
        ns = create(addresses[0])
        with grpc.insecure_channel(addresses[0]) as ch:  # something to fold
            counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
                namespace=ns, tokenizer_fingerprint=FP, client_id="c", seq=0,
                rows=np.array([[2, 1, 2, -1, -1, 3, 4]], dtype="<i4").tobytes()), timeout=10)
        outcomes: list[tuple[str, int, str]] = []
        published: list[int] = []

        def start(address: str) -> None:
            with grpc.insecure_channel(address) as ch:
                try:
                    status = admin_pb2_grpc.AdminStub(ch).StartRebuild(
                        admin_pb2.StartRebuildRequest(namespace=ns, wait=True), timeout=60)
                    outcomes.append((address, status.generation, status.state))
                except grpc.RpcError as e:
                    outcomes.append((address, 0, e.code().name))

        for _ in range(3):
            outcomes.clear()
            threads = [threading.Thread(target=start, args=(a,)) for a in addresses]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done = [o for o in outcomes if o[2] == "done"]
            assert len(done) >= 1, outcomes
            assert all(o[2] in ("done", "ABORTED") for o in outcomes), outcomes
            published += [g for _, g, _ in done]
        assert len(published) == len(set(published)) and sorted(published) == published
        committed = one.service.runner.store.committed_generation(ns)
        assert committed.generation >= 3


def test_replicas_without_shared_storage_fetch_the_new_generation(tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """Replica two fetches what replica one built, refuses a corrupt transfer, and its client swaps."""
    url = redis_standalone.url
    with ServiceThread(tmp_path / "one", counts=url) as one, \
            ServiceThread(tmp_path / "two", counts=url, peer_sync_interval=2.0) as two:
        a1, a2 = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
        ns = create(a1)
        with NgramClient(a2, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:  # on replica two
            push_all(client, corpus(3))
            assert rebuild_cli(a1, ns).returncode == 0
            built = tmp_path / "one" / "static" / ns / f"{1:020d}.ngc"
            fetched = tmp_path / "two" / "static" / ns / f"{1:020d}.ngc"
            wait_until(fetched.exists, 10.0, "replica two to fetch generation 1")
            assert fetched.read_bytes() == built.read_bytes()
            wait_until(lambda: client.stats()["generation"] == 1, 10.0, "the client of replica two to swap")

            # The next generation is served corrupt for a while: refused, then fetched once it is whole.
            # (Replica two checks every 2 s; should it fetch between publish and corruption, try the next one.)
            peers = two.service.registry.peer_sync
            for generation in (2, 3, 4):
                push_all(client, corpus(generation + 2))
                assert rebuild_cli(a1, ns).returncode == 0
                built = tmp_path / "one" / "static" / ns / f"{generation:020d}.ngc"
                fetched = tmp_path / "two" / "static" / ns / f"{generation:020d}.ngc"
                good = built.read_bytes()
                bad = bytearray(good)
                bad[len(bad) // 2] ^= 0xFF
                refused = peers.refused
                replace_file(built, bytes(bad))
                if not fetched.exists():
                    break
                replace_file(built, good)
            wait_until(lambda: peers.refused > refused, 10.0, "a corrupt transfer to be refused")
            assert not fetched.exists()
            replace_file(built, good)
            wait_until(lambda: client.stats()["generation"] == generation, 15.0, "the client to swap to it")
            assert fetched.read_bytes() == good

            # A generation published to replica one is committed too: replica two fetches it.
            path = tmp_path / "published.ngc"
            build_static_from_tokens([corpus(9)], str(path), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                                     generation=generation + 10)
            publish(a1, ns, path)
            wait_until(lambda: client.stats()["generation"] == generation + 10, 15.0, "replica two to fetch a Publish")
            assert one.service.runner.store.committed_generation(ns).generation == generation + 10


def test_a_new_namespaces_generation_is_listed_on_every_replica_without_a_client_there(
        tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """Replica two has never served the namespace: its scan of the store still installs generation 1."""
    url = redis_standalone.url
    with ServiceThread(tmp_path / "one", counts=url) as one, \
            ServiceThread(tmp_path / "two", counts=url, peer_sync_interval=0.2) as two:
        a1, a2 = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
        ns = create(a1)
        with NgramClient(a1, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            push_all(client, corpus(3))
        assert rebuild_cli(a1, ns).returncode == 0
        assert ns not in two.service.registry.live()

        def listed() -> list[int]:
            with grpc.insecure_channel(a2) as ch:
                resp = static_files_pb2_grpc.StaticFilesStub(ch).List(
                    static_files_pb2.ListGenerationsRequest(namespace=ns), timeout=10)
            return [g.generation for g in resp.generations]

        wait_until(lambda: listed() == [1], 10.0, "replica two to list generation 1")
        assert ns not in two.service.registry.live()  # installed, not opened: no mirror, no sessions


def test_a_new_namespaces_generation_is_listed_while_another_namespaces_builder_hangs(
        tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """A namespace created and published on replica one, never used on replica two, is listed there within the
    scan's period even while the replica that built another namespace hangs (SIGSTOP: a Fetch from it waits about
    20 s for gRPC to give up connecting, three attempts a check): a scan that checked the namespaces one after
    another would let a hung builder hold up every namespace after it in name order until a client used it on
    replica two."""
    url = redis_standalone.url
    hung, hung_port = start_serve(tmp_path / "hung", "--counts", url)
    try:
        stuck = create(f"127.0.0.1:{hung_port}", prefix="a-")  # before the new one in name order
        assert publish_cli(f"127.0.0.1:{hung_port}", stuck, base_file(tmp_path, name="stuck")).returncode == 0
        os.kill(hung.pid, signal.SIGSTOP)
        with ServiceThread(tmp_path / "one", counts=url) as one, \
                ServiceThread(tmp_path / "two", counts=url, peer_sync_interval=0.2) as two:
            a1, a2 = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
            wait_until(lambda: stuck in two.service.registry.scanning(), 10.0, "replica two to try the hung builder")
            ns = create(a1, prefix="b-")
            assert publish_cli(a1, ns, base_file(tmp_path)).returncode == 0

            def listed() -> list[int]:
                with grpc.insecure_channel(a2) as ch:
                    resp = static_files_pb2_grpc.StaticFilesStub(ch).List(
                        static_files_pb2.ListGenerationsRequest(namespace=ns), timeout=10)
                return [g.generation for g in resp.generations]

            wait_until(lambda: listed() == [1], 10.0, "replica two to list generation 1 of the new namespace")
            assert ns not in two.service.registry.live()  # installed by the scan, not by a client
            assert stuck in two.service.registry.scanning()  # the hung fetch is still waiting, apart
    finally:
        os.kill(hung.pid, signal.SIGCONT)
        stop_serve(hung)


def test_a_restarted_replica_says_serving_while_a_namespace_waits_on_a_hung_builder(
        tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """A restarted replica says SERVING once the store answers, and opens the namespaces it holds generations
    of in the background. Here opening one waits on the replica that built its newer generation, which hangs
    (SIGSTOP: each of three Fetch attempts waits about 20 s for gRPC to give up connecting); a start that waited
    for every namespace to open would keep the replica NOT_SERVING (and create_server from returning) all that
    time."""
    url = redis_standalone.url
    hung, hung_port = start_serve(tmp_path / "hung", "--counts", url)
    try:
        with ServiceThread(tmp_path / "two", counts=url) as two:
            address = f"127.0.0.1:{two.port}"
            stuck, other = create(address, prefix="a-"), create(address, prefix="a-")
            for ns in (stuck, other):
                assert publish_cli(address, ns, base_file(tmp_path, name=ns)).returncode == 0
        # While replica two is down, the builder publishes generation 2 of `stuck`, then hangs.
        done = publish_cli(f"127.0.0.1:{hung_port}", stuck, base_file(tmp_path, 2, name="stuck"))
        assert done.returncode == 0, done.stderr
        os.kill(hung.pid, signal.SIGSTOP)
        with ServiceThread(tmp_path / "two", counts=url) as two, \
                grpc.insecure_channel(f"127.0.0.1:{two.port}") as ch:  # the restart: create_server returned
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reply = drafting_pb2_grpc.DraftingStub(ch).Draft(drafting_pb2.DraftRequest(
                namespace=other, tokenizer_fingerprint=FP, vocab_size=VOCAB, tokens=COPY[:4].tobytes(), n_draft=4),
                timeout=10)  # a namespace not held up drafts from its generation
            assert reply.generation == 1 and np.frombuffer(reply.tokens, dtype=np.int32).tolist() == COPY[4:8].tolist()
            assert stuck not in two.service.registry.live()  # still opening: its peer check waits on the builder
    finally:
        os.kill(hung.pid, signal.SIGCONT)
        stop_serve(hung)
