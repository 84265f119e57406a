"""The client's fleet history logic with no server: grouping, splitting, the bounded buffer, source ids, lag quantiles, options,
the publisher's batches and their outcome."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from ngramcache import BackendUnavailableError, InvalidArgumentError
from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.kernel.history_sources import SourceIds
from ngramcache.client.sync import ClientConfig
from ngramcache.client.sync.history import HistoryBuffer, HistoryPublisher, HistoryStats, PendingRecord, prompt_group
from ngramcache.client.sync.history_mirror import HistoryMirror, LagWindow
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import tokens_to_bytes

FP = b"\x07" * 32


def toks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def config(**options: object) -> ClientConfig:
    return ClientConfig(addresses=("127.0.0.1:1",), namespace="ns", fingerprint=FP, vocab_size=1000, cache_dir="/tmp",
                        **options)  # type: ignore[arg-type]


def test_siblings_of_one_prompt_share_a_group_and_continuations_keep_it() -> None:
    buf = HistoryBuffer(1000)
    prompt = toks(1, 2, 3)
    buf.add([(10, 0, prompt), (11, 0, prompt), (12, 0, toks(9, 9))])
    buf.add([(10, 3, toks(4, 5)), (11, 3, toks(6))])
    groups = {(r.seq, r.offset): r.group for r in buf.pending}
    assert groups[(10, 0)] == groups[(11, 0)] == groups[(10, 3)] == groups[(11, 3)] == prompt_group(prompt)
    assert groups[(12, 0)] != groups[(10, 0)]
    assert len(prompt_group(prompt)) == 16  # 8 bytes, hex


def test_set_group_wins_and_a_sequence_first_seen_mid_way_has_no_group() -> None:
    buf = HistoryBuffer(1000)
    buf.set_group(5, "rollout-7")
    buf.add([(5, 0, toks(1, 2)), (6, 40, toks(3))])
    assert [(r.seq, r.group) for r in buf.pending] == [(5, "rollout-7"), (6, "")]
    for bad in ("", "a b", "x" * 65, "é"):
        with pytest.raises(InvalidArgumentError, match="group must be"):
            buf.set_group(1, bad)


def test_records_split_to_the_token_limit_with_their_offsets() -> None:
    buf = HistoryBuffer(10_000, max_record_tokens=4)
    buf.add([(1, 7, np.arange(10, dtype=np.int32))])
    assert [(r.offset, r.tokens.tolist()) for r in buf.pending] == [
        (7, [0, 1, 2, 3]), (11, [4, 5, 6, 7]), (15, [8, 9])]
    assert buf.pending_tokens == 10


def test_batches_respect_record_and_byte_limits() -> None:
    buf = HistoryBuffer(10_000, max_batch_records=3, max_batch_bytes=5 * 4)
    buf.add([(i, 0, toks(i, i)) for i in range(7)])
    first = buf.take()
    assert [r.seq for r in first] == [0, 1]  # 2 tokens each: a third would pass 5 tokens' bytes
    buf.max_batch_bytes = 1 << 20
    assert [r.seq for r in buf.take()] == [2, 3, 4]
    assert [r.seq for r in buf.take()] == [5, 6]
    assert buf.take() == [] and buf.pending_tokens == 0


def test_server_limits_only_lower_the_split() -> None:
    buf = HistoryBuffer(100)
    buf.limit(16, 512)
    assert (buf.max_batch_records, buf.max_record_tokens) == (16, 512)
    buf.limit(0, 0)
    assert (buf.max_batch_records, buf.max_record_tokens) == (16, 512)


def test_a_full_buffer_drops_the_oldest_records_and_counts_them() -> None:
    buf = HistoryBuffer(5)
    assert buf.add([(1, 0, toks(1, 2, 3))]) == (0, 0)
    assert buf.add([(2, 0, toks(4, 5, 6))]) == (1, 3)
    assert [r.seq for r in buf.pending] == [2] and buf.pending_tokens == 3


def test_source_ids_continue_a_contiguous_run_and_split_a_broken_one() -> None:
    ids = SourceIds()
    a = ids.of("c1", 1, 0, 4)
    assert ids.of("c1", 1, 4, 2) == a  # continues
    assert ids.of("c2", 1, 0, 4) != a  # another client
    b = ids.of("c1", 1, 10, 3)  # offsets 6..9 never arrived: a new text
    assert b != a and ids.of("c1", 1, 13, 1) == b
    assert SourceIds.source("c1", 1, 0) == a  # stable across processes
    assert -(2**63) <= a < 2**63


def test_lag_window_quantiles() -> None:
    lag = LagWindow(size=100)
    assert lag.quantile(0.5) is None
    for v in range(1, 201):
        lag.add(float(v))  # only the last 100 are kept: 101..200
    assert lag.quantile(0.5) in (150.0, 151.0)
    assert lag.quantile(0.99) == 199.0
    assert lag.quantile(1.0) == 200.0


def test_history_option_follows_the_mode() -> None:
    assert config(mode="match").history is True
    assert config().history is False
    assert config(mode="match", history=False).history is False
    with pytest.raises(InvalidArgumentError, match="needs mode='match'"):
        config(history=True)
    with pytest.raises(InvalidArgumentError, match="history_max_pending_tokens"):
        config(mode="match", history_max_pending_tokens=0)
    with pytest.raises(InvalidArgumentError, match="history_max_bytes_per_s"):
        config(mode="match", history_max_bytes_per_s=-1)
    with pytest.raises(InvalidArgumentError, match="history_pull_records"):
        config(mode="match", history_pull_records=0)
    with pytest.raises(InvalidArgumentError, match="history_groups_per_pull"):
        config(mode="match", history_groups_per_pull=65)


class FakeDrafter:
    def __init__(self) -> None:
        self.outbox: list[tuple[int, int, np.ndarray]] = []
        self.added: list[tuple[int, list[int]]] = []
        self.flushes: list[float] = []

    def drain_history(self) -> list[tuple[int, int, np.ndarray]]:
        out, self.outbox = self.outbox, []
        return out

    def add_history(self, source: int, tokens: np.ndarray) -> None:
        self.added.append((source, tokens.tolist()))

    def flush_history(self, idle_seconds: float) -> int:
        self.flushes.append(idle_seconds)
        return 0


def test_mirror_appends_runs_of_one_sequence_in_one_call() -> None:
    drafter = FakeDrafter()
    state = SyncState(config(mode="match"), drafter)  # type: ignore[arg-type]
    mirror = HistoryMirror(state, HistoryStats())

    def rec(client: str, seq: int, offset: int, *tokens: int) -> counts_pb2.HistoryRecord:
        return counts_pb2.HistoryRecord(client_id=client, seq=seq, offset=offset, tokens=tokens_to_bytes(toks(*tokens)))

    n = mirror.apply([rec("a", 1, 0, 1, 2), rec("b", 1, 0, 7), rec("a", 1, 2, 3), rec("a", 1, 9, 5)])
    assert n == 5
    a = SourceIds.source("a", 1, 0)
    assert drafter.added == [(a, [1, 2, 3]), (SourceIds.source("b", 1, 0), [7]), (SourceIds.source("a", 1, 9), [5])]


def test_publisher_drains_groups_and_counts() -> None:
    drafter = FakeDrafter()
    state = SyncState(config(mode="match", history_max_pending_tokens=4), drafter)  # type: ignore[arg-type]
    stats = HistoryStats()
    publisher = HistoryPublisher(state, stats)
    drafter.outbox = [(1, 0, toks(1, 2, 3)), (2, 0, toks(1, 2, 3))]
    publisher.drain()
    assert (stats.drained_records, stats.drained_tokens) == (2, 6)
    assert (stats.dropped_records, stats.dropped_tokens) == (1, 3)  # over 4 tokens: the oldest went
    assert [r.seq for r in publisher.buffer.pending] == [2]
    asyncio.run(state.channels.close())


class FakeCounts:
    """PushHistory that fails the first ``failures`` calls with a retriable error, then stores by (client, seq)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[int] = []
        self.stored: dict[int, int] = {}

    async def PushHistory(self, request: counts_pb2.PushHistoryRequest, **_: object) -> counts_pb2.PushHistoryResponse:
        self.calls.append(request.seq)
        if self.failures:
            self.failures -= 1
            raise BackendUnavailableError("down")
        duplicate = request.seq in self.stored
        self.stored.setdefault(request.seq, len(request.records))
        return counts_pb2.PushHistoryResponse(duplicate=duplicate, records_stored=0 if duplicate else len(request.records))


