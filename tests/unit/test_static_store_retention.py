"""StaticStore's retention: old generations pruned, a namespace dropped, a crash's leftovers removed; files still
mapped stay readable."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.static_store import NS, build, gens, ns_files, publish
from helpers.static_store import src as src  # fixtures, imported by name so that pytest finds them here
from helpers.static_store import store as store

from ngramcache import InvalidArgumentError
from ngramcache.cache_service.static_store import StaticStore, generation_file_name


def test_retain_keeps_the_newest_and_mapped_files_stay_readable(store: StaticStore, src: Path) -> None:
    for g in (1, 2, 3, 4):
        publish(store, build(src / f"g{g}.ngc", g))
    old = store.open(NS, 1)
    expected = old.to_rows()
    assert asyncio.run(store.retain(NS, 2)) == [1, 2]
    assert gens(store) == [3, 4]
    assert ns_files(store) == [f"{generation_file_name(g)[:-4]}{ext}" for g in (3, 4) for ext in (".ngc", ".sha256")]
    old.verify()  # unlinked, still mapped
    assert np.array_equal(old.to_rows(), expected)
    assert asyncio.run(store.retain(NS, 2)) == []
    for keep in (0, -1):
        with pytest.raises(InvalidArgumentError):
            asyncio.run(store.retain(NS, keep))


def test_drop_removes_everything_and_numbers_restart(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "g.ngc", 5))
    mapped = store.open(NS, 5)
    assert asyncio.run(store.drop(NS)) is True
    assert not (store.data_dir / NS).exists()
    assert gens(store) == []
    assert asyncio.run(store.drop(NS)) is False
    mapped.verify()
    publish(store, build(src / "again.ngc", 1, seed=99))  # a recreated namespace is a new one
    assert gens(store) == [1]
    assert store.open(NS, 1) is not mapped


def test_crash_leftovers_are_ignored_then_removed_at_startup(tmp_path: Path, store: StaticStore, src: Path) -> None:
    info = publish(store, build(src / "g.ngc", 2)).generation
    d = store.data_dir / NS
    (d / "upload-0123456789abcdef.tmp").write_bytes(b"partial upload")
    (d / "00000000000000000003.ngc.tmp.123.deadbeef").write_bytes(b"partial native write")
    (d / "00000000000000000003.sha256").write_text("0" * 64 + "  00000000000000000003.ngc\n")  # no file
    (d / "00000000000000000009.ngc").write_bytes(b"garbage, not a cache")
    build(d / "00000000000000000011.ngc", 12)  # its header says another generation
    (d / "README").write_text("an operator's note\n")
    (store.data_dir / "stray-file").write_text("not a namespace")

    fresh = StaticStore(tmp_path / "data")
    assert fresh.generations(NS) == [info]
    removed = fresh.remove_leftovers()
    assert sorted(p.name for p in removed) == sorted([
        "upload-0123456789abcdef.tmp", "00000000000000000003.ngc.tmp.123.deadbeef", "00000000000000000003.sha256",
        "00000000000000000009.ngc", "00000000000000000011.ngc"])
    assert ns_files(fresh) == ["00000000000000000002.ngc", "00000000000000000002.sha256", "README"]
    assert fresh.generations(NS) == [info]
    assert fresh.remove_leftovers() == []


def test_leftover_removal_spares_young_temporaries(store: StaticStore) -> None:
    d = store.data_dir / NS
    d.mkdir(parents=True)
    young = d / "upload-aaaa.tmp"
    young.write_bytes(b"x")
    old = d / "upload-bbbb.tmp"
    old.write_bytes(b"x")
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert store.remove_leftovers(min_age_seconds=3600) == [old]
    assert young.exists()
