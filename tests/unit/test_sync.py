"""Client sync pieces with no server: the gRPC error mapping, the failover channel's retries, row aggregation, backoff, the push buffer, generation files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    OverloadedError,
    ResyncRequiredError,
    TokenizerMismatchError,
    build_static_from_tokens,
)
from ngramcache.client.kernel.static_files import GenerationFiles, sha256_of_file
from ngramcache.client.sync import Backoff, ClientConfig, aggregate_rows, error_from_rpc
from ngramcache.client.sync.pusher import Pusher
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire import transport
from ngramcache.client.wire.transport import FailoverChannel

FP = b"\x07" * 32


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str | None = None, *trailing: tuple[str, str]) -> None:
        self._code, self._reason, self._trailing = code, reason, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((("ngc-error-reason", self._reason),) if self._reason else ()) + self._trailing


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


class Calls:
    """A call for `FailoverChannel.retrying` that raises ``errors`` in turn, then answers the address it was sent to."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.addresses: list[str] = []

    async def __call__(self, chan: FakeChannel) -> str:
        self.addresses.append(chan.address)
        if self.errors:
            raise self.errors.pop(0)
        return chan.address


class FakeChannel:
    """A `Channel` with no grpc behind it: its address, its epoch, and a close that does nothing."""

    def __init__(self, address: str, epoch: int, credentials: object = None) -> None:
        self.address, self.epoch, self.channel = address, epoch, self

    async def close(self, grace: float | None = None) -> None:
        pass


Failover = Callable[..., tuple[str, list[str]]]


@pytest.fixture
def failover(monkeypatch: pytest.MonkeyPatch) -> Failover:
    """Runs a `Calls` through a FailoverChannel (fake channels, a 1 ms backoff): (its answer, the switches)."""
    monkeypatch.setattr(transport, "Channel", FakeChannel)

    def run(call: Calls, addresses: tuple[str, ...] = ("127.0.0.1:1", "127.0.0.1:2"), until: float | None = None,
            **options: Any) -> tuple[str, list[str]]:
        switched: list[str] = []

        async def body() -> str:
            channels = FailoverChannel(addresses, None, Backoff(base=0.001, cap=0.001),
                                       lambda address, reconnect: switched.append(address) if reconnect else None)
            try:
                return await channels.retrying("Test", call, until, lambda: False, **options)
            finally:
                await channels.close()

        return asyncio.run(body()), switched

    return run


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> list[grpc.RpcError]:
    """The errors error_from_rpc translates inside the failover channel."""
    seen: list[grpc.RpcError] = []

    def counting(e: grpc.RpcError) -> NgramCacheError:
        seen.append(e)
        return error_from_rpc(e)

    monkeypatch.setattr(transport, "error_from_rpc", counting)
    return seen


def test_failover_retries_an_unavailable_call_on_the_next_address(failover: Failover, mapped: list[grpc.RpcError]) -> None:
    call = Calls(FakeRpcError(grpc.StatusCode.UNAVAILABLE), FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    got, switched = failover(call)
    assert call.addresses == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"] and got == "127.0.0.1:1"
    assert switched == ["127.0.0.1:2", "127.0.0.1:1"]
    assert len(mapped) == 2  # each failure translated once


def test_failover_gives_up_at_once_on_an_error_retrying_cannot_help(failover: Failover,
                                                                   mapped: list[grpc.RpcError]) -> None:
    call = Calls(FakeRpcError(grpc.StatusCode.NOT_FOUND, "NAMESPACE_NOT_FOUND"))
    with pytest.raises(NamespaceNotFoundError):
        failover(call)
    assert len(call.addresses) == 1 and len(mapped) == 1


def test_failover_leaves_the_calls_own_errors_to_its_caller(failover: Failover) -> None:
    call = Calls(BackendUnavailableError("Pull ended before its last chunk"))
    with pytest.raises(BackendUnavailableError, match="last chunk"):
        failover(call)
    assert len(call.addresses) == 1


def test_failover_gives_up_past_until(failover: Failover) -> None:
    call = Calls(*[FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED) for _ in range(10**4)])
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        failover(call, ("127.0.0.1:1",), until=started + 0.05)
    assert 0.05 <= time.monotonic() - started < 5.0 and len(call.addresses) > 1


def test_failover_waits_a_shed_call_as_its_caller_says(failover: Failover, mapped: list[grpc.RpcError]) -> None:
    shed = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", ("ngc-retry-after-ms", "30"))
    hints: list[float | None] = []

    def overloaded(e: OverloadedError) -> float | None:
        hints.append(e.retry_after)
        return 0.0 if len(hints) == 1 else None

    call = Calls(shed, shed, shed)
    with pytest.raises(OverloadedError):
        failover(call, overloaded=overloaded)
    assert hints == [0.03, 0.03] and len(call.addresses) == 2 and len(mapped) == 2  # no switch: the same address
    assert call.addresses[0] == call.addresses[1]


def test_a_sync_task_waits_longer_after_what_retrying_cannot_cure(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    pusher, _ = core(tmp_path, backoff=Backoff(base=0.01, cap=0.01))
    state = pusher.state
    assert 0.0 <= state._failed("mirror", BackendUnavailableError("down"), 0) <= 0.01
    assert 1.0 <= state._failed("mirror", InvalidArgumentError("refused"), 0) <= 1.01
    with caplog.at_level("DEBUG", logger="ngramcache.client.sync"):
        assert 1.0 <= state._failed("mirror", OSError("disk full"), 3) <= 1.01
    assert "mirror failed" in caplog.text and "OSError: disk full" in caplog.text  # with its traceback

    async def switched() -> float | None:  # a call a channel switch cancelled (not this task): again soon
        return state._failed("mirror", asyncio.CancelledError(), 0)

    assert asyncio.run(switched()) == 0.05


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


