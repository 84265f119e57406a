"""Unit tests of counts.embedded: snapshots (atomic write, reload, what a crash loses, hostile files) and its batches."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.counts import FP, apply, batch, exported

from ngramcache.cache_service.counts.config import CountsStoreConfig
from ngramcache.cache_service.counts.embedded import EmbeddedCountsStore
from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.values import ApplyResult, GroupItem
from ngramcache.client.kernel.errors import CacheFormatError, InvalidArgumentError, ResyncRequiredError, SnapshotFormatError


def deltas(*r: list[int]) -> np.ndarray:
    return batch(list(r))


def export(store: EmbeddedCountsStore, ns: str) -> dict[tuple[int, ...], int]:
    return dict(exported(store, ns))


def test_snapshot_and_reload_keep_counts_dedup_and_refuse_old_versions(tmp_path: Path) -> None:
    url = f"embedded://{tmp_path}/counts.snap"
    store = open_counts_store(url, epoch_seconds=0, snapshot_seconds=0)
    assert isinstance(store, EmbeddedCountsStore) and store.path == f"{tmp_path}/counts.snap"
    store.create_namespace("a", FP, 1000, buckets=64)
    store.create_namespace("b", FP, 300)
    apply(store, "a", "c", 1, deltas([2, 1, 2, -1, -1, 3, 4], [4, 1, 2, 3, 4, 999, 1]))
    apply(store, "b", "c", 1, deltas([1, 299, -1, -1, -1, 0, 2]))
    version = store.version("a")
    store.close()
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]

    time.sleep(0.002)
    again = open_counts_store(url, epoch_seconds=0, snapshot_seconds=0)
    assert again.namespace_info("a") == store.namespace_info("a")
    assert export(again, "a") == {(2, 1, 2, -1, -1, 3): 4, (4, 1, 2, 3, 4, 999): 1}
    assert again.lookup("b", [299]) == {0: 2}
    assert apply(again, "a", "c", 1, deltas([2, 1, 2, -1, -1, 3, 4])).duplicate  # dedup survived
    with pytest.raises(ResyncRequiredError):  # counts behind old versions may be lost
        again.changes_since("a", version)
    again.close()


def test_a_crash_loses_at_most_the_writes_since_the_last_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "counts.snap"
    store = EmbeddedCountsStore(open_counts_store(f"embedded://{path}", snapshot_seconds=0).config)
    store.create_namespace("a", FP, 1000)
    apply(store, "a", "c", 1, deltas([1, 1, -1, -1, -1, 2, 1]))
    store.snapshot()
    apply(store, "a", "c", 2, deltas([1, 1, -1, -1, -1, 2, 1]))  # after the snapshot: lost in a crash
    # a crash: no close(), no final snapshot
    reloaded = EmbeddedCountsStore(store.config)
    assert reloaded.lookup("a", [1]) == {2: 1}
    assert apply(reloaded, "a", "c", 2, deltas([1, 1, -1, -1, -1, 2, 1])).applied == 1  # resent, counted once
    assert reloaded.lookup("a", [1]) == {2: 2}


def test_background_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "counts.snap"
    store = open_counts_store(f"embedded://{path}", snapshot_seconds=0.05)
    store.create_namespace("a", FP, 1000)
    apply(store, "a", "c", 1, deltas([1, 1, -1, -1, -1, 2, 5]))
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    reader = EmbeddedCountsStore(open_counts_store(f"embedded://{path}", snapshot_seconds=0).config)
    assert reader.lookup("a", [1]) == {2: 5}
    store.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty", "trailing"])
def test_hostile_snapshots_are_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "counts.snap"
    store = open_counts_store(f"embedded://{path}", snapshot_seconds=0)
    store.create_namespace("a", FP, 1000)
    apply(store, "a", "c", 1, deltas([3, 1, 2, 3, -1, 4, 7]))
    store.close()
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "magic":
        data[:8] = b"NOTASNAP"
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"\0" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotFormatError) as caught:
        open_counts_store(f"embedded://{path}", snapshot_seconds=0)
    assert isinstance(caught.value, CacheFormatError)


def test_memory_only_store_persists_nothing(tmp_path: Path) -> None:
    store = open_counts_store(None)
    assert isinstance(store, EmbeddedCountsStore) and store.path is None
    store.create_namespace("a", FP, 10)
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_only_embedded_urls_open_an_embedded_store() -> None:
    with pytest.raises(InvalidArgumentError):
        EmbeddedCountsStore(CountsStoreConfig.from_url("redis://127.0.0.1:1"))


def test_a_bad_batch_of_a_group_is_refused_whole_and_alone() -> None:
    store = open_counts_store(None)
    store.create_namespace("a", FP, 1000)
    good, bad = deltas([1, 1, -1, -1, -1, 2, 1]), deltas([1, 1, -1, -1, -1, 2, 1], [1, 1, -1, -1, -1, 1000, 1])
    ok, refused = store.apply_group("a", [GroupItem("c", 1, good), GroupItem("c", 2, bad)])
    assert isinstance(ok, ApplyResult) and ok.applied == 1 and isinstance(refused, InvalidArgumentError)
    assert export(store, "a") == {(1, 1, -1, -1, -1, 2): 1}  # nothing of the bad batch, not even its good row
    assert [apply(store, "a", "c", seq, good).applied for seq in (2, 3)] == [1, 1]  # its seq was not consumed
    assert export(store, "a") == {(1, 1, -1, -1, -1, 2): 3}
