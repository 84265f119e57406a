"""The settings of an `NgramClient`: where it connects, what it mirrors, its buffers, intervals and timeouts."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.retry import Backoff

__all__ = ["ClientConfig", "HasTokenizer"]


class HasTokenizer(Protocol):
    @property
    def fingerprint(self) -> bytes: ...

    @property
    def vocab_size(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Settings of an `NgramClient` (every one has a default except where it connects and what it mirrors).

    Attributes:
        addresses: service addresses ``host:port``, tried in order; UNAVAILABLE moves to the next.
        namespace: the namespace drafted from and pushed to.
        fingerprint, vocab_size: the client's tokenizer (must be the namespace's).
        cache_dir: where generation files are kept (``<cache_dir>/<namespace>/``), shared by a node.
        token: a bearer token, or None.
        tls_ca: PEM file (or bytes) of the CA certificates to trust: connect with TLS. None
            (default): plaintext, for a service on loopback or a private network.
        tls_cert, tls_key: PEM files (or bytes) of a client certificate and its key, for a
            service that requires mutual TLS (with tls_ca).
        mirror: what the dynamic mirror holds: ``"draft"`` (default) the service's draft view,
            only what can change a draft, bounded in rows whatever the fleet's size; ``"full"``
            every count of the store (traffic and memory grow with the fleet).
        pull_interval: seconds from a mirror pull's answer to the next pull (<= 1). The draft view
            is followed on one Pull stream instead: the service sends each change of the view at
            least this long after the one before (the changes between go as one batch).
        push_interval: seconds between two drains of the drafter's deltas.
        max_unacked: most push batches in flight (capped by the server's dedup window).
        max_batch_rows: most rows a push (capped by the server's limit).
        max_pending_rows: rows buffered for pushing; above it: aggregate, then drop the oldest.
        keep_generations: installed generations kept besides the current one.
        connect_timeout: how long the constructor tries the addresses for a first answer.
        ready_timeout: how long the constructor waits for the first sync (download included).
        close_timeout: how long `close` spends flushing pushes.
        rpc_timeout: deadline of a unary call (pushes, List, GetNamespace).
        failover_timeout: with several addresses, seconds a replica may go without answering its
            health check SERVING (hung, stopped, NOT_SERVING) before the client moves to the next.
            The check runs every second (at most `failover_timeout` / 3), skipped while a push was
            acknowledged on the channel within that interval (a replica that takes a push and stores
            it is serving; a busy client then makes no check).
        backoff: the retry policy while calls fail retriably.
        mode: the drafter's mode, ``"compatible"`` (default: llama.cpp's drafts) or ``"match"``
            (longest matches over the sequence, earlier sequences and the static generation's
            corpus index; also ``drafter().draft_tree``).
        drafter_options: more keyword arguments of the `Drafter` (max_sequences, idle_ttl, ...;
            in match mode ``match_params={"history_tokens": N}`` bounds the match history, the
            fleet history's included).
        history: share the fleet history (docs/architecture.md, "The fleet history"): publish
            what the drafter accepts and append what the rest of the fleet accepts to its match
            history. None (default): on in match mode, off in compatible mode (which has no match
            history: asking for it there is an error).
        history_push_interval: seconds between two drains of the drafter's accepted tokens.
        history_max_pending_tokens: tokens buffered for publishing; beyond, the oldest are dropped.
        history_max_bytes_per_s: the mirror's budget, bytes per second pulled on average (0: unlimited).
        history_pull_records: most records of one PullHistory of the mirror (1..65536; the server may
            answer fewer: its byte bound).
        history_groups_per_pull: most live groups (this client's sequences' groups, the most recently
            used first) whose records the mirror pulls before the namespace's tail while the tail is
            behind (0..64; 0: the tail alone).
    """

    addresses: tuple[str, ...]
    namespace: str
    fingerprint: bytes
    vocab_size: int
    cache_dir: str
    token: str | None = None
    tls_ca: str | bytes | None = None
    tls_cert: str | bytes | None = None
    tls_key: str | bytes | None = None
    mirror: str = "draft"
    pull_interval: float = 0.5
    push_interval: float = 0.1
    max_unacked: int = 4
    max_batch_rows: int = 65_536
    max_pending_rows: int = 1_000_000
    keep_generations: int = 2
    connect_timeout: float = 10.0
    ready_timeout: float = 60.0
    close_timeout: float = 10.0
    rpc_timeout: float = 10.0
    failover_timeout: float = 5.0
    backoff: Backoff = dataclasses.field(default_factory=Backoff)
    mode: str = "compatible"
    drafter_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    history: bool | None = None
    history_push_interval: float = 0.05
    history_max_pending_tokens: int = 1 << 18
    history_max_bytes_per_s: int = 0
    history_pull_records: int = 1024
    history_groups_per_pull: int = 8

    def __post_init__(self) -> None:
        if self.mode not in ("compatible", "match"):
            raise InvalidArgumentError(f"mode must be 'compatible' or 'match', got {self.mode!r}")
        if self.history is None:
            object.__setattr__(self, "history", self.mode == "match")
        elif self.history and self.mode != "match":
            raise InvalidArgumentError("history=True needs mode='match': the fleet history feeds the match mode's "
                                       "history of earlier sequences, which the compatible mode does not have")
        if not 0.001 <= self.history_push_interval <= 60:
            raise InvalidArgumentError(f"history_push_interval must be in 0.001..60 seconds, got "
                                       f"{self.history_push_interval}")
        if not isinstance(self.history_max_pending_tokens, int) or self.history_max_pending_tokens < 1:
            raise InvalidArgumentError(f"history_max_pending_tokens must be an integer >= 1, got "
                                       f"{self.history_max_pending_tokens!r}")
        if not isinstance(self.history_max_bytes_per_s, int) or self.history_max_bytes_per_s < 0:
            raise InvalidArgumentError(f"history_max_bytes_per_s must be an integer >= 0 (0: unlimited), got "
                                       f"{self.history_max_bytes_per_s!r}")
        if not isinstance(self.history_pull_records, int) or not 1 <= self.history_pull_records <= 65536:
            raise InvalidArgumentError(f"history_pull_records must be an integer in 1..65536, got "
                                       f"{self.history_pull_records!r}")
        if not isinstance(self.history_groups_per_pull, int) or not 0 <= self.history_groups_per_pull <= 64:
            raise InvalidArgumentError(f"history_groups_per_pull must be an integer in 0..64 (0: no group pulls), got "
                                       f"{self.history_groups_per_pull!r}")
        if (self.tls_cert is None) != (self.tls_key is None) or (self.tls_cert is not None and self.tls_ca is None):
            raise InvalidArgumentError("tls_cert and tls_key go together, and with tls_ca")
        if not 0.1 <= self.failover_timeout <= 3600:
            raise InvalidArgumentError(f"failover_timeout must be in 0.1..3600 seconds, got {self.failover_timeout}")
        if self.mirror not in ("draft", "full"):
            raise InvalidArgumentError(f"mirror must be 'draft' or 'full', got {self.mirror!r}")
