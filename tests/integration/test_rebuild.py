"""Central rebuilds against real services on loopback (embedded store, and two replicas over a real redis-server)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB, motif_corpus
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient, StaticCache, build_static_from_tokens
from ngramcache.client._proto.codec import bytes_to_count_rows
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)

pytestmark = pytest.mark.integration



def corpus(seed: int, n: int = 3000) -> np.ndarray:
    return motif_corpus(seed, n, motifs=10)

def create(address: str) -> str:
    name = "r-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


def store_pairs(address: str, namespace: str, n: int = 2) -> Counter[tuple[int, ...]]:
    """The store's counts of n-grams of size n: (key..., follower) -> count."""
    with grpc.insecure_channel(address) as ch:
        chunks = counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(namespace=namespace,
                                                                            tokenizer_fingerprint=FP), timeout=30)
        rows = np.concatenate([bytes_to_count_rows(c.rows) for c in chunks])
    return Counter({(*r[1:1 + n], r[5]): int(r[6]) for r in rows.tolist() if r[0] == n})


def file_pairs(path: Path) -> Counter[tuple[int, ...]]:
    return Counter({(*r[1:1 + r[0]], r[5]): int(r[6]) for r in StaticCache.open(path).to_rows().tolist()})


def publish(address: str, namespace: str, path: Path) -> None:
    data = path.read_bytes()

    def requests():  # type: ignore[no-untyped-def]
        yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
            namespace=namespace, generation=StaticCache.open(path).generation, size=len(data),
            sha256=hashlib.sha256(data).digest()))
        yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=0, data=data))

    with grpc.insecure_channel(address) as ch:
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(requests(), timeout=30)


def rebuild_cli(address: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", "rebuild", "--namespace", namespace,
                           "--server", address, *args], capture_output=True, text=True, timeout=120)


def replace_file(path: Path, data: bytes) -> None:
    """Swap the file's content by rename: a process that maps the old file keeps reading it intact."""
    tmp = path.with_name(path.name + ".swap")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def push_all(client: NgramClient, tokens: np.ndarray) -> None:
    before = client.stats()["drained_count"]
    client.drafter().accept(1, tokens)
    wait_until(lambda: client.stats()["pending_rows"] == 0
               and client.stats()["acked_count"] == client.stats()["drained_count"] > before, what="pushes acknowledged")
    client.drafter().reset(1)


