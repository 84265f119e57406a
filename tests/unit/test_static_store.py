"""StaticStore: publishing generation files and every refusal, listing, opening and sharing what is published.

The rest of its tests: test_static_store_upload.py, test_static_store_watch.py, test_static_store_retention.py."""

from __future__ import annotations

import ast
import asyncio
import errno
import hashlib
import struct
import time
from pathlib import Path

import grpc
import pytest
from helpers.static_store import FP, NS, OTHER_FP, VOCAB, assert_status, build, gens, ns_files, publish
from helpers.static_store import src as src  # fixtures, imported by name so that pytest finds them here
from helpers.static_store import store as store

from ngramcache import (
    CacheFormatError,
    GenerationConflictError,
    GenerationNotFoundError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LimitExceededError,
    StaticCache,
    TokenizerMismatchError,
)
from ngramcache.cache_service.static_store import GenerationInfo, StaticStore, generation_file_name
from ngramcache.cache_service.static_store import index as static_store_module
from ngramcache.cache_service.status import CHECKSUM_MISMATCH, GENERATION_NOT_FOUND, GENERATION_NOT_NEWER, LIMIT, status_of

HEADER = 128
ENTRY = 32


def section(data: bytes, name_index: int) -> tuple[int, int]:
    _, _, off, length, _ = struct.unpack_from("<IIQQQ", data, HEADER + name_index * ENTRY)
    return off, length


# ------------------------------------------------------------------------------ publish


def test_publish_makes_the_file_visible_with_its_metadata(store: StaticStore, src: Path) -> None:
    path = build(src / "g1.ngc", 1)
    data = path.read_bytes()
    before = time.time_ns() // 1_000_000
    result = publish(store, path)
    info = result.generation
    assert not result.already_published
    assert not path.exists()  # the store took the file
    assert info == GenerationInfo(
        namespace=NS, generation=1, size=len(data), sha256=hashlib.sha256(data).digest(), fingerprint=FP,
        vocab_size=VOCAB, created_unix_ms=info.created_unix_ms, ngram_size=2, n_keys=info.n_keys,
        n_followers=info.n_followers)
    assert before - 5 <= info.created_unix_ms <= time.time_ns() // 1_000_000 + 5
    assert info.n_keys > 0 and info.n_followers >= info.n_keys
    final = store.path_of(NS, 1)
    assert final.name == "00000000000000000001.ngc" == generation_file_name(1)
    assert final.read_bytes() == data
    # The sidecar is in sha256sum format, so `sha256sum -c` checks the folder.
    assert (final.parent / "00000000000000000001.sha256").read_text() == f"{hashlib.sha256(data).hexdigest()}  {final.name}\n"
    assert ns_files(store) == ["00000000000000000001.ngc", "00000000000000000001.sha256"]
    assert store.generations(NS) == [info]
    assert store.latest(NS) == info
    assert store.get(NS, 0) == info == store.get(NS, 1)


def test_generations_oldest_first_and_numbers_sort_past_nine(store: StaticStore, src: Path) -> None:
    for g in (2, 9, 10, 123):
        publish(store, build(src / f"g{g}.ngc", g))
    assert gens(store) == [2, 9, 10, 123]
    assert store.latest(NS).generation == 123  # type: ignore[union-attr]
    assert store.latest("empty") is None
    assert store.generations("empty") == []


def test_publish_accepts_a_hex_fingerprint(store: StaticStore, src: Path) -> None:
    assert publish(store, build(src / "g.ngc", 1), fingerprint=FP.hex()).generation.generation == 1


def test_same_generation_same_file_is_an_idempotent_success(store: StaticStore, src: Path) -> None:
    first = publish(store, build(src / "a.ngc", 4)).generation
    again_path = build(src / "b.ngc", 4)
    again = publish(store, again_path)
    assert again.already_published and again.generation == first
    assert not again_path.exists()
    assert gens(store) == [4]


def test_same_generation_other_file_is_already_exists(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "a.ngc", 4, seed=1))
    other = build(src / "b.ngc", 4, seed=2)
    with pytest.raises(GenerationConflictError) as e:
        publish(store, other)
    assert_status(e.value, grpc.StatusCode.ALREADY_EXISTS, CHECKSUM_MISMATCH)
    assert not other.exists()
    assert gens(store) == [4]