def test_publisher_sends_one_batch_at_a_time_retrying_the_same_seq_and_flushes_at_close() -> None:
    drafter = FakeDrafter()
    state = SyncState(config(mode="match", history_push_interval=0.01), drafter)  # type: ignore[arg-type]
    stats = HistoryStats()
    publisher = HistoryPublisher(state, stats)
    publisher.buffer.max_batch_records = 2
    counts = FakeCounts(failures=2)

    class Chan:
        def __init__(self) -> None:
            self.counts = counts

        def stored(self) -> None:  # the channel's note of an acknowledged push (the health check reads it)
            pass

    async def retrying(what: str, call: Any, until: float | None = None) -> Any:
        while True:
            try:
                return await call(Chan())
            except BackendUnavailableError:
                await asyncio.sleep(0.001)

    state.retrying = retrying  # type: ignore[method-assign]

    async def body() -> None:
        state.closing = asyncio.Event()
        task = asyncio.create_task(publisher.run())
        drafter.outbox = [(i, 0, toks(i + 1)) for i in range(5)]
        await asyncio.sleep(0.2)
        drafter.outbox = [(9, 0, toks(1, 2))]
        state.closing.set()
        await task

    asyncio.run(body())
    assert counts.calls[:3] == [0, 0, 0]  # the same batch until it went through
    assert sorted(counts.stored) == [0, 1, 2, 3] and sum(counts.stored.values()) == 6
    assert (stats.pushed_batches, stats.pushed_records, stats.dropped_tokens) == (4, 6, 0)
    asyncio.run(state.channels.close())


