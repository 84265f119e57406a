"""The corpus base of central rebuilds: what `ngramcache publish` put in carries into every rebuild until --no-base,
is kept past retention, is fetched from another replica, and publish's refusals say what to do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.corpus import FAST, FP, VOCAB
from helpers.rebuild import COPY, OTHER, base_file, create, file_pairs, gen_path, publish_cli, push_all, rebuild_cli, store_pairs
from helpers.service import ServiceThread, wait_until

from ngramcache import CountTable, Drafter, NgramClient, StaticCache, build_static_from_tokens

pytestmark = pytest.mark.integration


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
