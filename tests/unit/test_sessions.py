"""The session rules without gRPC: admission and per-client quotas, the idle timer, a session's sequence and steps, eviction."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from numpy.typing import NDArray

from ngramcache.cache_service import sessions as sessions_module
from ngramcache.cache_service.sessions import (
    INLINE_ACCEPT_TOKENS,
    SessionEvictedError,
    SessionLimitError,
    SessionLimits,
    Sessions,
)
from ngramcache.client import Drafter
from ngramcache.client.kernel.errors import InvalidArgumentError

T = TypeVar("T")
FP = bytes(range(32))
VOCAB = 100


def limits(**changes: float | int | None) -> SessionLimits:
    values: dict[str, float | int | None] = {"max_sessions": 4, "idle_timeout": 30.0, "max_session_tokens": 64,
                                             "max_step_tokens": 16, "max_draft_tokens": 32}
    values.update(changes)
    return SessionLimits(**values)  # type: ignore[arg-type]


def run(test: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(test())


def tokens(*values: int) -> NDArray[np.int32]:
    return np.array(values, dtype=np.int32)


class FakeDrafter:
    """Records what a session asks of its drafter; drafts the last token repeated; refuses tokens >= VOCAB."""

    def __init__(self) -> None:
        self.accepted: list[tuple[int, list[int], str]] = []  # (seq, tokens, thread name)
        self.resets: list[int] = []

    def accept(self, seq: int, tokens: NDArray[np.int32]) -> None:
        if tokens.size and int(tokens.max()) >= VOCAB:
            raise InvalidArgumentError("outside the vocabulary")
        self.accepted.append((seq, tokens.tolist(), threading.current_thread().name))

    def draft(self, seq: int, tokens: NDArray[np.int32], n_draft: int = 8) -> NDArray[np.int32]:
        return np.full(n_draft, tokens[-1] if tokens.size else 0, dtype=np.int32)

    def draft_tree(self, seq: int, tokens: NDArray[np.int32],
                   budget: int = 16) -> tuple[NDArray[np.int32], NDArray[np.int32]]:
        return np.arange(budget, dtype=np.int32), np.full(budget, -1, dtype=np.int32)

    def reset(self, seq: int) -> bool:
        self.resets.append(seq)
        return True


class Requests:
    """An async stream of requests a test feeds (None ends it), like a call's request iterator."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> object:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


# --------------------------------------------------------------------------- admission


def test_admission_stops_at_max_sessions_and_a_closed_session_frees_its_slot() -> None:
    async def main() -> None:
        table = Sessions(limits(max_sessions=2))
        drafter = FakeDrafter()
        a = table.open("c1", drafter, "compatible", 4)
        b = table.open("c2", drafter, "compatible", 4)
        assert table.active == 2 and a.id != b.id
        with pytest.raises(SessionLimitError, match="the server holds its maximum of 2 sessions; retry later or use Draft"):
            table.open("c3", drafter, "compatible", 4)
        assert table.active == 2  # a refused session holds no slot
        a.close()
        a.close()  # closing twice frees one slot, once
        assert table.active == 1 and drafter.resets == [a.id]
        with table.open("c3", drafter, "compatible", 4) as c:
            assert table.active == 2
        assert table.active == 1 and drafter.resets == [a.id, c.id]

    run(main)


def test_each_client_has_its_own_quota() -> None:
    async def main() -> None:
        table = Sessions(limits(max_sessions=10, max_sessions_per_client=2))
        drafter = FakeDrafter()
        mine = [table.open("me", drafter, "compatible", 4) for _ in range(2)]
        with pytest.raises(SessionLimitError, match="this client holds its maximum of 2 sessions; close one first"):
            table.open("me", drafter, "compatible", 4)
        other = table.open("other", drafter, "compatible", 4)  # another client is not held back
        assert (table.of_client("me"), table.of_client("other"), table.active) == (2, 1, 3)
        mine[0].close()
        table.open("me", drafter, "compatible", 4)
        for session in (mine[1], other):
            session.close()
        assert table.of_client("other") == 0 and table.active == 1

    run(main)


def test_the_per_client_quota_defaults_to_max_sessions() -> None:
    assert limits(max_sessions=7).per_client == 7
    assert limits(max_sessions=7, max_sessions_per_client=3).per_client == 3


