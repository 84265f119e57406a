"""StaticStore: publishing, listing, sharing, pruning, dropping and watching generation files, and every refusal."""

from __future__ import annotations

import ast
import asyncio
import errno
import hashlib
import os
import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ngramcache import (
    CacheFormatError,
    ChecksumMismatchError,
    GenerationConflictError,
    GenerationNotFoundError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LimitExceededError,
    NamespaceNotFoundError,
    NgramCacheError,
    OffsetOutOfRangeError,
    StaticCache,
    TokenizerMismatchError,
    build_static_from_tokens,
)
from ngramcache.cache_service.static_store import GenerationInfo, StaticStore, generation_file_name
from ngramcache.cache_service.static_store import index as static_store_module
from ngramcache.cache_service.status import (
    CHECKSUM_MISMATCH,
    GENERATION_NOT_FOUND,
    GENERATION_NOT_NEWER,
    LIMIT,
    OFFSET_OUT_OF_RANGE,
    status_of,
)

FP = b"\x11" * 32
OTHER_FP = b"\x22" * 32
VOCAB = 50
NS = "docs"
HEADER = 128
ENTRY = 32


def build(path: Path, generation: int, *, seed: int | None = None, fingerprint: bytes = FP, vocab: int = VOCAB) -> Path:
    """A real static file of `generation` (its content depends on the seed, by default the generation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(generation if seed is None else seed)
    streams = [rng.integers(0, vocab, 2000).astype(np.int32) for _ in range(2)]
    build_static_from_tokens(streams, str(path), vocab_size=vocab, ngram_size=2, fingerprint=fingerprint,
                             generation=generation)
    return path


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Where test files are built (the same filesystem as the data directory)."""
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def store(tmp_path: Path) -> StaticStore:
    return StaticStore(tmp_path / "data")


def publish(store: StaticStore, path: Path, ns: str = NS, **kw: object):
    kw.setdefault("fingerprint", FP)
    kw.setdefault("vocab_size", VOCAB)
    return asyncio.run(store.publish(ns, path, **kw))  # type: ignore[arg-type]


def gens(store: StaticStore, ns: str = NS) -> list[int]:
    return [i.generation for i in store.generations(ns)]


def ns_files(store: StaticStore, ns: str = NS) -> list[str]:
    d = store.data_dir / ns
    return sorted(os.listdir(d)) if d.exists() else []


def assert_status(exc: BaseException, code: grpc.StatusCode, reason: str | None) -> None:
    """The store raised a library error that goes on the wire as ``code`` and ``reason``."""
    assert isinstance(exc, NgramCacheError)
    st = status_of(exc)
    assert (st.code, st.reason) == (code, reason)


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


def test_open_reader_from_offsets(store: StaticStore, src: Path) -> None:
    data = publish_and_read(store, src)
    info = store.get(NS)

    async def read_from(offset: int, expected: bytes = b"") -> bytes:
        async with await store.open_reader(NS, 0, offset=offset, expected_sha256=expected) as reader:
            assert reader.info == info
            out = b""
            while chunk := await reader.read(1000):
                out += chunk
            return out

    assert asyncio.run(read_from(0)) == data
    assert asyncio.run(read_from(1234, info.sha256)) == data[1234:]
    assert asyncio.run(read_from(len(data))) == b""
    with pytest.raises(OffsetOutOfRangeError) as e:
        asyncio.run(read_from(len(data) + 1))
    assert_status(e.value, grpc.StatusCode.OUT_OF_RANGE, OFFSET_OUT_OF_RANGE)
    with pytest.raises(ChecksumMismatchError) as e:
        asyncio.run(read_from(10, b"\1" * 32))
    assert_status(e.value, grpc.StatusCode.FAILED_PRECONDITION, CHECKSUM_MISMATCH)
    with pytest.raises(InvalidArgumentError):
        asyncio.run(read_from(0, b"short"))


def publish_and_read(store: StaticStore, src: Path, generation: int = 1) -> bytes:
    path = build(src / f"g{generation}.ngc", generation)
    data = path.read_bytes()
    publish(store, path)
    return data


def test_a_started_read_survives_pruning(store: StaticStore, src: Path) -> None:
    data = publish_and_read(store, src, 1)
    publish_and_read(store, src, 2)

    async def go() -> bytes:
        reader = await store.open_reader(NS, 1)
        try:
            first = await reader.read(100)
            assert await store.retain(NS, 1) == [1]
            return first + await reader.read(len(data))
        finally:
            reader.close()

    assert asyncio.run(go()) == data


# ------------------------------------------------------------------------ retain, drop


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


# -------------------------------------------------------------------------------- watch


def test_watch_sends_existing_then_new_generations(store: StaticStore, src: Path) -> None:
    for g in (1, 2, 3):
        publish(store, build(src / f"g{g}.ngc", g))

    async def go() -> list[int]:
        seen: list[int] = []
        watcher = store.watch(NS, after_generation=1)
        seen.append((await anext(watcher)).generation)
        seen.append((await anext(watcher)).generation)
        pending = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        assert not pending.done()
        await store.publish(NS, build(src / "g4.ngc", 4), fingerprint=FP, vocab_size=VOCAB)
        seen.append((await asyncio.wait_for(pending, 10)).generation)
        await watcher.aclose()
        assert not store._subscribers  # the watcher unregistered
        return seen

    assert asyncio.run(go()) == [2, 3, 4]


