"""Central rebuilds against real services on loopback (embedded store, and two replicas over a real redis-server)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.corpus import FAST, FP, VOCAB, motif_corpus
from helpers.service import ServiceThread, start_serve, stop_serve, wait_until

from ngramcache import CountTable, Drafter, NgramClient, StaticCache, build_static_from_tokens
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
from ngramcache.client.wire.codec import bytes_to_count_rows

pytestmark = pytest.mark.integration



def corpus(seed: int, n: int = 3000) -> np.ndarray:
    return motif_corpus(seed, n, motifs=10)

def create(address: str, prefix: str = "r-") -> str:
    name = prefix + uuid.uuid4().hex[:8]
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
            assert "no corpus base (none published)" in done.stdout, done.stdout
            first = tmp_path / "data" / "static" / ns / f"{1:020d}.ngc"
            assert file_pairs(first) == store_pairs(address, ns)  # every 2-gram count, exactly
            wait_until(lambda: client.stats()["generation"] == 1, what="the client to swap to generation 1")
            assert client.drafter().static is not None and client.drafter().static.generation == 1

            # A generation a rebuild made is never folded (it holds the store's counts already): the
            # deprecated --include-previous is ignored with a note, and the counts appear once.
            push_all(client, corpus(2))
            twice = rebuild_cli(address, ns, "--include-previous")
            assert twice.returncode == 0, twice.stderr
            assert "--include-previous is ignored: every rebuild folds the corpus base" in twice.stderr
            assert file_pairs(first.with_name(f"{2:020d}.ngc")) == store_pairs(address, ns)

            # A generation published from a corpus is the base: folded in, halved; the counts (min 2) on top.
            published = tmp_path / "corpus.ngc"
            build_static_from_tokens([corpus(7)], str(published), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                                     generation=5)
            publish(address, ns, published)
            expected = Counter({k: c // 2 for k, c in file_pairs(published).items() if c // 2 > 0})
            expected.update({k: c for k, c in store_pairs(address, ns).items() if c >= 2})
            done = rebuild_cli(address, ns, "--decay", "0.5", "--min-count", "2", "--keep", "1")
            assert done.returncode == 0, done.stderr
            halved = sum(1 for c in file_pairs(published).values() if c // 2 > 0)
            assert f"(base generation 5: {halved:,} rows, " in done.stdout, done.stdout
            sixth = tmp_path / "data" / "static" / ns / f"{6:020d}.ngc"
            assert file_pairs(sixth) == expected
            wait_until(lambda: client.stats()["generation"] == 6, what="the client to swap to generation 6")
            assert not first.exists()  # --keep 1: the older generations are deleted, the base excepted
            assert sorted(p.name for p in first.parent.glob("*.ngc")) == [f"{5:020d}.ngc", f"{6:020d}.ngc"]


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


def test_rebuild_takes_the_token_files_tokenize_makes_from_text(tmp_path: Path) -> None:
    """`ngramcache tokenize` turns text into the streams `rebuild --corpus` reads: the same counts as `build` of the text."""
    import sysconfig

    from ngramcache.client.kernel.tokenizer import load_tokenizer

    tok = load_tokenizer("tiktoken:qwen")
    text = tmp_path / "text"
    text.mkdir()
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "heapq.py", "textwrap.py"):
        (text / name).write_bytes((lib / name).read_bytes())
    cli = [sys.executable, "-m", "ngramcache.cache_service.cli"]
    made = subprocess.run([*cli, "tokenize", str(text), "-o", str(tmp_path / "corpus.npy"), "--tokenizer",
                           "tiktoken:qwen"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    built = subprocess.run([*cli, "build", str(text), "-o", str(tmp_path / "text.ngc"), "--tokenizer", "tiktoken:qwen",
                            "--quiet"], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    with ServiceThread(tmp_path / "data", corpus_root=str(tmp_path)) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = "r-" + uuid.uuid4().hex[:8]
        with grpc.insecure_channel(address) as ch:
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                name=ns, tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size), timeout=10)
        done = rebuild_cli(address, ns, "--corpus", str(tmp_path / "corpus.npy"))
        assert done.returncode == 0, done.stderr
        n = sum(len(tok.encode((text / name).read_text())) for name in ("bisect.py", "heapq.py", "textwrap.py"))
        assert f"{n:,} corpus tokens" in done.stdout
        assert file_pairs(tmp_path / "data" / "static" / ns / f"{1:020d}.ngc") == file_pairs(tmp_path / "text.ngc")


# --- The corpus base: what `ngramcache publish` put in carries into every rebuild -------------------------------


def publish_cli(address: str, namespace: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", "publish", str(path), "--namespace",
                           namespace, "--server", address], capture_output=True, text=True, timeout=120)


COPY = np.random.default_rng(29).permutation(40).astype(np.int32)  # 40 distinct tokens: one follower per 2-gram
OTHER = (40 + np.random.default_rng(30).permutation(24)).astype(np.int32)  # what the fleet writes: tokens 40..63


def base_file(tmp_path: Path, generation: int = 1, name: str = "code") -> Path:
    """A corpus generation as `ngramcache build` makes it: COPY four times, with a corpus index."""
    path = tmp_path / f"{name}-{generation}.ngc"
    build_static_from_tokens([np.tile(COPY, 4)], str(path), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                             generation=generation, corpus_index=True)
    return path


def gen_path(data: Path, ns: str, generation: int) -> Path:
    return data / "static" / ns / f"{generation:020d}.ngc"


def test_a_rebuild_keeps_the_published_corpus_the_client_drafts_from_and_adds_the_counts(tmp_path: Path) -> None:
    """An operator's sequence: publish a corpus generation, a client drafts an 8-token copy from it, counts are
    pushed, a default rebuild: the same client drafts the same copy and what only the counts give; two rebuilds
    in a row fold the base once each (no double counting) with its corpus index."""
    with ServiceThread(tmp_path / "data", mirror_interval=0.05) as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        base = base_file(tmp_path)
        done = publish_cli(address, ns, base)
        assert done.returncode == 0 and "as generation 1" in done.stdout, done.stderr
        probe, copy = COPY[5:9], COPY[9:17].tolist()
        counts_probe, counts_copy = OTHER[2:6], OTHER[6:14].tolist()
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            wait_until(lambda: client.stats()["generation"] == 1, what="the client to map generation 1")
            drafter = client.drafter()
            assert drafter.draft(101, probe, 8).tolist() == copy  # the 8-token copy, from the corpus
            assert drafter.draft(102, counts_probe, 8).size == 0
            push_all(client, np.tile(OTHER, 4))

            done = rebuild_cli(address, ns)
            assert done.returncode == 0, done.stderr
            wait_until(lambda: client.stats()["generation"] == 2, what="the client to swap to generation 2")
            assert drafter.draft(103, probe, 8).tolist() == copy  # still drafted after the rebuild
            assert drafter.draft(104, counts_probe, 8).tolist() == counts_copy
            base_rows = StaticCache.open(base).n_followers
            assert f"(base generation 1: {base_rows:,} rows, " in done.stdout, done.stdout
            second = gen_path(svc.data_dir, ns, 2)
            assert file_pairs(second) == file_pairs(base) + store_pairs(address, ns)  # each once
            alone = Drafter(static=StaticCache.open(second), dynamic=CountTable())  # the file alone drafts both
            assert alone.draft(1, probe, 8).tolist() == copy and alone.draft(2, counts_probe, 8).tolist() == counts_copy
            rebuilt = StaticCache.open(second)
            assert rebuilt.n_indexed >= StaticCache.open(base).n_indexed  # the base's corpus index carried
            assert rebuilt.corpus_match(COPY[:20])[0] == min(20, rebuilt.index_depth)

            push_all(client, np.tile(OTHER, 2))  # more counts: the store's totals grow
            done = rebuild_cli(address, ns)
            assert done.returncode == 0 and "(base generation 1: " in done.stdout, done.stderr
            third = gen_path(svc.data_dir, ns, 3)
            assert file_pairs(third) == file_pairs(base) + store_pairs(address, ns)  # not gen 2's counts again
            wait_until(lambda: client.stats()["generation"] == 3, what="the client to swap to generation 3")
            assert drafter.draft(105, probe, 8).tolist() == copy
        committed = svc.service.runner.store.committed_generation(ns)
        assert (committed.generation, committed.kind, committed.base) == (3, "rebuild", 1)


def test_no_base_drops_the_corpus_base_for_good_and_retention_keeps_it_until_then(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        base = base_file(tmp_path, 2)
        assert publish_cli(address, ns, base).returncode == 0
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            push_all(client, np.tile(OTHER, 4))
        for generation in (3, 4, 5):  # --keep 1: every older generation goes, the base stays
            done = rebuild_cli(address, ns, "--keep", "1")
            assert done.returncode == 0 and "(base generation 2: " in done.stdout, done.stderr
            names = sorted(p.name for p in gen_path(svc.data_dir, ns, 1).parent.glob("*.ngc"))
            assert names == [f"{2:020d}.ngc", f"{generation:020d}.ngc"], names
        assert file_pairs(gen_path(svc.data_dir, ns, 5)) == file_pairs(base) + store_pairs(address, ns)

        done = rebuild_cli(address, ns, "--no-base", "--keep", "1")
        assert done.returncode == 0 and "(corpus base dropped (--no-base), " in done.stdout, done.stdout
        assert file_pairs(gen_path(svc.data_dir, ns, 6)) == store_pairs(address, ns)  # the counts alone
        assert not gen_path(svc.data_dir, ns, 2).exists()  # no longer the base: pruned
        done = rebuild_cli(address, ns)  # dropped for good: the next default rebuild folds the counts alone
        assert done.returncode == 0 and "(no corpus base (none published), " in done.stdout, done.stdout
        assert file_pairs(gen_path(svc.data_dir, ns, 7)) == store_pairs(address, ns)


def test_a_base_whose_file_is_gone_refuses_the_rebuild_in_one_line_naming_the_fix(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        assert publish_cli(address, ns, base_file(tmp_path)).returncode == 0
        with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            push_all(client, np.tile(OTHER, 4))
        assert rebuild_cli(address, ns).returncode == 0
        gen_path(svc.data_dir, ns, 1).unlink()  # lost (a disk replaced, a hand-made cleanup)
        refused = rebuild_cli(address, ns)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert (f"the corpus base of {ns!r} (generation 1, the latest published one) cannot be folded: generation 1 "
                "is not on this replica and could not be fetched (no other replica is known to hold it); pass "
                "--no-base to rebuild from the counts alone (and drop the base), or publish a corpus generation "
                "again") in refused.stderr, refused.stderr
        assert not gen_path(svc.data_dir, ns, 3).exists()  # nothing published: the latest stays
        done = rebuild_cli(address, ns, "--no-base")
        assert done.returncode == 0 and "published generation 3" in done.stdout, done.stderr


def test_a_replica_without_the_base_file_fetches_it_before_it_rebuilds(tmp_path: Path, redis_standalone) -> None:  # type: ignore[no-untyped-def]
    url = redis_standalone.url
    with ServiceThread(tmp_path / "one", counts=url, keep_generations=1, peer_sync_interval=0.2) as one, \
            ServiceThread(tmp_path / "two", counts=url, peer_sync_interval=600.0) as two:
        a1, a2 = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
        ns = create(a1)
        base = base_file(tmp_path)
        assert publish_cli(a1, ns, base).returncode == 0  # only replica one holds generation 1
        with NgramClient(a1, ns, (FP, VOCAB), cache_dir=tmp_path / "cache", **FAST) as client:
            push_all(client, np.tile(OTHER, 4))
        assert rebuild_cli(a1, ns).returncode == 0  # generation 2, built on one: what two syncs first
        assert not gen_path(two.data_dir, ns, 1).exists()
        done = rebuild_cli(a2, ns, "--keep", "1")
        assert done.returncode == 0 and "(base generation 1: " in done.stdout, done.stderr
        assert two.service.registry.peer_sync.fetched == 2  # generation 2, then the base
        assert gen_path(two.data_dir, ns, 1).read_bytes() == base.read_bytes()  # fetched, kept past --keep 1
        assert not gen_path(two.data_dir, ns, 2).exists()
        assert file_pairs(gen_path(two.data_dir, ns, 3)) == file_pairs(base) + store_pairs(a2, ns)
        # Replica one fetches generation 3 and prunes past its --keep-generations 1: the base stays.
        wait_until(lambda: not gen_path(one.data_dir, ns, 2).exists(), 10.0, "replica one to fetch 3 and prune 2")
        assert gen_path(one.data_dir, ns, 3).exists() and gen_path(one.data_dir, ns, 1).exists()


def test_publish_refusals_name_the_latest_and_the_build_flag(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        ns = create(address)
        zero = publish_cli(address, ns, base_file(tmp_path, 0))
        assert zero.returncode == 2 and "Traceback" not in zero.stderr, zero.stderr
        assert (f"the file's header says generation 0, which is never published (the latest of {ns!r} is 0): build "
                "the file again with `ngramcache build --generation N`, N > 0") in zero.stderr, zero.stderr
        assert publish_cli(address, ns, base_file(tmp_path, 3)).returncode == 0
        for generation in (2, 3):  # below the latest; the latest itself with other content
            older = base_file(tmp_path, generation, name="other")
            build_static_from_tokens([np.tile(OTHER, 3)], str(older), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                                     generation=generation)
            refused = publish_cli(address, ns, older)
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
            assert "build the file again with `ngramcache build --generation N`, N > 3" in refused.stderr, refused.stderr
            assert (f"generation 2 of {ns!r} is not above its latest, 3: " if generation == 2
                    else f"generation 3 of {ns!r} was published with SHA-256 ") in refused.stderr, refused.stderr


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
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"ngramcache rebuild: error: cannot reach the service at 127.0.0.1:{port}: connection "
                                        "refused: nothing listens on that port; is the service running? check the port in "
                                        "--server"], done.stderr


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
        tmp_path: Path, embedded_service: ServiceThread, raw_tokenizer: tuple[bytes, int]) -> None:
    """The sequences the history keeps join the new file's corpus index (two records of one sequence,
    published apart, as one text); the counts are the dynamic counts alone; --no-history leaves them out."""
    from ngramcache.cache_service.counts.history import HistoryRecord

    address = f"127.0.0.1:{embedded_service.port}"
    ns = create(address)
    with NgramClient(address, ns, raw_tokenizer, cache_dir=tmp_path / "cache", **FAST) as client:
        push_all(client, corpus(3))
    generated = np.random.default_rng(7).integers(0, VOCAB, 64, dtype=np.int32)
    store = embedded_service.service.runner.store
    store.append_history(ns, "worker-a", 1, [HistoryRecord("", 5, "g", 0, generated[:40])])
    store.append_history(ns, "worker-a", 2, [HistoryRecord("", 5, "g", 40, generated[40:])])

    done = rebuild_cli(address, ns)
    assert done.returncode == 0, done.stderr
    assert "64 history tokens indexed" in done.stdout, done.stdout
    files = embedded_service.data_dir / "static" / ns
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
            time.sleep(1.0)  # widens the window between the build's end and the lease's release
            return release(lease)

        store.release_lease = slow_release
        with grpc.insecure_channel(address) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            admin.StartRebuild(admin_pb2.StartRebuildRequest(namespace=ns, corpus=[str(path)]), timeout=30)
            seen = set()
            deadline = time.monotonic() + 60  # a time, not a count of polls: a fast machine polled 2,000 times in 1 s
            while time.monotonic() < deadline:
                st = admin.GetRebuildStatus(admin_pb2.GetRebuildStatusRequest(namespace=ns), timeout=10)
                seen.add(st.state)
                if st.state == "done":
                    assert st.finished_unix_ms >= st.started_unix_ms > 0, st
                    probe = store.acquire_lease(ns, "probe", 10_000)  # free: the rebuild released it
                    store.release_lease(probe)
                    break
                assert st.state == "running", st
                time.sleep(0.005)
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