def test_the_rules_import_no_grpc() -> None:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sessions_module))
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if "grpc" in m or "_proto" in m}


# --------------------------------------------------------------------------- steps and the sequence


def test_a_session_keeps_its_sequence_and_counts_only_new_tokens() -> None:
    async def main() -> None:
        drafter = FakeDrafter()
        table = Sessions(limits())
        with table.open("c", drafter, "compatible", 3) as session:
            first = await session.step(tokens(1, 2, 3))
            assert first.tokens.tolist() == [3, 3, 3] and first.parents is None and first.sequence_length == 3
            second = await session.step(tokens(4, 5), n_draft=2)
            assert second.tokens.tolist() == [5, 5] and second.sequence_length == 5
            assert session.tokens.tolist() == [1, 2, 3, 4, 5]
            empty = await session.step(tokens())  # a step with no new tokens drafts again
            assert empty.sequence_length == 5
            assert [t for _, t, _ in drafter.accepted] == [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]
            assert {seq for seq, _, _ in drafter.accepted} == {session.id}

    run(main)


def test_the_sequence_grows_past_its_first_buffer() -> None:
    async def main() -> None:
        table = Sessions(limits(max_step_tokens=300, max_session_tokens=1000))
        with table.open("c", FakeDrafter(), "compatible", 1) as session:
            for k in range(3):
                await session.step(np.full(300, k, dtype=np.int32))
            assert session.length == 900
            assert session.tokens.tolist() == [0] * 300 + [1] * 300 + [2] * 300

    run(main)


def test_step_and_session_limits() -> None:
    async def main() -> None:
        table = Sessions(limits(max_step_tokens=4, max_session_tokens=6))
        with table.open("c", FakeDrafter(), "compatible", 2) as session:
            with pytest.raises(SessionLimitError, match="a step carries at most 4 tokens, got 5"):
                await session.step(tokens(1, 2, 3, 4, 5))
            await session.step(tokens(1, 2, 3, 4))
            with pytest.raises(SessionLimitError, match="a session's sequence holds at most 6 tokens"):
                await session.step(tokens(1, 2, 3))
            assert session.length == 4  # a refused step adds nothing
            await session.step(tokens(5, 6))
            assert session.length == 6

    run(main)


def test_a_refused_step_does_not_grow_the_sequence() -> None:
    async def main() -> None:
        table = Sessions(limits())
        with table.open("c", FakeDrafter(), "compatible", 2) as session:
            await session.step(tokens(1, 2))
            with pytest.raises(InvalidArgumentError, match="vocabulary"):
                await session.step(tokens(3, VOCAB))
            assert session.tokens.tolist() == [1, 2]
            with pytest.raises(InvalidArgumentError, match="step.n_draft must be in 1..[0-9]+, got 1000"):
                await session.step(tokens(3), n_draft=1000)
            assert session.length == 2

    run(main)


def test_draft_trees_need_match_mode() -> None:
    async def main() -> None:
        table = Sessions(limits())
        with table.open("c", FakeDrafter(), "compatible", 2) as chain:
            with pytest.raises(InvalidArgumentError, match="needs a session opened with DRAFT_MODE_MATCH"):
                await chain.step(tokens(1), tree_budget=4)
        with table.open("c", FakeDrafter(), "match", 2) as match:
            tree = await match.step(tokens(1, 2), tree_budget=4)
            assert tree.tokens.tolist() == [0, 1, 2, 3] and tree.parents is not None and len(tree.parents) == 4
            with pytest.raises(InvalidArgumentError, match="step.tree_budget"):
                await match.step(tokens(3), tree_budget=10_000)

    run(main)


def test_a_big_step_is_counted_off_the_event_loop() -> None:
    async def main() -> None:
        drafter = FakeDrafter()
        n = INLINE_ACCEPT_TOKENS + 1
        table = Sessions(limits(max_step_tokens=n, max_session_tokens=2 * n, max_draft_tokens=n))
        loop_thread = threading.current_thread().name
        with table.open("c", drafter, "compatible", 2) as session:
            await session.step(tokens(1, 2))
            await session.step(np.ones(n, dtype=np.int32))
        await table.draft_once(drafter, np.ones(n, dtype=np.int32), 2, VOCAB)
        threads = [name for _, _, name in drafter.accepted]
        assert threads[0] == loop_thread and threads[1] != loop_thread and threads[2] != loop_thread

    run(main)


