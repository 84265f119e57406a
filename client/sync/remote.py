"""RemoteDrafter: drafting through a service's Session RPC, with the local Drafter's interface.

For thin clients that keep no tables of their own: each sequence is one Session stream, and
only the tokens appended since the previous call cross the wire; the service keeps the
sequence's context table and drafts from the namespace's dynamic mirror and static
generation. A sequence whose session ended (evicted while idle, a service restart) is
reopened with its whole sequence on the next call, transparently.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import MAX_DRAFT
from ngramcache.client._proto.v1 import drafting_pb2, drafting_pb2_grpc
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.retry import retry_sync
from ngramcache.client.sync.config import HasTokenizer
from ngramcache.client.wire.address import check_address
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes
from ngramcache.client.wire.transport import (
    auth_metadata,
    channel_credentials,
    error_from_rpc,
    open_channel,
    read_pem,
    unreachable_error,
)

_CLOSE = object()
_MODES = {"compatible": drafting_pb2.DRAFT_MODE_COMPATIBLE, "match": drafting_pb2.DRAFT_MODE_MATCH}


def _reopen(e: BaseException, attempt: int) -> float | None:
    """A session evicted (ABORTED) or a stream that ended without a status is reopened at once with the whole sequence."""
    evicted = isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.ABORTED
    return 0.0 if evicted or isinstance(e, StopIteration) else None


class _Reply(NamedTuple):
    tokens: NDArray[np.int32]
    parents: bytes  # int32 little-endian, for a tree; empty for a line


class _Session:
    """One Session stream: requests go through a queue, replies are read in order."""

    def __init__(self, stub: drafting_pb2_grpc.DraftingStub, open_request: drafting_pb2.SessionRequest,
                 metadata: tuple[tuple[str, str], ...], timeout: float | None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(open_request)
        self._replies: Iterator[drafting_pb2.SessionResponse] = stub.Session(
            iter(self._queue.get, _CLOSE), metadata=metadata, timeout=timeout)
        self.generation = next(self._replies).opened.generation
        self.sent = 0  # tokens of the sequence the service holds

    def step(self, tokens: NDArray[np.int32], n_draft: int, tree_budget: int = 0) -> drafting_pb2.SessionDraft:
        self._queue.put(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(
            tokens=tokens_to_bytes(tokens), n_draft=n_draft, tree_budget=tree_budget)))
        reply = next(self._replies).draft
        self.generation = reply.generation
        return reply

    def close(self) -> None:
        self._queue.put(_CLOSE)
        try:
            for _ in self._replies:  # the service answers the half-close with OK
                pass
        except grpc.RpcError:
            pass


class RemoteDrafter:
    """`draft`, `accept` and `reset` as `ngramcache.Drafter` has them, answered by a service.

    Thread-safety: calls for different sequences may run from different threads; calls for
    one sequence are serialized by its lock. A context manager; `close()` ends every session.

    Args:
        address: ``host:port`` of a service.
        namespace: the namespace to draft from.
        tokenizer: a `Tokenizer` (anything with ``fingerprint`` and ``vocab_size``) or a
            ``(fingerprint, vocab_size)`` pair; must be the namespace's.
        token: a bearer token, or None.
        timeout: seconds a session may last at most (None: no deadline).
        channel: an existing channel to use instead of opening one to `address`.
        tls_ca, tls_cert, tls_key: TLS as for `NgramClient` (PEM paths or bytes; None: plaintext).
        mode: "compatible" (llama.cpp's drafts) or "match" (longest-match drafts, and
            `draft_tree`), as `ngramcache.Drafter` has them; the service must list the
            capability "drafting.match_mode" (an older one drafts compatibly).

    Raises (from the calls):
        TokenizerMismatchError, NamespaceNotFoundError, BackendUnavailableError (retriable),
        InvalidArgumentError: mapped from the service's status in one place (`error_from_rpc`).
        ServiceUnreachableError: the service could not be reached, with the cause (refused, TLS mismatch, ...).
    Raises (the constructor): InvalidArgumentError: ``address`` is not ``HOST:PORT`` (a URL, no port).
    """

    def __init__(self, address: str, namespace: str, tokenizer: HasTokenizer | tuple[bytes, int], *,
                 token: str | None = None, timeout: float | None = None, channel: grpc.Channel | None = None,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, mode: str = "compatible") -> None:
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be 'compatible' or 'match', got {mode!r}")
        self._mode = mode
        if isinstance(tokenizer, tuple):
            self._fingerprint, self._vocab_size = bytes(tokenizer[0]), int(tokenizer[1])
        else:
            self._fingerprint, self._vocab_size = bytes(tokenizer.fingerprint), int(tokenizer.vocab_size)
        self._namespace = namespace
        self._own_channel = channel is None
        self._address = address if channel is not None else check_address(address)
        self._tls = (read_pem(tls_ca, "tls_ca"), tls_cert, tls_key)
        self._channel = channel if channel is not None else open_channel(
            address, channel_credentials(self._tls[0], tls_cert, tls_key))
        self._stub = drafting_pb2_grpc.DraftingStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = auth_metadata(token)
        self._timeout = timeout
        self._sessions: dict[int, _Session] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        """The static generation the latest draft of any sequence used (0: none)."""
        return max((s.generation for s in self._sessions.values()), default=0)

    def _seq_lock(self, seq: int) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(seq, threading.Lock())

    def _open(self, n_draft: int) -> _Session:
        request = drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace=self._namespace, tokenizer_fingerprint=self._fingerprint, vocab_size=self._vocab_size,
            n_draft=n_draft, mode=_MODES[self._mode]))
        try:
            return _Session(self._stub, request, self._metadata, self._timeout)
        except grpc.RpcError as e:
            err = error_from_rpc(e)
            if e.code() == grpc.StatusCode.UNAVAILABLE and self._own_channel:
                err = unreachable_error(self._address, *self._tls, fallback=err)  # refused, TLS mismatch, ...: which
            raise err from None

    @property
    def mode(self) -> str:
        """"compatible" or "match"."""
        return self._mode

    def draft(self, seq: int, tokens: NDArray[np.int32], n_draft: int = 8) -> NDArray[np.int32]:
        """Drafts up to `n_draft` tokens after `tokens` (the whole sequence so far, int32);
        only the tokens the service has not seen yet are sent."""
        if not 1 <= n_draft <= MAX_DRAFT:
            raise InvalidArgumentError(f"n_draft must be in 1..{MAX_DRAFT}, got {n_draft}")
        return self._step(seq, tokens, n_draft, 0).tokens

    def draft_tree(self, seq: int, tokens: NDArray[np.int32],
                   budget: int = 16) -> tuple[NDArray[np.int32], NDArray[np.int32]]:
        """A tree of at most `budget` nodes (match mode), as `Drafter.draft_tree` returns it:
        (tokens, parents), node i follows node parents[i] (-1: the sequence)."""
        if self._mode != "match":
            raise InvalidArgumentError("tree drafts need the match mode (RemoteDrafter(..., mode='match'))")
        if not 1 <= budget <= MAX_DRAFT:
            raise InvalidArgumentError(f"budget must be in 1..{MAX_DRAFT}, got {budget}")
        reply = self._step(seq, tokens, budget, budget)
        return reply.tokens, bytes_to_tokens(reply.parents).copy()

    def _step(self, seq: int, tokens: NDArray[np.int32], n_draft: int, tree_budget: int) -> _Reply:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)

        def attempt() -> _Reply:
            session = self._sessions.get(seq)
            if session is None or len(tokens) < session.sent:
                if session is not None:  # the sequence was rewound: start it again
                    session.close()
                session = self._sessions[seq] = self._open(n_draft)
            try:
                reply = session.step(tokens[session.sent:], n_draft, tree_budget)
            except (grpc.RpcError, StopIteration):
                del self._sessions[seq]
                raise
            session.sent = len(tokens)
            return _Reply(bytes_to_tokens(reply.tokens).copy(), reply.parents)

        with self._seq_lock(seq):
            try:
                return retry_sync(attempt, _reopen, errors=(grpc.RpcError, StopIteration), attempts=2)
            except grpc.RpcError as e:
                raise error_from_rpc(e) from None

    def accept(self, seq: int, tokens: NDArray[np.int32]) -> None:
        """Nothing to do locally: the next `draft` sends the tokens the service lacks."""

    def reset(self, seq: int) -> bool:
        """Ends the session of `seq`; returns whether there was one."""
        with self._seq_lock(seq):
            session = self._sessions.pop(seq, None)
        if session is not None:
            session.close()
        return session is not None

    def close(self) -> None:
        for seq in list(self._sessions):
            self.reset(seq)
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> RemoteDrafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
