"""Remote drafting sessions: admission (overall and per client), the idle timer, and each session's sequence and steps over a drafter.

The rules of docs/protocol.md's Drafting.Session, as plain objects: `Sessions` admits a
session while fewer than ``max_sessions`` are open in all and fewer than
``max_sessions_per_client`` for its client, and hands out sequence ids; a `Session` keeps
its sequence (only the new tokens of a step arrive), checks each step against the step and
session limits, counts the new tokens into its drafter and drafts; an `IdleTimer` evicts a
session that waits longer than ``idle_timeout`` for its next request. Closing a session
frees its slot and its context table in the drafter.

Nothing here knows gRPC: the Drafting servicer turns messages into these calls, and
`SessionLimitError` / `SessionEvictedError` into RESOURCE_EXHAUSTED / ABORTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import MAX_DRAFT
from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "INLINE_ACCEPT_TOKENS",
    "IdleTimer",
    "SequenceDrafter",
    "Session",
    "SessionEvictedError",
    "SessionLimitError",
    "SessionLimits",
    "Sessions",
    "StepDraft",
    "check_n_draft",
    "check_vocab",
]

INLINE_ACCEPT_TOKENS: Final = 4096
"""Accepting more new tokens than this at once runs in a thread, off the event loop."""

_R = TypeVar("_R")


class SessionLimitError(NgramCacheError):
    """A session or a request over one of the server's limits (on the wire: RESOURCE_EXHAUSTED, reason LIMIT)."""

    retriable = False


class SessionEvictedError(NgramCacheError):
    """A session waited longer than the idle timeout for its next request and ended (on the wire: ABORTED,
    reason SESSION_EVICTED); a new session with the whole sequence may follow."""

    retriable = True


class SequenceDrafter(Protocol):
    """What a session drafts with: the namespace's `Drafter` (one context table per sequence id)."""

    def accept(self, seq: int, tokens: NDArray[np.int32]) -> None: ...

    def draft(self, seq: int, tokens: NDArray[np.int32], n_draft: int = ...) -> NDArray[np.int32]: ...

    def draft_tree(self, seq: int, tokens: NDArray[np.int32],
                   budget: int = ...) -> tuple[NDArray[np.int32], NDArray[np.int32]]: ...

    def reset(self, seq: int) -> bool: ...


def check_n_draft(n_draft: int, what: str) -> int:
    """Return ``n_draft`` if it is in 1..MAX_DRAFT, else raise InvalidArgumentError naming the field ``what``."""
    if not 1 <= n_draft <= MAX_DRAFT:
        raise InvalidArgumentError(f"{what} must be in 1..{MAX_DRAFT}, got {n_draft}")
    return n_draft


def check_vocab(tokens: NDArray[np.int32], vocab_size: int) -> None:
    """Raise InvalidArgumentError naming the first token outside [0, vocab_size)."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
        raise InvalidArgumentError(f"token {int(tokens[bad])} at position {bad} is outside the vocabulary [0, {vocab_size})")


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """The server's limits on sessions and drafts (docs/protocol.md).

    Attributes:
        max_sessions: sessions open at once over all namespaces.
        idle_timeout: seconds a session may wait for its next request.
        max_session_tokens: most tokens of a session's sequence.
        max_step_tokens: most new tokens of one step.
        max_draft_tokens: most tokens of a one-shot draft.
        max_sessions_per_client: sessions open at once per client (None: ``max_sessions``).
    """

    max_sessions: int
    idle_timeout: float
    max_session_tokens: int
    max_step_tokens: int
    max_draft_tokens: int
    max_sessions_per_client: int | None = None

    @property
    def per_client(self) -> int:
        """The per-client limit applied."""
        return self.max_sessions_per_client or self.max_sessions


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise comparison of the arrays
class StepDraft:
    """What one step of a session answers.

    Attributes:
        tokens: the draft (a chain, or a tree's nodes in order).
        parents: for a tree, each node's parent index (-1: the root's child); None for a chain.
        sequence_length: tokens in the session's sequence after the step.
    """

    tokens: NDArray[np.int32]
    parents: NDArray[np.int32] | None
    sequence_length: int


async def _accept(drafter: SequenceDrafter, seq: int, tokens: NDArray[np.int32], new: int) -> None:
    # Counting many tokens takes long enough to stall every other call on the loop.
    if new > INLINE_ACCEPT_TOKENS:
        await asyncio.to_thread(drafter.accept, seq, tokens)
    else:
        drafter.accept(seq, tokens)


class IdleTimer:
    """Ends a wait for the next request after ``timeout`` seconds with `SessionEvictedError`.

    Make it in the task that waits (it cancels that task). One timer handle per wait:
    asyncio.wait_for would start a task per message, which costs more than the rest of a step.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def _fire(self) -> None:
        self.fired = True
        if self._task is not None:
            self._task.cancel()

    async def next(self, requests: AsyncIterator[_R]) -> _R | None:
        """The next request, or None when the stream ended.

        Raises:
            SessionEvictedError: none arrived within the timeout.
        """
        self._handle = self._loop.call_later(self.timeout, self._fire)
        try:
            return await requests.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if self.fired:
                task = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()  # our own timer cancelled it: the call goes on to end evicted
                raise SessionEvictedError(f"session idle for more than {self.timeout:g} s; "
                                          "open a new session with the whole sequence") from None
            raise
        finally:
            self._handle.cancel()
            self._handle = None