@pytest.mark.parametrize(("code", "unconfirmed"), [(grpc.StatusCode.DEADLINE_EXCEEDED, True),
                                                   (grpc.StatusCode.INVALID_ARGUMENT, False)])
def test_a_batch_given_up_after_a_deadline_is_unconfirmed_and_after_a_refusal_dropped(code: Any, unconfirmed: bool) -> None:
    drafter = FakeDrafter()
    state = SyncState(config(mode="match"), drafter)  # type: ignore[arg-type]
    stats = HistoryStats()
    publisher = HistoryPublisher(state, stats)

    class Counts:
        async def PushHistory(self, request: Any, **_: object) -> Any:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no answer")

    class Chan:
        counts = Counts()

        def stored(self) -> None:
            pass

    async def retrying(what: str, call: Any, until: float | None = None) -> Any:
        try:
            return await call(Chan())
        except grpc.RpcError as e:  # given up at once, as after the last attempt before `until`
            raise InvalidArgumentError(str(e.code())) from None

    state.retrying = retrying  # type: ignore[method-assign]
    batch = [PendingRecord(seq=1, group="", offset=0, tokens=toks(1, 2, 3))]
    asyncio.run(publisher.send(batch, None))
    got = (stats.unconfirmed_records, stats.unconfirmed_tokens, stats.dropped_records, stats.dropped_tokens)
    assert got == ((1, 3, 0, 0) if unconfirmed else (0, 0, 1, 3))
    assert stats.pushed_batches == 0
    asyncio.run(state.channels.close())


