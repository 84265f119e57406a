"""The Drafting servicer: remote drafting sessions and one-shot drafts over a namespace's live state."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterator

import grpc
import numpy as np
from grpc import aio

from ngramcache.client import MAX_DRAFT, MAX_VOCAB
from ngramcache.client._proto.codec import bytes_to_tokens, tokens_to_bytes
from ngramcache.client._proto.v1 import drafting_pb2, drafting_pb2_grpc
from ngramcache.client.errors import InvalidArgumentError, NamespaceNotFoundError, TokenizerMismatchError

from ..metrics import Metrics
from ..namespaces import LiveNamespace, NamespaceRegistry
from ..status import SESSION_EVICTED, ServiceError, limit_exceeded

# Accepting more new tokens than this at once runs in a thread, off the event loop.
_INLINE_ACCEPT_TOKENS = 4096


def _check_n_draft(n_draft: int, what: str) -> int:
    if not 1 <= n_draft <= MAX_DRAFT:
        raise InvalidArgumentError(f"{what} must be in 1..{MAX_DRAFT}, got {n_draft}")
    return n_draft


def _mode_of(mode: int, what: str) -> str:
    if mode in (drafting_pb2.DRAFT_MODE_UNSPECIFIED, drafting_pb2.DRAFT_MODE_COMPATIBLE):
        return "compatible"
    if mode == drafting_pb2.DRAFT_MODE_MATCH:
        return "match"
    raise InvalidArgumentError(f"{what} is {mode}, not a DraftMode this server knows (0, 1 or 2)")


def _check_tokenizer(ns: LiveNamespace, fingerprint: bytes, vocab_size: int) -> None:
    if len(fingerprint) != 32:
        raise InvalidArgumentError(f"tokenizer_fingerprint must be 32 bytes, got {len(fingerprint)}")
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise InvalidArgumentError(f"vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")
    if fingerprint != ns.fingerprint:
        raise TokenizerMismatchError(f"namespace {ns.info.name!r} is bound to tokenizer {ns.info.fingerprint[:16]}..., "
                                     f"not {fingerprint.hex()[:16]}...")
    if vocab_size != ns.info.vocab_size:
        raise TokenizerMismatchError(f"namespace {ns.info.name!r} has vocab_size {ns.info.vocab_size}, not {vocab_size}")


def _check_vocab(tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
        raise InvalidArgumentError(f"token {int(tokens[bad])} at position {bad} is outside the vocabulary [0, {vocab_size})")


def _client_of(context: aio.ServicerContext) -> str:
    """Who a session belongs to, for the per-client limit: its bearer token (hashed), else its address."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            return "token:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    return "peer:" + peer.rsplit(":", 1)[0]  # ipv4:127.0.0.1:54321 -> ipv4:127.0.0.1