class Session:
    """One open session: its id, its client, its sequence and its drafter. Made by `Sessions.open`.

    Thread-safety: not thread-safe; one task (the call's) uses it. Close it (or use it as a
    context manager) when the call ends, however it ends.
    """

    def __init__(self, sessions: Sessions, session_id: int, client: str, drafter: SequenceDrafter, mode: str,
                 n_draft: int) -> None:
        self.id = session_id
        self.client = client
        self.mode = mode
        self.n_draft = n_draft  # the default of a step that asks for none
        self._sessions = sessions
        self._limits = sessions.limits
        self._drafter = drafter
        self._seq = np.empty(256, dtype=np.int32)
        self._n = 0  # tokens of the sequence counted into the drafter
        self._idle = IdleTimer(self._limits.idle_timeout)
        self._closed = False

    @property
    def length(self) -> int:
        """Tokens in the session's sequence."""
        return self._n

    @property
    def tokens(self) -> NDArray[np.int32]:
        """The session's sequence (a view: valid until the next step)."""
        return self._seq[:self._n]

    async def receive(self, requests: AsyncIterator[_R]) -> _R | None:
        """The session's next request, or None when the stream ended.

        Raises:
            SessionEvictedError: none arrived within the idle timeout.
        """
        return await self._idle.next(requests)

    async def step(self, new: NDArray[np.int32], *, n_draft: int = 0, tree_budget: int = 0) -> StepDraft:
        """Append ``new`` to the sequence, count it into the drafter and draft.

        Args:
            new: the step's new tokens.
            n_draft: tokens to draft (0: the session's default).
            tree_budget: nodes of a draft tree (0: a chain); match mode only.

        Raises:
            SessionLimitError: the step or the sequence would be over its limit.
            InvalidArgumentError: a bad n_draft or tree_budget, or a token outside the
                vocabulary (nothing counted; the sequence does not grow).
        """
        limits = self._limits
        if len(new) > limits.max_step_tokens:
            raise SessionLimitError(f"a step carries at most {limits.max_step_tokens} tokens, got {len(new)}")
        end = self._n + len(new)
        if end > limits.max_session_tokens:
            raise SessionLimitError(f"a session's sequence holds at most {limits.max_session_tokens} tokens")
        n_draft = check_n_draft(n_draft, "step.n_draft") if n_draft else self.n_draft
        if tree_budget:
            check_n_draft(tree_budget, "step.tree_budget")
            if self.mode != "match":
                raise InvalidArgumentError("step.tree_budget needs a session opened with DRAFT_MODE_MATCH")
        if end > len(self._seq):
            self._seq = np.resize(self._seq, max(2 * len(self._seq), end))
        self._seq[self._n:end] = new
        tokens = self._seq[:end]
        # accept() checks every new token against the vocabulary before counting any;
        # the sequence grows only once it has succeeded.
        await _accept(self._drafter, self.id, tokens, len(new))
        self._n = end
        if tree_budget:
            draft, parents = self._drafter.draft_tree(self.id, tokens, tree_budget)
            return StepDraft(draft, parents, end)
        return StepDraft(self._drafter.draft(self.id, tokens, n_draft), None, end)

    def close(self) -> None:
        """Free the session's slot and its context table (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._sessions._release(self.client)
        self._drafter.reset(self.id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sessions:
    """The open sessions of a server: admission against the limits, and the sequence ids of drafts.

    Thread-safety: not thread-safe; use it from the server's event loop.

    Args:
        limits: the server's session limits.
    """

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        self._ids = itertools.count(1)
        self._active = 0
        self._per_client: dict[str, int] = {}

    @property
    def active(self) -> int:
        """Sessions open now."""
        return self._active

    def of_client(self, client: str) -> int:
        """Sessions ``client`` has open now."""
        return self._per_client.get(client, 0)

    def idle_timer(self) -> IdleTimer:
        """A timer for the wait before a session is open (its first request); make it in the waiting task."""
        return IdleTimer(self.limits.idle_timeout)

    def open(self, client: str, drafter: SequenceDrafter, mode: str, n_draft: int) -> Session:
        """Admit a session of ``client`` drafting with ``drafter`` in ``mode``, ``n_draft`` tokens by default.

        Raises:
            SessionLimitError: ``max_sessions`` are open, or ``client`` holds its own maximum.
        """
        limits = self.limits
        if self._active >= limits.max_sessions:
            raise SessionLimitError(f"the server holds its maximum of {limits.max_sessions} sessions; "
                                    "retry later or use Draft")
        if self.of_client(client) >= limits.per_client:
            raise SessionLimitError(f"this client holds its maximum of {limits.per_client} sessions; close one first")
        self._per_client[client] = self.of_client(client) + 1
        self._active += 1
        return Session(self, next(self._ids), client, drafter, mode, n_draft)

    def _release(self, client: str) -> None:
        self._active -= 1
        left = self._per_client[client] - 1
        if left:
            self._per_client[client] = left
        else:
            del self._per_client[client]

    async def draft_once(self, drafter: SequenceDrafter, tokens: NDArray[np.int32], n_draft: int,
                         vocab_size: int) -> NDArray[np.int32]:
        """A one-shot draft after ``tokens``, over a throwaway sequence whose context table is freed after.

        Raises:
            SessionLimitError: more than ``max_draft_tokens`` tokens.
            InvalidArgumentError: a token outside [0, vocab_size).
        """
        if len(tokens) > self.limits.max_draft_tokens:
            raise SessionLimitError(f"Draft takes at most {self.limits.max_draft_tokens} tokens, got {len(tokens)}; "
                                    "send the tail the draft depends on")
        check_vocab(tokens, vocab_size)
        seq = next(self._ids)
        try:
            await _accept(drafter, seq, tokens, len(tokens))
            return drafter.draft(seq, tokens, n_draft)
        finally:
            drafter.reset(seq)