def test_older_generation_is_not_newer(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "a.ngc", 5))
    old = build(src / "b.ngc", 3)
    with pytest.raises(GenerationNotNewerError) as e:
        publish(store, old)
    assert_status(e.value, grpc.StatusCode.FAILED_PRECONDITION, GENERATION_NOT_NEWER)
    assert not old.exists()
    assert gens(store) == [5]


def test_generations_stay_monotonic_after_pruning(store: StaticStore, src: Path) -> None:
    for g in (1, 2, 3):
        publish(store, build(src / f"g{g}.ngc", g))
    assert asyncio.run(store.retain(NS, 1)) == [1, 2]
    with pytest.raises(GenerationNotNewerError) as e:
        publish(store, build(src / "again.ngc", 2))
    assert_status(e.value, grpc.StatusCode.FAILED_PRECONDITION, GENERATION_NOT_NEWER)


@pytest.mark.parametrize("kw", [{"fingerprint": OTHER_FP}, {"vocab_size": VOCAB + 1}])
def test_tokenizer_mismatch(store: StaticStore, src: Path, kw: dict[str, object]) -> None:
    path = build(src / "g.ngc", 1)
    with pytest.raises(TokenizerMismatchError):
        publish(store, path, **kw)
    assert status_of(TokenizerMismatchError("x")).code == grpc.StatusCode.FAILED_PRECONDITION
    assert not path.exists()
    assert gens(store) == [] and ns_files(store) == []


def corrupt_variants(good: bytes) -> dict[str, bytes]:
    followers_off, followers_len = section(good, 4)
    keys_off, _ = section(good, 1)
    flipped = bytearray(good)
    flipped[followers_off + followers_len // 2] ^= 0x40
    flipped_keys = bytearray(good)
    flipped_keys[keys_off] ^= 0x01
    bad_magic = bytearray(good)
    bad_magic[0] ^= 0xFF
    return {
        "flipped follower byte": bytes(flipped),
        "flipped key byte": bytes(flipped_keys),
        "truncated": good[: len(good) - 8],
        "header only": good[:HEADER],
        "bad magic": bytes(bad_magic),
        "empty": b"",
        "not a cache": b"hello, world\n" * 100,
    }


@pytest.mark.parametrize("case", list(corrupt_variants(b"\0" * 4096)))
def test_hostile_files_are_refused_and_leave_nothing(store: StaticStore, src: Path, case: str) -> None:
    good = build(src / "good.ngc", 1).read_bytes()
    bad = src / "bad.ngc"
    bad.write_bytes(corrupt_variants(good)[case])
    with pytest.raises(CacheFormatError):
        publish(store, bad)
    assert status_of(CacheFormatError("x")).code == grpc.StatusCode.INVALID_ARGUMENT
    assert not bad.exists()
    assert gens(store) == [] and ns_files(store) == []


def test_generation_zero_is_refused(store: StaticStore, src: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="generation"):
        publish(store, build(src / "g0.ngc", 0))
    assert gens(store) == []


@pytest.mark.parametrize("declared", ["generation", "size", "sha256"])
def test_declared_values_must_match_the_file(store: StaticStore, src: Path, declared: str) -> None:
    path = build(src / "g.ngc", 2)
    wrong: dict[str, object] = {"generation": 3, "size": path.stat().st_size + 1, "sha256": b"\0" * 32}
    with pytest.raises(InvalidArgumentError, match=declared.replace("sha256", "SHA-256")):
        publish(store, path, **{declared: wrong[declared]})
    assert not path.exists() and gens(store) == []


@pytest.mark.parametrize("ns", [".", "..", "a/b", "", "x" * 65, "spa ce"])
def test_malformed_namespaces(store: StaticStore, src: Path, ns: str) -> None:
    path = build(src / "g.ngc", 1)
    with pytest.raises(InvalidArgumentError):
        publish(store, path, ns=ns)
    assert not path.exists()
    with pytest.raises(InvalidArgumentError):
        store.generations(ns)
    with pytest.raises(InvalidArgumentError):
        store.path_of(ns, 1)


def test_namespaces_are_separate(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "a.ngc", 3), ns="a")
    publish(store, build(src / "b.ngc", 1), ns="b")
    assert gens(store, "a") == [3] and gens(store, "b") == [1]


