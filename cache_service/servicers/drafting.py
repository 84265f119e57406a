"""The Drafting servicer: remote drafting sessions and one-shot drafts over a namespace's live state.

It translates messages to the session rules of `..sessions` and back; their errors become
statuses here (`SessionLimitError`: RESOURCE_EXHAUSTED, `SessionEvictedError`: ABORTED).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator

import grpc
from grpc import aio

from ngramcache.client._core import MAX_VOCAB
from ngramcache.client._proto.v1 import drafting_pb2, drafting_pb2_grpc
from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError, TokenizerMismatchError
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

from ..metrics import Metrics
from ..namespaces import LiveNamespace, NamespaceRegistry
from ..sessions import SessionEvictedError, SessionLimitError, SessionLimits, Sessions, check_n_draft
from ..status import SESSION_EVICTED, ServiceError, limit_exceeded


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


def _client_of(context: aio.ServicerContext) -> str:
    """Who a session belongs to, for the per-client limit: its bearer token (hashed), else its address."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            return "token:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    return "peer:" + peer.rsplit(":", 1)[0]  # ipv4:127.0.0.1:54321 -> ipv4:127.0.0.1


@contextlib.contextmanager
def _on_the_wire() -> Iterator[None]:
    """The session rules' errors as the statuses docs/protocol.md gives them."""
    try:
        yield
    except SessionLimitError as exc:
        raise limit_exceeded(str(exc)) from None
    except SessionEvictedError as exc:
        raise ServiceError(grpc.StatusCode.ABORTED, str(exc), SESSION_EVICTED) from None


class DraftingServicer(drafting_pb2_grpc.DraftingServicer):
    """Sessions keep their sequence in a `sessions.Session` and their context table in the namespace's Drafter.

    Args:
        registry: the namespaces' live state.
        max_sessions: sessions open at once over all namespaces (RESOURCE_EXHAUSTED beyond).
        idle_timeout: seconds without a step after which a session ends ABORTED.
        max_sessions_per_client: sessions open at once per client (None: max_sessions).
        max_session_tokens, max_step_tokens, max_draft_tokens: limits of docs/protocol.md.
        metrics: where to count drafts and report open sessions (None: nowhere).
    """

    def __init__(self, registry: NamespaceRegistry, *, max_sessions: int, idle_timeout: float,
                 max_sessions_per_client: int | None = None,
                 max_session_tokens: int, max_step_tokens: int, max_draft_tokens: int,
                 metrics: Metrics | None = None) -> None:
        self._registry = registry
        self.sessions = Sessions(SessionLimits(
            max_sessions=max_sessions, idle_timeout=idle_timeout, max_session_tokens=max_session_tokens,
            max_step_tokens=max_step_tokens, max_draft_tokens=max_draft_tokens,
            max_sessions_per_client=max_sessions_per_client))
        self._metrics = metrics
        if metrics is not None:
            metrics.watch_sessions(lambda: self.active_sessions)

    @property
    def active_sessions(self) -> int:
        """Sessions open now."""
        return self.sessions.active

    async def Session(self, request_iterator: AsyncIterator[drafting_pb2.SessionRequest],
                      context: aio.ServicerContext) -> AsyncIterator[drafting_pb2.SessionResponse]:
        limits = self.sessions.limits
        it = request_iterator.__aiter__()
        with _on_the_wire():
            first = await self.sessions.idle_timer().next(it)
            if first is None:
                return
            if first.WhichOneof("kind") != "open":
                raise InvalidArgumentError("the first request of a Session must be `open`")
            op = first.open
            default_n_draft = check_n_draft(op.n_draft, "open.n_draft")
            mode = _mode_of(op.mode, "open.mode")
            ns = await self._registry.get(op.namespace)
            _check_tokenizer(ns, op.tokenizer_fingerprint, op.vocab_size)
            drafter = ns.drafter_for(mode)
            with self.sessions.open(_client_of(context), drafter, mode, default_n_draft) as session:
                yield drafting_pb2.SessionResponse(opened=drafting_pb2.SessionOpened(
                    session_id=str(session.id), generation=ns.generation, max_step_tokens=limits.max_step_tokens,
                    max_session_tokens=limits.max_session_tokens, idle_timeout_ms=int(limits.idle_timeout * 1000)))
                while True:
                    req = await session.receive(it)
                    if req is None:
                        return
                    if req.WhichOneof("kind") != "step":
                        raise InvalidArgumentError("only the first request of a Session is `open`; later ones are `step`s")
                    if ns.dropped:
                        raise NamespaceNotFoundError(f"namespace {ns.info.name!r} was dropped")
                    step = await session.step(bytes_to_tokens(req.step.tokens), n_draft=req.step.n_draft,
                                              tree_budget=req.step.tree_budget)
                    if self._metrics is not None:
                        self._metrics.drafted(len(step.tokens))
                    parents = b"" if step.parents is None else tokens_to_bytes(step.parents)
                    yield drafting_pb2.SessionResponse(draft=drafting_pb2.SessionDraft(
                        tokens=tokens_to_bytes(step.tokens), generation=ns.generation,
                        sequence_length=step.sequence_length, parents=parents))

    async def Draft(self, request: drafting_pb2.DraftRequest,
                    context: aio.ServicerContext) -> drafting_pb2.DraftResponse:
        n_draft = check_n_draft(request.n_draft, "n_draft")
        mode = _mode_of(request.mode, "mode")
        ns = await self._registry.get(request.namespace)
        _check_tokenizer(ns, request.tokenizer_fingerprint, request.vocab_size)
        drafter = ns.drafter_for(mode)
        with _on_the_wire():
            draft = await self.sessions.draft_once(drafter, bytes_to_tokens(request.tokens), n_draft, ns.info.vocab_size)
        if self._metrics is not None:
            self._metrics.drafted(len(draft))
        return drafting_pb2.DraftResponse(tokens=tokens_to_bytes(draft), generation=ns.generation)
