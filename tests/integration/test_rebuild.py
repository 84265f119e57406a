"""Central rebuilds against a real service on loopback: the counts folded exactly, a corpus added, the history
indexed, the rebuild's status, and every refusal (options, leases, corpus paths, an unreachable server).

The corpus base's tests are in test_rebuild_corpus_base.py, those of several replicas in test_rebuild_replicas.py."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB
from helpers.rebuild import corpus, create, file_pairs, publish, push_all, rebuild_cli, store_pairs
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient, StaticCache, build_static_from_tokens
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration


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