def test_draft_once_uses_a_throwaway_sequence() -> None:
    async def main() -> None:
        drafter = FakeDrafter()
        table = Sessions(limits(max_draft_tokens=4))
        assert (await table.draft_once(drafter, tokens(7, 8), 3, VOCAB)).tolist() == [8, 8, 8]
        (seq, _, _), = drafter.accepted
        assert drafter.resets == [seq] and table.active == 0
        with pytest.raises(SessionLimitError, match="Draft takes at most 4 tokens, got 5; send the tail"):
            await table.draft_once(drafter, tokens(1, 2, 3, 4, 5), 3, VOCAB)
        with pytest.raises(InvalidArgumentError, match="token 100 at position 1 is outside the vocabulary"):
            await table.draft_once(drafter, tokens(1, VOCAB), 3, VOCAB)
        assert len(drafter.resets) == 1  # refused before any sequence was made

    run(main)


def test_a_session_drafts_what_a_local_drafter_drafts() -> None:
    async def main() -> None:
        local = Drafter(fingerprint=FP, vocab_size=VOCAB)
        remote = Drafter(fingerprint=FP, vocab_size=VOCAB)
        text = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2], dtype=np.int32)
        with Sessions(limits()).open("c", remote, "compatible", 4) as session:
            for end in range(4, len(text) + 1, 3):
                step = await session.step(text[session.length:end])
                local.accept(0, text[:end])
                assert step.tokens.tolist() == local.draft(0, text[:end], 4).tolist()

    run(main)


# --------------------------------------------------------------------------- idle timer and eviction


def test_an_idle_session_is_evicted_and_frees_its_slot() -> None:
    async def main() -> None:
        drafter = FakeDrafter()
        table = Sessions(limits(max_sessions=1, idle_timeout=0.05))
        requests = Requests()
        with table.open("c", drafter, "compatible", 2) as session:
            requests.queue.put_nowait("step")
            assert await session.receive(requests) == "step"  # arrived in time
            with pytest.raises(SessionEvictedError, match="session idle for more than 0.05 s; open a new session") as caught:
                await session.receive(requests)
            assert caught.value.retriable
            assert table.active == 1  # evicted, not yet closed
        assert table.active == 0 and drafter.resets == [session.id]
        table.open("c", drafter, "compatible", 2).close()  # its slot is free again
        await asyncio.sleep(0.1)  # the timer is disarmed: nothing cancels this task later

    run(main)


def test_the_timer_restarts_with_every_request() -> None:
    async def main() -> None:
        table = Sessions(limits(idle_timeout=1.5))
        requests = Requests()

        async def feed() -> None:
            for _ in range(4):
                # Each wait is 1 s under the timeout (a loaded machine's late wake-ups fit in it), their sum is not.
                await asyncio.sleep(0.5)
                requests.queue.put_nowait("step")
            requests.queue.put_nowait(None)

        feeder = asyncio.create_task(feed())
        with table.open("c", FakeDrafter(), "compatible", 2) as session:
            got = [await session.receive(requests) for _ in range(5)]
        await feeder
        assert got == ["step"] * 4 + [None]

    run(main)


def test_a_cancellation_from_elsewhere_is_not_an_eviction() -> None:
    async def main() -> None:
        table = Sessions(limits(idle_timeout=30))
        requests = Requests()

        async def waiting() -> object:
            with table.open("c", FakeDrafter(), "compatible", 2) as session:
                return await session.receive(requests)

        task = asyncio.create_task(waiting())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert table.active == 0

    run(main)


def test_the_wait_for_the_first_request_is_timed_too() -> None:
    async def main() -> None:
        table = Sessions(limits(idle_timeout=0.05))
        requests = Requests()
        with pytest.raises(SessionEvictedError):
            await table.idle_timer().next(requests)
        requests.queue.put_nowait(None)
        assert await table.idle_timer().next(requests) is None  # the stream ended before opening
        assert table.active == 0

    run(main)