def test_pushed_adds_up_to_stored_skipped_and_duplicate() -> None:
    """The publisher's counts of what the service acknowledged split the way the store did it, so history_pushed_*
    is stored + skipped (near-duplicate prompts) + duplicate (stored by an earlier attempt); a server from before
    tokens_stored (0 there, every record stored) still adds up."""
    drafter = FakeDrafter()
    state = SyncState(config(mode="match"), drafter)  # type: ignore[arg-type]
    stats = HistoryStats()
    publisher = HistoryPublisher(state, stats)
    replies = [counts_pb2.PushHistoryResponse(records_stored=1, tokens_stored=2, records_skipped=1, tokens_skipped=3),
               counts_pb2.PushHistoryResponse(duplicate=True),
               counts_pb2.PushHistoryResponse(records_stored=2)]  # an older server: no token counts

    class Chan:
        class counts:  # the stub's attribute name
            @staticmethod
            async def PushHistory(request: Any, **_: object) -> Any:
                return replies.pop(0)

        def stored(self) -> None:
            pass

    async def retrying(what: str, call: Any, until: float | None = None) -> Any:
        return await call(Chan())

    state.retrying = retrying  # type: ignore[method-assign]
    prompt = toks(1, 2, 3)
    for batch in ([PendingRecord(1, prompt_group(prompt), 0, prompt), PendingRecord(1, prompt_group(prompt), 3,
                                                                                    toks(4, 5))],
                  [PendingRecord(2, "", 5, toks(6))], [PendingRecord(3, "", 0, toks(7)), PendingRecord(3, "", 1, toks(8))]):
        asyncio.run(publisher.send(batch, None))
    assert (stats.pushed_records, stats.pushed_tokens) == (5, 8)
    assert (stats.stored_records, stats.stored_tokens) == (3, 4)
    assert (stats.skipped_records, stats.skipped_tokens) == (1, 3)
    assert (stats.duplicate_batches, stats.duplicate_records, stats.duplicate_tokens) == (1, 1, 1)
    assert stats.pushed_tokens == stats.stored_tokens + stats.skipped_tokens + stats.duplicate_tokens
    asyncio.run(state.channels.close())


def test_the_mirror_puts_a_skipped_prompt_back_in_front_of_the_sibling_sequence() -> None:
    """The store kept sibling a's copy of a prompt and skipped b's: b's sequence reaches the mirror at offset
    len(prompt); the drafter gets it whole, prompt first, under b's source from offset 0. A prompt this client
    published itself (its pulls skip its own records) serves the same way."""
    drafter = FakeDrafter()
    state = SyncState(config(mode="match"), drafter)  # type: ignore[arg-type]
    stats = HistoryStats()
    publisher = HistoryPublisher(state, stats)
    mirror = HistoryMirror(state, stats, publisher.buffer.live)
    prompt = toks(11, 12, 13)
    group = prompt_group(prompt)

    def rec(client: str, seq: int, offset: int, tokens: np.ndarray, group: str = group) -> counts_pb2.HistoryRecord:
        return counts_pb2.HistoryRecord(client_id=client, seq=seq, group=group, offset=offset,
                                        tokens=tokens_to_bytes(tokens))

    assert mirror.apply([rec("a", 1, 0, prompt), rec("a", 1, 3, toks(20, 21)), rec("b", 7, 3, toks(30, 31))]) == 7
    assert drafter.added == [(SourceIds.source("a", 1, 0), [11, 12, 13, 20, 21]),
                             (SourceIds.source("b", 7, 0), [11, 12, 13, 30, 31])]
    assert (stats.appended_tokens, stats.restored_tokens, stats.repeated_tokens) == (10, 3, 0)
    # Not a prompt (an explicit group, or an offset that is not the prompt's length): nothing is put in front.
    mirror.apply([rec("c", 1, 3, toks(40), group="rollout-1"), rec("d", 1, 4, toks(50))])
    assert drafter.added[-2:] == [(SourceIds.source("c", 1, 3), [40]), (SourceIds.source("d", 1, 4), [50])]
    # This client's own prompt: the publisher remembers it when it tags the sequence.
    drafter.outbox = [(5, 0, toks(60, 61))]
    publisher.drain()
    mine = prompt_group(toks(60, 61))
    mirror.apply([rec("e", 2, 2, toks(70), group=mine)])
    assert drafter.added[-1] == (SourceIds.source("e", 2, 0), [60, 61, 70])
    asyncio.run(state.channels.close())
