"""Client sync pieces with no server: the gRPC error mapping, row aggregation, backoff, the push buffer, generation files."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from ngramcache import (
    BackendUnavailableError,
    BatchTooOldError,
    CacheFormatError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    NgramCacheError,
    ResyncRequiredError,
    TokenizerMismatchError,
    build_static_from_tokens,
)
from ngramcache.client.kernel.static_files import GenerationFiles, sha256_of_file
from ngramcache.client.sync import Backoff, ClientConfig, aggregate_rows, error_from_rpc
from ngramcache.client.sync.pusher import Pusher
from ngramcache.client.sync.state import SyncState

FP = b"\x07" * 32


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str | None = None) -> None:
        self._code, self._reason = code, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ngc-error-reason", self._reason),) if self._reason else ()


@pytest.mark.parametrize(("code", "reason", "cls", "retriable"), [
    (grpc.StatusCode.UNAVAILABLE, None, BackendUnavailableError, True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, None, BackendUnavailableError, True),
    (grpc.StatusCode.NOT_FOUND, "NAMESPACE_NOT_FOUND", NamespaceNotFoundError, False),
    (grpc.StatusCode.FAILED_PRECONDITION, "TOKENIZER_MISMATCH", TokenizerMismatchError, False),
    (grpc.StatusCode.OUT_OF_RANGE, "RESYNC_REQUIRED", ResyncRequiredError, False),
    (grpc.StatusCode.INVALID_ARGUMENT, "BATCH_TOO_OLD", BatchTooOldError, False),
    (grpc.StatusCode.INVALID_ARGUMENT, "CACHE_FORMAT", CacheFormatError, False),
    (grpc.StatusCode.INVALID_ARGUMENT, None, InvalidArgumentError, False),
    (grpc.StatusCode.PERMISSION_DENIED, None, NgramCacheError, False),
])
def test_error_mapping(code: grpc.StatusCode, reason: str | None, cls: type, retriable: bool) -> None:
    err = error_from_rpc(FakeRpcError(code, reason))
    assert type(err) is cls and err.retriable is retriable
    assert err.code is code  # type: ignore[attr-defined]


def rows(*entries: tuple[int, int, int]) -> np.ndarray:
    out = np.full((len(entries), 7), -1, dtype=np.int32)
    for i, (t0, follower, count) in enumerate(entries):
        out[i, 0], out[i, 1], out[i, 5], out[i, 6] = 1, t0, follower, count
    return out


def test_aggregate_sums_identical_rows() -> None:
    got = aggregate_rows(rows((1, 2, 3), (4, 5, 1), (1, 2, 4)))
    assert sorted(map(tuple, got.tolist())) == [(1, 1, -1, -1, -1, 2, 7), (1, 4, -1, -1, -1, 5, 1)]
    assert got.dtype == np.int32


def test_backoff_is_bounded_and_jittered() -> None:
    b = Backoff(base=0.1, cap=1.0)
    delays = [b.delay(k) for k in range(40)]
    assert all(0 <= d <= 1.0 for d in delays) and len(set(delays)) > 1


class FakeDrafter:
    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []

    def drain_deltas(self) -> np.ndarray:
        return self.batches.pop(0) if self.batches else np.empty((0, 7), np.int32)


def core(tmp_path: Path, **options: object) -> tuple[Pusher, FakeDrafter]:
    config = ClientConfig(addresses=("127.0.0.1:1",), namespace="n", fingerprint=FP, vocab_size=10,
                          cache_dir=str(tmp_path), **options)  # type: ignore[arg-type]
    drafter = FakeDrafter()
    return Pusher(SyncState(config, drafter)), drafter  # type: ignore[arg-type]


def test_push_buffer_aggregates_then_drops_the_oldest(tmp_path: Path) -> None:
    c, drafter = core(tmp_path, max_pending_rows=3)
    drafter.batches = [rows((1, 1, 1), (2, 2, 1)), rows((1, 1, 1), (3, 3, 1))]
    c.drain()
    c.drain()
    assert c.pending_rows == 3 and c.state.stats.dropped_rows == 0  # 4 rows summed into 3
    drafter.batches = [rows((5, 5, 1), (6, 6, 1))]
    c.drain()
    assert c.pending_rows == 3 and c.state.stats.dropped_rows == 2
    batch = c.take_batch()
    assert batch is not None
    kept = {int(r[1]) for r in batch}
    assert {5, 6} <= kept  # the newest rows survive


def test_take_batch_respects_max_batch_rows(tmp_path: Path) -> None:
    c, drafter = core(tmp_path, max_batch_rows=2)
    drafter.batches = [rows((1, 1, 1), (2, 2, 1), (3, 3, 1))]
    c.drain()
    first, second = c.take_batch(), c.take_batch()
    assert first is not None and second is not None
    assert len(first) == 2 and len(second) == 1 and c.take_batch() is None


def test_generation_files_lock_verify_install_prune(tmp_path: Path) -> None:
    files = GenerationFiles(tmp_path, "ns")
    other = GenerationFiles(tmp_path, "ns")
    assert files.try_lock() and not other.try_lock()
    files.unlock()
    assert other.try_lock()
    other.unlock()
    for gen in (1, 2, 3, 4):
        rng = np.random.default_rng(gen)
        build_static_from_tokens([rng.integers(0, 10, 500).astype(np.int32)], str(files.part_path(gen)),
                                 vocab_size=10, fingerprint=FP, generation=gen)
        sha = sha256_of_file(files.part_path(gen))
        with pytest.raises(CacheFormatError):
            files.verify_part(gen, b"\x00" * 32, FP, 10)
        with pytest.raises(TokenizerMismatchError):
            files.verify_part(gen, sha, b"\x08" * 32, 10)
        files.verify_part(gen, sha, FP, 10)
        files.install(gen, sha)
        assert files.installed(gen, files.path(gen).stat().st_size, sha)
        assert not files.installed(gen, files.path(gen).stat().st_size, b"\x01" * 32)
    assert files.prune(current=4, keep=2) == [1, 2]
    assert files.generations() == [3, 4]


def test_a_bad_cache_dir_is_an_invalid_argument_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ngramcache import NgramClient

    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "missing" / "cache", f"cache_dir {tmp_path / 'missing' / 'cache'}: its parent folder "
                                         f"{tmp_path / 'missing'} does not exist: create it, or give another cache_dir"),
        (tmp_path / "file", f"cache_dir {tmp_path / 'file'} exists and is not a folder"),
        (tmp_path / "file" / "cache", f"cache_dir {tmp_path / 'file' / 'cache'}: its parent folder"),
        ("", "cache_dir is empty"),
    ]
    for cache_dir, message in cases:
        with pytest.raises(InvalidArgumentError) as err:
            NgramClient("127.0.0.1:9", "ns", (FP, 100), cache_dir=cache_dir, connect_timeout=0.2)
        assert str(err.value).startswith(message), err.value
    assert not (tmp_path / "missing").exists()
    # A cache_dir whose parent exists is created (and the client goes on to connect: nothing listens there).
    with pytest.raises(BackendUnavailableError):
        NgramClient("127.0.0.1:9", "ns", (FP, 100), cache_dir=tmp_path / "new", connect_timeout=0.2, ready_timeout=0.5)
    assert (tmp_path / "new").is_dir()
    # The default one is created with its parents.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    with pytest.raises(BackendUnavailableError):
        NgramClient("127.0.0.1:9", "ns", (FP, 100), connect_timeout=0.2, ready_timeout=0.5)
    assert (tmp_path / "home" / ".cache" / "ngramcache" / "ns").is_dir()
