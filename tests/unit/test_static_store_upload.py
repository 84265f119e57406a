"""StaticStore's transfers: a file uploaded chunk by chunk, then published, and every bad upload; a published file
read from an offset, even once pruned."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
import pytest
from helpers.static_store import FP, NS, VOCAB, assert_status, build, gens, ns_files, publish
from helpers.static_store import src as src  # fixtures, imported by name so that pytest finds them here
from helpers.static_store import store as store

from ngramcache import ChecksumMismatchError, InvalidArgumentError, OffsetOutOfRangeError
from ngramcache.cache_service.static_store import StaticStore
from ngramcache.cache_service.status import CHECKSUM_MISMATCH, OFFSET_OUT_OF_RANGE


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


def publish_and_read(store: StaticStore, src: Path, generation: int = 1) -> bytes:
    path = build(src / f"g{generation}.ngc", generation)
    data = path.read_bytes()
    publish(store, path)
    return data


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