def test_a_slow_watcher_misses_nothing_and_blocks_no_publish(store: StaticStore, src: Path) -> None:
    async def go() -> list[int]:
        watcher = store.watch(NS)
        first = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        for g in range(1, 8):  # the watcher reads nothing meanwhile; publishing does not wait for it
            await asyncio.wait_for(store.publish(NS, build(src / f"g{g}.ngc", g), fingerprint=FP, vocab_size=VOCAB), 30)
        seen = [(await asyncio.wait_for(first, 10)).generation]
        while seen[-1] < 7:
            seen.append((await asyncio.wait_for(anext(watcher), 10)).generation)
        await watcher.aclose()
        return seen

    assert asyncio.run(go()) == list(range(1, 8))


def test_watch_ends_when_the_namespace_is_dropped(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "g.ngc", 1))

    async def go() -> None:
        watcher = store.watch(NS)
        assert (await anext(watcher)).generation == 1
        pending = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        await store.drop(NS)
        with pytest.raises(NamespaceNotFoundError):
            await asyncio.wait_for(pending, 10)

    asyncio.run(go())


# -------------------------------------------------------------------------------- upload


def upload(store: StaticStore, data: bytes, *, generation: int, chunks: list[tuple[int, bytes]] | None = None,
           size: int | None = None, sha256: bytes | None = None, ns: str = NS):
    async def go():
        up = store.upload(ns, generation=generation, size=len(data) if size is None else size,
                          sha256=hashlib.sha256(data).digest() if sha256 is None else sha256)
        async with up:
            for offset, chunk in chunks if chunks is not None else [(i, data[i:i + 997]) for i in range(0, len(data), 997)]:
                if chunk is None:  # the sender gives up midway (a stream that broke)
                    raise ConnectionAbortedError("the sender went away midway")
                await up.write(offset, chunk)
            return await up.publish(fingerprint=FP, vocab_size=VOCAB)

    return asyncio.run(go())


def test_upload_in_chunks_then_publish(store: StaticStore, src: Path) -> None:
    data = build(src / "g.ngc", 3).read_bytes()
    result = upload(store, data, generation=3)
    assert result.generation.sha256 == hashlib.sha256(data).digest()
    assert store.path_of(NS, 3).read_bytes() == data
    assert ns_files(store) == ["00000000000000000003.ngc", "00000000000000000003.sha256"]
    assert upload(store, data, generation=3).already_published


@pytest.mark.parametrize("case", ["gap", "overlap", "past size", "short", "sha256", "generation", "abandoned"])
def test_bad_uploads_leave_nothing(store: StaticStore, src: Path, case: str) -> None:
    data = build(src / "g.ngc", 3).read_bytes()
    half = len(data) // 2
    kw: dict[str, object] = {
        "gap": {"chunks": [(0, data[:half]), (half + 1, data[half + 1:])]},
        "overlap": {"chunks": [(0, data[:half]), (half - 1, data[half - 1:])]},
        "past size": {"chunks": [(0, data + b"x")]},
        "short": {"chunks": [(0, data[:half])]},
        "sha256": {"sha256": b"\0" * 32},
        "generation": {"generation": 4},
        "abandoned": {"chunks": [(0, data[:half]), (half, None)]},
    }[case]
    error, words = {
        "gap": (InvalidArgumentError, f"^a chunk at offset {half + 1}; the next byte expected is {half}$"),
        "overlap": (InvalidArgumentError, f"^a chunk at offset {half - 1}; the next byte expected is {half}$"),
        "past size": (InvalidArgumentError, f"^the upload goes past its declared size of {len(data)} bytes$"),
        "short": (InvalidArgumentError, f"^the upload ended after {half} of its {len(data)} bytes$"),
        "sha256": (InvalidArgumentError, "^the file's SHA-256 is [0-9a-f]{16}\\.\\.\\., not the 0{16}\\.\\.\\. declared$"),
        "generation": (InvalidArgumentError, "^the file's header says generation 3, not the 4 declared$"),
        "abandoned": (ConnectionAbortedError, "^the sender went away midway$"),  # raised inside the upload's block
    }[case]
    kw.setdefault("generation", 3)
    with pytest.raises(error, match=words) as caught:
        upload(store, data, **kw)  # type: ignore[arg-type]
    assert type(caught.value) is error  # not a subclass standing in for it
    assert ns_files(store) == [] and gens(store) == []


def test_upload_arguments(store: StaticStore) -> None:
    for kw in ({"generation": 0}, {"size": -1}, {"sha256": b"\0" * 31}):
        args: dict[str, object] = {"generation": 1, "size": 10, "sha256": b"\0" * 32, **kw}
        with pytest.raises(InvalidArgumentError):
            store.upload(NS, **args)  # type: ignore[arg-type]


def test_an_upload_cancelled_midway_leaves_nothing(store: StaticStore, src: Path) -> None:
    data = build(src / "g.ngc", 3).read_bytes()

    async def go() -> None:
        up = store.upload(NS, generation=3, size=len(data), sha256=hashlib.sha256(data).digest())
        started = asyncio.Event()

        async def client() -> None:
            async with up:
                await up.write(0, data[:100])
                started.set()
                await asyncio.sleep(3600)  # the client goes away here

        task = asyncio.ensure_future(client())
        await started.wait()
        assert len(ns_files(store)) == 1  # the partial upload
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert ns_files(store) == []


# ----------------------------------------------------------------- leftovers of a crash


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
