"""The StaticFiles service over a real gRPC server on loopback: publish, list, fetch (resumed), watch, and every refusal."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.service import ServerThread

from ngramcache import StaticCache, build_static_from_tokens
from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.servicers.static_files import StaticFilesServicer
from ngramcache.cache_service.static_store import StaticStore
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client._proto.v1 import static_files_pb2 as pb
from ngramcache.client._proto.v1 import static_files_pb2_grpc

pytestmark = pytest.mark.integration

FP = b"\x11" * 32
OTHER_FP = b"\x22" * 32
VOCAB = 50
MAX_FILE_BYTES = 200_000
FETCH_CHUNK = 4096
UPLOAD_CHUNK = 8192
REASON = "ngc-error-reason"


@dataclasses.dataclass
class StaticService:
    """A StaticFilesServicer on a real server, the stores behind it and a stub."""

    counts: CountsStore
    files: StaticStore
    stub: static_files_pb2_grpc.StaticFilesStub
    server: ServerThread
    build_dir: Path

    def namespace(self, fingerprint: bytes = FP, vocab_size: int = VOCAB) -> str:
        name = "sf-" + uuid.uuid4().hex[:10]
        self.counts.create_namespace(name, fingerprint, vocab_size)
        return name

    def build(self, generation: int, *, seed: int | None = None, fingerprint: bytes = FP, vocab: int = VOCAB) -> bytes:
        rng = np.random.default_rng(generation if seed is None else seed)
        streams = [rng.integers(0, vocab, 3000).astype(np.int32) for _ in range(3)]
        path = self.build_dir / f"{uuid.uuid4().hex}.ngc"
        build_static_from_tokens(streams, str(path), vocab_size=vocab, ngram_size=2, fingerprint=fingerprint,
                                 generation=generation)
        data = path.read_bytes()
        path.unlink()
        return data

    def publish(self, namespace: str, data: bytes, generation: int, **header: object) -> pb.PublishResponse:
        response: pb.PublishResponse = self.stub.Publish(publish_requests(namespace, data, generation, **header),
                                                         timeout=30)
        return response

    def fetch(self, namespace: str, generation: int = 0, offset: int = 0,
              expected_sha256: bytes = b"") -> tuple[pb.Generation, bytes]:
        stream = self.stub.Fetch(pb.FetchRequest(namespace=namespace, generation=generation, offset=offset,
                                                 expected_sha256=expected_sha256), timeout=30)
        messages = list(stream)
        assert messages[0].WhichOneof("kind") == "header"
        data = b""
        for m in messages[1:]:
            assert m.WhichOneof("kind") == "chunk"
            assert m.chunk.offset == offset + len(data)  # each chunk starts where the previous ended
            assert 0 < len(m.chunk.data) <= FETCH_CHUNK
            data += m.chunk.data
        return messages[0].header, data

    def listed(self, namespace: str) -> list[int]:
        return [g.generation for g in self.stub.List(pb.ListGenerationsRequest(namespace=namespace), timeout=30).generations]

    def files_of(self, namespace: str) -> list[str]:
        d = self.files.data_dir / namespace
        return sorted(p.name for p in d.iterdir()) if d.exists() else []

    def assert_serving(self) -> None:
        """The server still answers, and publishing still works."""
        ns = self.namespace()
        assert self.publish(ns, self.build(1), 1).generation.generation == 1
        assert self.listed(ns) == [1]


def publish_requests(namespace: str, data: bytes, generation: int, **header: object) -> Iterator[pb.PublishRequest]:
    fields: dict[str, object] = {"namespace": namespace, "generation": generation, "size": len(data),
                                 "sha256": hashlib.sha256(data).digest(), **header}
    yield pb.PublishRequest(header=pb.PublishHeader(**fields))  # type: ignore[arg-type]
    for offset in range(0, len(data), UPLOAD_CHUNK):
        yield pb.PublishRequest(chunk=pb.FileChunk(offset=offset, data=data[offset:offset + UPLOAD_CHUNK]))


def status(e: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str | None]:
    call = e.value
    reasons = [v for k, v in (call.trailing_metadata() or ()) if k == REASON]  # type: ignore[attr-defined]
    return call.code(), (reasons[0] if reasons else None)  # type: ignore[attr-defined]


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[StaticService]:
    counts = open_counts_store(None)
    runner = StoreRunner(counts, max_workers=2)
    files = StaticStore(tmp_path / "static")
    servicer = StaticFilesServicer(files, runner, max_file_bytes=MAX_FILE_BYTES, chunk_bytes=FETCH_CHUNK)
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    with ServerThread([(static_files_pb2_grpc.add_StaticFilesServicer_to_server, servicer)]) as server:
        stub = static_files_pb2_grpc.StaticFilesStub(server.channel())
        yield StaticService(counts, files, stub, server, build_dir)
    runner.close()


def test_publish_list_fetch(svc: StaticService, tmp_path: Path) -> None:
    ns = svc.namespace()
    data = svc.build(1)
    assert len(data) > 3 * FETCH_CHUNK  # several chunks each way
    response = svc.publish(ns, data, 1)
    gen = response.generation
    assert not response.already_published
    assert (gen.namespace, gen.generation, gen.size, gen.sha256) == (ns, 1, len(data), hashlib.sha256(data).digest())
    assert (gen.tokenizer_fingerprint, gen.vocab_size, gen.ngram_size) == (FP, VOCAB, 2)
    assert gen.n_keys > 0 and gen.n_followers >= gen.n_keys
    assert abs(gen.created_unix_ms - time.time() * 1000) < 60_000

    listed = svc.stub.List(pb.ListGenerationsRequest(namespace=ns), timeout=30).generations
    assert list(listed) == [gen]

    header, fetched = svc.fetch(ns, 1)
    assert header == gen
    assert hashlib.sha256(fetched).digest() == header.sha256  # what a client checks before installing
    path = tmp_path / "fetched.ngc"
    path.write_bytes(fetched)
    cache = StaticCache.open(path)
    cache.verify()
    assert (cache.generation, cache.fingerprint, cache.vocab_size) == (1, FP, VOCAB)

    # The same file again is an idempotent success.
    again = svc.publish(ns, data, 1)
    assert again.already_published and again.generation == gen
    assert svc.listed(ns) == [1]


def test_fetch_latest_and_resumed(svc: StaticService) -> None:
    ns = svc.namespace()
    svc.publish(ns, svc.build(1), 1)
    data = svc.build(2)
    svc.publish(ns, data, 2)
    header, whole = svc.fetch(ns)  # 0: the latest
    assert header.generation == 2 and whole == data

    # A download broken after 5000 bytes resumes from there, naming the file it expects.
    header2, rest = svc.fetch(ns, 2, offset=5000, expected_sha256=header.sha256)
    assert header2 == header and whole[:5000] + rest == data
    assert svc.fetch(ns, 2, offset=len(data)) == (header, b"")  # header only

    with pytest.raises(grpc.RpcError) as e:
        svc.fetch(ns, 2, offset=len(data) + 1)
    assert status(e)[0] == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(grpc.RpcError) as e:
        svc.fetch(ns, 2, offset=10, expected_sha256=b"\x01" * 32)
    assert status(e) == (grpc.StatusCode.FAILED_PRECONDITION, "CHECKSUM_MISMATCH")
    with pytest.raises(grpc.RpcError) as e:
        svc.fetch(ns, 3)
    assert status(e)[0] == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        svc.fetch(ns, 2, expected_sha256=b"short")
    assert status(e)[0] == grpc.StatusCode.INVALID_ARGUMENT
    empty = svc.namespace()
    with pytest.raises(grpc.RpcError) as e:
        svc.fetch(empty)  # no generation yet
    assert status(e)[0] == grpc.StatusCode.NOT_FOUND
    svc.assert_serving()


def test_watch_receives_existing_then_new_generations(svc: StaticService) -> None:
    ns = svc.namespace()
    svc.publish(ns, svc.build(1), 1)
    stream = svc.stub.Watch(pb.WatchRequest(namespace=ns, after_generation=0), timeout=60)
    try:
        first = next(stream)
        assert first.generation.generation == 1
        published = svc.publish(ns, svc.build(2), 2).generation
        second = next(stream)
        assert second.generation == published
    finally:
        stream.cancel()
    # after_generation skips what the client has.
    stream = svc.stub.Watch(pb.WatchRequest(namespace=ns, after_generation=1), timeout=60)
    try:
        assert next(stream).generation.generation == 2
    finally:
        stream.cancel()
    svc.assert_serving()


def flip_in_section(data: bytes, index: int) -> bytes:
    """`data` with one byte of section `index` flipped: the header still opens, verify() fails."""
    _, _, off, length, _ = struct.unpack_from("<IIQQQ", data, 128 + index * 32)
    bad = bytearray(data)
    bad[off + length // 2] ^= 0x10
    return bytes(bad)


@pytest.mark.parametrize("section", [1, 4])  # KEYS, FOLLOWERS
def test_corrupt_upload_is_refused_and_leaves_nothing(svc: StaticService, section: int) -> None:
    ns = svc.namespace()
    bad = flip_in_section(svc.build(1), section)  # the header's SHA-256 is of these bytes: only verify() sees it
    with pytest.raises(grpc.RpcError) as e:
        svc.publish(ns, bad, 1)
    assert status(e) == (grpc.StatusCode.INVALID_ARGUMENT, "CACHE_FORMAT")
    assert svc.listed(ns) == [] and svc.files_of(ns) == []
    svc.assert_serving()


@pytest.mark.parametrize("case", ["sha256", "generation", "short", "past size", "wrong offset", "no header", "empty"])
def test_malformed_uploads_are_invalid_argument(svc: StaticService, case: str) -> None:
    ns = svc.namespace()
    data = svc.build(1)
    requests: list[pb.PublishRequest] = list(publish_requests(ns, data, 1))
    if case == "sha256":
        requests = list(publish_requests(ns, data, 1, sha256=b"\0" * 32))
    elif case == "generation":
        requests = list(publish_requests(ns, data, 2))
    elif case == "short":
        requests = requests[:-1]
    elif case == "past size":
        requests.append(pb.PublishRequest(chunk=pb.FileChunk(offset=len(data), data=b"x")))
    elif case == "wrong offset":
        requests[2].chunk.offset += 1
    elif case == "no header":
        requests = requests[1:]
    elif case == "empty":
        requests = []
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Publish(iter(requests), timeout=30)
    assert status(e)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert svc.listed(ns) == [] and svc.files_of(ns) == []
    svc.assert_serving()


def test_disconnect_mid_upload_leaves_nothing(svc: StaticService) -> None:
    ns = svc.namespace()
    data = svc.build(1)
    release = threading.Event()

    def requests() -> Iterator[pb.PublishRequest]:
        it = publish_requests(ns, data, 1)
        yield next(it)
        yield next(it)
        release.wait(30)  # the client stalls, then goes away

    future = svc.stub.Publish.future(requests(), timeout=60)
    deadline = time.monotonic() + 20
    while not svc.files_of(ns) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(svc.files_of(ns)) == 1 and svc.files_of(ns)[0].endswith(".tmp")  # the partial upload
    future.cancel()
    release.set()
    while svc.files_of(ns) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.files_of(ns) == [] and svc.listed(ns) == []
    svc.assert_serving()


def test_oversized_upload_is_resource_exhausted(svc: StaticService) -> None:
    ns = svc.namespace()
    data = svc.build(1)

    def requests() -> Iterator[pb.PublishRequest]:
        yield pb.PublishRequest(header=pb.PublishHeader(namespace=ns, generation=1, size=MAX_FILE_BYTES + 1,
                                                        sha256=hashlib.sha256(data).digest()))
        yield pb.PublishRequest(chunk=pb.FileChunk(offset=0, data=data))

    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Publish(requests(), timeout=30)
    assert status(e) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "LIMIT")
    assert svc.listed(ns) == [] and svc.files_of(ns) == []
    svc.assert_serving()


def test_unknown_namespace_is_not_found(svc: StaticService) -> None:
    ns = "never-created"
    calls = [
        lambda: svc.stub.List(pb.ListGenerationsRequest(namespace=ns), timeout=30),
        lambda: list(svc.stub.Fetch(pb.FetchRequest(namespace=ns), timeout=30)),
        lambda: next(svc.stub.Watch(pb.WatchRequest(namespace=ns), timeout=30)),
        lambda: svc.publish(ns, svc.build(1), 1),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert status(e) == (grpc.StatusCode.NOT_FOUND, "NAMESPACE_NOT_FOUND")
    assert svc.files_of(ns) == []
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.List(pb.ListGenerationsRequest(namespace="bad/name"), timeout=30)
    assert status(e)[0] == grpc.StatusCode.INVALID_ARGUMENT
    svc.assert_serving()


@pytest.mark.parametrize("other", ["fingerprint", "vocab_size"])
def test_wrong_tokenizer_is_failed_precondition(svc: StaticService, other: str) -> None:
    ns = svc.namespace(fingerprint=OTHER_FP) if other == "fingerprint" else svc.namespace(vocab_size=VOCAB + 1)
    with pytest.raises(grpc.RpcError) as e:
        svc.publish(ns, svc.build(1), 1)
    assert status(e) == (grpc.StatusCode.FAILED_PRECONDITION, "TOKENIZER_MISMATCH")
    assert svc.listed(ns) == [] and svc.files_of(ns) == []
    svc.assert_serving()


def test_generation_order_and_identity(svc: StaticService) -> None:
    ns = svc.namespace()
    svc.publish(ns, svc.build(2), 2)
    with pytest.raises(grpc.RpcError) as e:
        svc.publish(ns, svc.build(1), 1)
    assert status(e) == (grpc.StatusCode.FAILED_PRECONDITION, "GENERATION_NOT_NEWER")
    with pytest.raises(grpc.RpcError) as e:
        svc.publish(ns, svc.build(2, seed=77), 2)
    assert status(e) == (grpc.StatusCode.ALREADY_EXISTS, "CHECKSUM_MISMATCH")
    assert svc.listed(ns) == [2]
    assert svc.files_of(ns) == ["00000000000000000002.ngc", "00000000000000000002.sha256"]
    svc.assert_serving()