def test_rebuild_folds_counts_exactly_publishes_and_clients_swap(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", mirror_interval=0.05) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            push_all(client, corpus(1))
            done = rebuild_cli(address, ns)
            assert done.returncode == 0, done.stderr
            assert "published generation 1" in done.stdout and "dynamic rows" in done.stdout
            first = tmp_path / "data" / "static" / ns / f"{1:020d}.ngc"
            assert file_pairs(first) == store_pairs(address, ns)  # every 2-gram count, exactly
            wait_until(lambda: client.stats()["generation"] == 1, what="the client to swap to generation 1")
            assert client.drafter().static is not None and client.drafter().static.generation == 1

            # Folding a generation a rebuild made would count the store's counts twice: refused.
            push_all(client, corpus(2))
            twice = rebuild_cli(address, ns, "--include-previous")
            assert twice.returncode == 2 and "twice" in twice.stderr and "Traceback" not in twice.stderr

            # A generation published from a corpus is folded in, halved; the counts (min 2) on top.
            published = tmp_path / "corpus.ngc"
            build_static_from_tokens([corpus(7)], str(published), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                                     generation=5)
            publish(address, ns, published)
            expected = Counter({k: c // 2 for k, c in file_pairs(published).items() if c // 2 > 0})
            expected.update({k: c for k, c in store_pairs(address, ns).items() if c >= 2})
            done = rebuild_cli(address, ns, "--include-previous", "--decay", "0.5", "--min-count", "2", "--keep", "1")
            assert done.returncode == 0, done.stderr
            sixth = tmp_path / "data" / "static" / ns / f"{6:020d}.ngc"
            assert file_pairs(sixth) == expected
            wait_until(lambda: client.stats()["generation"] == 6, what="the client to swap to generation 6")
            assert not first.exists()  # --keep 1: the older generations are deleted


def test_rebuild_adds_a_corpus_and_refuses_bad_options(tmp_path: Path) -> None:
    tokens = corpus(5, 6000)
    path = tmp_path / "corpus.bin"
    tokens.astype("<i4").tofile(path)
    with ServiceThread(tmp_path / "data", corpus_root=str(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        done = rebuild_cli(address, ns, "--corpus", str(path))
        assert done.returncode == 0, done.stderr
        assert f"{len(tokens):,} corpus tokens" in done.stdout
        pairs = file_pairs(tmp_path / "data" / "static" / ns / f"{1:020d}.ngc")
        assert sum(pairs.values()) == len(tokens) - 2  # every 2-gram of the one stream
        for args, message in ((["--corpus", str(tmp_path / "missing.bin")], "not a readable file or folder under this server's corpus roots"),
                              (["--decay", "1.5"], "--decay"), (["--min-count", "0"], "--min-count")):
            bad = rebuild_cli(address, ns, *args)
            assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr
        empty = create(address)
        bad = rebuild_cli(address, empty)  # no counts, no corpus: nothing to publish
        assert bad.returncode == 2 and "nothing to fold" in bad.stderr and "Traceback" not in bad.stderr
        bad = rebuild_cli(address, "no-such-ns")
        assert bad.returncode == 2 and "no-such-ns" in bad.stderr and "Traceback" not in bad.stderr


def test_a_held_lease_refuses_a_second_rebuild(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        store = svc.service.runner.store
        lease = store.acquire_lease(ns, "another-replica", 60_000)
        done = rebuild_cli(address, ns)
        assert done.returncode == 2 and "another-replica" in done.stderr and "Traceback" not in done.stderr
        store.release_lease(lease)
        after = rebuild_cli(address, ns)  # past the lease now: stops at "nothing to fold" (no counts)
        assert after.returncode == 2 and "nothing to fold" in after.stderr


def test_server_down_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = rebuild_cli(f"127.0.0.1:{port}", "ns", "--timeout", "1")
    assert done.returncode == 2 and "no service answered" in done.stderr and "Traceback" not in done.stderr


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


def test_a_rebuild_folds_the_fleet_history_into_the_corpus_index_and_only_there(
        tmp_path: Path, service: ServiceThread, raw_tokenizer: tuple[bytes, int]) -> None:
    """The sequences the history keeps join the new file's corpus index (two records of one sequence,
    published apart, as one text); the counts are the dynamic counts alone; --no-history leaves them out."""
    from ngramcache.cache_service.counts.history import HistoryRecord

    address = f"127.0.0.1:{service.port}"
    ns = create(address)
    with NgramClient(address, ns, raw_tokenizer, cache_dir=tmp_path / "cache", **FAST) as client:
        push_all(client, corpus(3))
    generated = np.random.default_rng(7).integers(0, VOCAB, 64, dtype=np.int32)
    store = service.service.runner.store
    store.append_history(ns, "worker-a", 1, [HistoryRecord("", 5, "g", 0, generated[:40])])
    store.append_history(ns, "worker-a", 2, [HistoryRecord("", 5, "g", 40, generated[40:])])

    done = rebuild_cli(address, ns)
    assert done.returncode == 0, done.stderr
    assert "64 history tokens indexed" in done.stdout, done.stdout
    files = service.data_dir / "static" / ns
    cache = StaticCache.open(files / f"{1:020d}.ngc")
    assert cache.n_indexed == 64
    assert cache.corpus_match(generated[30:50]) == (min(20, cache.index_depth), 1)  # across the two records
    assert file_pairs(files / f"{1:020d}.ngc") == store_pairs(address, ns)

    plain = rebuild_cli(address, ns, "--no-history")
    assert plain.returncode == 0 and "0 history tokens" in plain.stdout, plain.stdout
    assert StaticCache.open(files / f"{2:020d}.ngc").n_indexed == 0


def test_status_says_done_only_after_the_lease_is_released_and_the_finish_time_set(tmp_path: Path) -> None:
    tokens = corpus(3, 4000)
    path = tmp_path / "corpus.bin"
    tokens.astype("<i4").tofile(path)
    with ServiceThread(tmp_path / "data", corpus_root=str(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        store = svc.service.runner.store
        release = store.release_lease

        def slow_release(lease):  # type: ignore[no-untyped-def]
            import time

            time.sleep(1.0)  # widens the window between the build's end and the lease's release
            return release(lease)

        store.release_lease = slow_release
        with grpc.insecure_channel(address) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace=ns, corpus=[str(path)]), timeout=30)
            seen = set()
            for _ in range(2000):
                st = admin.GetRebuildStatus(admin_pb2.GetRebuildStatusRequest(namespace=ns), timeout=10)
                seen.add(st.state)
                if st.state == "done":
                    assert st.finished_unix_ms >= st.started_unix_ms > 0, st
                    probe = store.acquire_lease(ns, "probe", 10_000)  # free: the rebuild released it
                    store.release_lease(probe)
                    break
                assert st.state == "running", st
        assert "done" in seen and "running" in seen, seen
        done = rebuild_cli(address, ns, "--corpus", str(path))
        assert done.returncode == 0, done.stderr
        seconds = float(done.stdout.rsplit(" in ", 1)[1].split()[0])
        assert seconds > 0, done.stdout


def test_rebuild_status_of_an_unknown_or_hostile_namespace_is_refused(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc, grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        for name, codes in (("nosuch", {grpc.StatusCode.NOT_FOUND}),
                            (".", {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}),
                            ("..", {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}),
                            ("x" * 20_000, {grpc.StatusCode.INVALID_ARGUMENT})):
            with pytest.raises(grpc.RpcError) as e:
                admin.GetRebuildStatus(admin_pb2.GetRebuildStatusRequest(namespace=name), timeout=10)
            assert e.value.code() in codes, (name[:10], e.value.code(), e.value.details()[:200])
            assert len(e.value.details()) <= 1024
        with pytest.raises(grpc.RpcError) as e:  # a huge name anywhere: a short message, not a metadata overflow
            admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="y" * 20_000, tokenizer_fingerprint=FP,
                                                                   vocab_size=VOCAB), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "20000 characters" in e.value.details()


@pytest.mark.parametrize("timeout", ["nan", "inf", "9" * 400, "0", "-1"])
def test_rebuild_timeout_must_be_finite_and_in_range(timeout: str) -> None:
    r = rebuild_cli("127.0.0.1:1", "ns", "--timeout", timeout)
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_corpus_paths_are_confined_to_the_corpus_roots_and_tell_nothing(tmp_path: Path) -> None:
    """A namespace-limited admin token cannot make the server read a file outside --corpus-root; a path outside,
    missing, too long or through a link out of the root all get one PERMISSION_DENIED text; an unknown namespace
    is NOT_FOUND before any path is looked at."""
    from helpers.auth import token, write_tokens_file
    from helpers.service import start_serve, stop_serve

    root = tmp_path / "corpus"
    root.mkdir()
    corpus(5, 3000).astype("<i4").tofile(root / "ok.bin")
    secret = tmp_path / "other-party" / "tokens.bin"
    secret.parent.mkdir()
    corpus(6, 3000).astype("<i4").tofile(secret)
    (root / "link.bin").symlink_to(secret)
    tokens = write_tokens_file(tmp_path / "tokens.toml")  # "all_alpha": admin on alpha only
    p, port = start_serve(tmp_path / "data", "--tokens-file", str(tokens), "--corpus-root", str(root))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            meta = (("authorization", f"Bearer {token('all_alpha')}"),)
            admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="alpha", tokenizer_fingerprint=FP,
                                                                   vocab_size=VOCAB), timeout=10, metadata=meta)
            texts = set()
            for path in (str(secret), "/nonexistent", "/etc/passwd", "/" + "x" * 300, str(root / "link.bin"),
                         str(root / "missing.bin")):
                with pytest.raises(grpc.RpcError) as e:
                    admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace="alpha", corpus=[path]), timeout=10,
                                       metadata=meta)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (path[:20], e.value.details())
                texts.add(e.value.details().replace(repr(path[:80]), "P").replace("...", ""))
            assert len(texts) == 1, texts
            # a folder under the root holding a link out of it: refused when the rebuild reads it
            status = admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace="alpha", corpus=[str(root)], wait=True),
                                        timeout=30, metadata=meta)
            assert status.state == "failed" and "corpus roots" in status.error, status
            assert not (tmp_path / "data" / "static" / "alpha").exists() or not any(
                (tmp_path / "data" / "static" / "alpha").glob("*.ngc"))  # nothing published
            # an unknown namespace, whatever the path: NOT_FOUND, never INTERNAL
            admin_all = (("authorization", f"Bearer {token('admin_all')}"),)
            with pytest.raises(grpc.RpcError) as e:
                admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace="nope", corpus=["/" + "x" * 300]),
                                   timeout=10, metadata=admin_all)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
            # inside the root: taken
            done = admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace="alpha", corpus=[str(root / "ok.bin")],
                                                                    wait=True), timeout=60, metadata=meta)
            assert done.state == "done" and done.corpus_tokens > 0, done
    finally:
        stop_serve(p)