def test_two_processes_racing_for_one_generation(tmp_path: Path, src: Path) -> None:
    # Two stores over one directory stand for two processes: their locks do not exclude
    # each other, the no-clobber link does.
    one, two = StaticStore(tmp_path / "data"), StaticStore(tmp_path / "data")
    a, b = build(src / "a.ngc", 7), build(src / "b.ngc", 7)

    async def race():
        return await asyncio.gather(
            one.publish(NS, a, fingerprint=FP, vocab_size=VOCAB), two.publish(NS, b, fingerprint=FP, vocab_size=VOCAB))

    results = asyncio.run(race())
    assert sorted(r.already_published for r in results) == [False, True]
    assert gens(one) == gens(two) == [7]
    assert ns_files(one) == ["00000000000000000007.ngc", "00000000000000000007.sha256"]


def test_filesystem_without_hard_links_falls_back_to_rename(store: StaticStore, src: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(*args: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(static_store_module.os, "link", no_link)
    path = build(src / "g.ngc", 1)
    data = path.read_bytes()
    publish(store, path)
    assert store.path_of(NS, 1).read_bytes() == data and not path.exists()


def test_disk_full_is_resource_exhausted(store: StaticStore, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(static_store_module.os, "link", full)
    path = build(src / "g.ngc", 1)
    with pytest.raises(LimitExceededError) as e:
        publish(store, path)
    assert_status(e.value, grpc.StatusCode.RESOURCE_EXHAUSTED, LIMIT)
    assert not path.exists() and gens(store) == []


# --------------------------------------------------------------------- reading and sharing


def test_open_maps_each_generation_once_and_shares_it(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "g.ngc", 1))
    publish(store, build(src / "h.ngc", 2))

    a, b, latest, two = store.open(NS, 1), store.open(NS, 1), store.open(NS), store.open(NS, 2)
    assert a is b and latest is two and a is not two
    assert a.generation == 1 and two.generation == 2
    assert a.path == str(store.path_of(NS, 1))
    a.verify()
    with pytest.raises(GenerationNotFoundError) as e:
        store.open(NS, 3)
    assert_status(e.value, grpc.StatusCode.NOT_FOUND, GENERATION_NOT_FOUND)
    with pytest.raises(GenerationNotFoundError) as e:
        store.get("nothing", 0)
    assert_status(e.value, grpc.StatusCode.NOT_FOUND, GENERATION_NOT_FOUND)


def test_a_restarted_store_reads_the_sidecar_without_hashing(tmp_path: Path, store: StaticStore, src: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    info = publish(store, build(src / "g.ngc", 1)).generation

    def no_hashing(path: Path) -> bytes:
        raise AssertionError(f"hashed {path} again")

    monkeypatch.setattr(static_store_module, "_sha256_of", no_hashing)
    assert StaticStore(tmp_path / "data").generations(NS) == [info]


def test_a_missing_sidecar_is_recomputed(tmp_path: Path, store: StaticStore, src: Path) -> None:
    info = publish(store, build(src / "g.ngc", 1)).generation
    sidecar = store.path_of(NS, 1).with_suffix(".sha256")
    sidecar.unlink()
    again = StaticStore(tmp_path / "data").generations(NS)
    assert again == [info]
    assert sidecar.read_text().startswith(info.sha256.hex())


def test_a_file_copied_in_by_hand_is_listed(store: StaticStore) -> None:
    path = build(store.data_dir / NS / generation_file_name(8), 8)
    (info,) = store.generations(NS)
    assert (info.generation, info.sha256) == (8, hashlib.sha256(path.read_bytes()).digest())


def test_static_cache_of_a_published_file_opens(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "g.ngc", 1))
    c = StaticCache.open(store.path_of(NS, 1))
    c.verify()
    assert (c.generation, c.fingerprint, c.vocab_size) == (1, FP, VOCAB)


def test_the_store_imports_no_grpc_and_names_no_status_code() -> None:
    # It raises library errors; the service's status.status_of alone turns them into codes.
    package = Path(static_store_module.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {m for m in imported if m.split(".")[0] == "grpc" or m.endswith("status")}, path.name