class _IdleTimer:
    """Cancels the session's task when no request arrives for `timeout` seconds.

    One timer handle per wait (asyncio.wait_for would start a task per message, which costs
    more than the rest of a step).
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def _fire(self) -> None:
        self.fired = True
        if self._task is not None:
            self._task.cancel()

    def arm(self) -> None:
        self._handle = self._loop.call_later(self._timeout, self._fire)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class DraftingServicer(drafting_pb2_grpc.DraftingServicer):
    """Sessions keep their sequence here and their context table in the namespace's Drafter.

    Args:
        registry: the namespaces' live state.
        max_sessions: sessions open at once over all namespaces (RESOURCE_EXHAUSTED beyond).
        idle_timeout: seconds without a step after which a session ends ABORTED.
        max_session_tokens, max_step_tokens, max_draft_tokens: limits of docs/protocol.md.
        metrics: where to count drafts and report open sessions (None: nowhere).
    """

    def __init__(self, registry: NamespaceRegistry, *, max_sessions: int, idle_timeout: float,
                 max_sessions_per_client: int | None = None,
                 max_session_tokens: int, max_step_tokens: int, max_draft_tokens: int,
                 metrics: Metrics | None = None) -> None:
        self._registry = registry
        self._max_sessions = max_sessions
        self._idle_timeout = idle_timeout
        self._max_session_tokens = max_session_tokens
        self._max_step_tokens = max_step_tokens
        self._max_draft_tokens = max_draft_tokens
        self._ids = itertools.count(1)
        self.active_sessions = 0
        self._max_per_client = max_sessions_per_client or max_sessions
        self._per_client: dict[str, int] = {}
        self._metrics = metrics  # observability (issue 8)
        if metrics is not None:
            metrics.watch_sessions(lambda: self.active_sessions)

    async def _next(self, it: AsyncIterator[drafting_pb2.SessionRequest],
                    idle: _IdleTimer | None = None) -> drafting_pb2.SessionRequest | None:
        if idle is None:
            try:
                return await asyncio.wait_for(it.__anext__(), self._idle_timeout)
            except StopAsyncIteration:
                return None
            except asyncio.TimeoutError:
                raise self._evicted() from None
        idle.arm()
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if idle.fired:
                task = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()  # our own timer cancelled it: the call goes on to end ABORTED
                raise self._evicted() from None
            raise
        finally:
            idle.disarm()

    def _evicted(self) -> ServiceError:
        return ServiceError(grpc.StatusCode.ABORTED, f"session idle for more than {self._idle_timeout:g} s; "
                            "open a new session with the whole sequence", SESSION_EVICTED)

    async def Session(self, request_iterator: AsyncIterator[drafting_pb2.SessionRequest],
                      context: aio.ServicerContext) -> AsyncIterator[drafting_pb2.SessionResponse]:
        it = request_iterator.__aiter__()
        first = await self._next(it)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            raise InvalidArgumentError("the first request of a Session must be `open`")
        op = first.open
        default_n_draft = _check_n_draft(op.n_draft, "open.n_draft")
        mode = _mode_of(op.mode, "open.mode")
        ns = await self._registry.get(op.namespace)
        _check_tokenizer(ns, op.tokenizer_fingerprint, op.vocab_size)
        drafter = ns.drafter_for(mode)
        if self.active_sessions >= self._max_sessions:
            raise limit_exceeded(f"the server holds its maximum of {self._max_sessions} sessions; retry later or use Draft")
        client = _client_of(context)
        if self._per_client.get(client, 0) >= self._max_per_client:
            raise limit_exceeded(f"this client holds its maximum of {self._max_per_client} sessions; close one first")
        self._per_client[client] = self._per_client.get(client, 0) + 1
        self.active_sessions += 1
        sid = next(self._ids)
        try:
            yield drafting_pb2.SessionResponse(opened=drafting_pb2.SessionOpened(
                session_id=str(sid), generation=ns.generation, max_step_tokens=self._max_step_tokens,
                max_session_tokens=self._max_session_tokens, idle_timeout_ms=int(self._idle_timeout * 1000)))
            seq = np.empty(256, dtype=np.int32)
            n = 0
            idle = _IdleTimer(self._idle_timeout)
            while True:
                req = await self._next(it, idle)
                if req is None:
                    return
                if req.WhichOneof("kind") != "step":
                    raise InvalidArgumentError("only the first request of a Session is `open`; later ones are `step`s")
                if ns.dropped:
                    raise NamespaceNotFoundError(f"namespace {ns.info.name!r} was dropped")
                new = bytes_to_tokens(req.step.tokens)
                if len(new) > self._max_step_tokens:
                    raise limit_exceeded(f"a step carries at most {self._max_step_tokens} tokens, got {len(new)}")
                if n + len(new) > self._max_session_tokens:
                    raise limit_exceeded(f"a session's sequence holds at most {self._max_session_tokens} tokens")
                n_draft = _check_n_draft(req.step.n_draft, "step.n_draft") if req.step.n_draft else default_n_draft
                tree_budget = req.step.tree_budget
                if tree_budget:
                    _check_n_draft(tree_budget, "step.tree_budget")
                    if mode != "match":
                        raise InvalidArgumentError("step.tree_budget needs a session opened with DRAFT_MODE_MATCH")
                if n + len(new) > len(seq):
                    seq = np.resize(seq, max(2 * len(seq), n + len(new)))
                seq[n:n + len(new)] = new
                tokens = seq[:n + len(new)]
                # accept() checks every new token against the vocabulary before counting any;
                # the sequence grows only once it has succeeded.
                if len(new) > _INLINE_ACCEPT_TOKENS:
                    await asyncio.to_thread(drafter.accept, sid, tokens)
                else:
                    drafter.accept(sid, tokens)
                n += len(new)
                parents = b""
                if tree_budget:
                    draft, tree_parents = drafter.draft_tree(sid, tokens, tree_budget)
                    parents = tokens_to_bytes(tree_parents)
                else:
                    draft = drafter.draft(sid, tokens, n_draft)
                if self._metrics is not None:
                    self._metrics.drafted(len(draft))
                yield drafting_pb2.SessionResponse(draft=drafting_pb2.SessionDraft(
                    tokens=tokens_to_bytes(draft), generation=ns.generation, sequence_length=n, parents=parents))
        finally:
            self.active_sessions -= 1
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]
            drafter.reset(sid)

    async def Draft(self, request: drafting_pb2.DraftRequest,
                    context: aio.ServicerContext) -> drafting_pb2.DraftResponse:
        n_draft = _check_n_draft(request.n_draft, "n_draft")
        mode = _mode_of(request.mode, "mode")
        ns = await self._registry.get(request.namespace)
        _check_tokenizer(ns, request.tokenizer_fingerprint, request.vocab_size)
        drafter = ns.drafter_for(mode)
        tokens = bytes_to_tokens(request.tokens)
        if len(tokens) > self._max_draft_tokens:
            raise limit_exceeded(f"Draft takes at most {self._max_draft_tokens} tokens, got {len(tokens)}; "
                                 "send the tail the draft depends on")
        _check_vocab(tokens, ns.info.vocab_size)
        sid = next(self._ids)  # a throwaway sequence: its context table is freed below
        try:
            if len(tokens) > _INLINE_ACCEPT_TOKENS:
                await asyncio.to_thread(drafter.accept, sid, tokens)
            else:
                drafter.accept(sid, tokens)
            draft = drafter.draft(sid, tokens, n_draft)
        finally:
            drafter.reset(sid)
        if self._metrics is not None:
            self._metrics.drafted(len(draft))
        return drafting_pb2.DraftResponse(tokens=tokens_to_bytes(draft), generation=ns.generation)
