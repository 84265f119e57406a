"""NgramClient: a local Drafter kept in sync with the fleet by one background thread (static generations, mirror, pushes).

One implementation: a daemon thread runs one asyncio loop (grpc.aio) that does every
network call; the public API is synchronous, and ``draft``/``accept`` on the drafter it
hands out never wait on the network. What a crash can lose: the deltas accepted since
the last drain (at most ``push_interval``) plus the pending buffer and the unacknowledged
batches (at most ``max_pending_rows + max_unacked * max_batch_rows`` rows); an
acknowledged batch is counted exactly once, whatever retries happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np
from grpc import aio
from numpy.typing import NDArray

from ngramcache.client._core import CountTable, Drafter, StaticCache
from ngramcache.client._proto.codec import bytes_to_count_rows, delta_rows_to_bytes
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.errors import (
    BackendUnavailableError,
    BatchTooOldError,
    CacheFormatError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    NgramCacheError,
    ResyncRequiredError,
    TokenizerMismatchError,
)
from ngramcache.client.rows import COUNT, DELTA_DTYPE, KEY_WIDTH, ROW_WIDTH
from ngramcache.client.static_files import GenerationFiles

__all__ = ["Backoff", "ClientConfig", "NgramClient", "aggregate_rows", "channel_credentials", "error_from_rpc"]

log = logging.getLogger(__name__)

T = TypeVar("T")

REASON_KEY = "ngc-error-reason"
_INT32_MAX = 2**31 - 1


class HasTokenizer(Protocol):
    @property
    def fingerprint(self) -> bytes: ...

    @property
    def vocab_size(self) -> int: ...


# --- errors: the client's one mapping from gRPC statuses to the library's errors -------

def _reason(err: grpc.RpcError) -> str | None:
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == REASON_KEY:
            return str(value)
    return None


def error_from_rpc(err: grpc.RpcError) -> NgramCacheError:
    """The library error for a failed call (its ``retriable`` says whether to try again).

    UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED and ABORTED are retriable
    (`BackendUnavailableError`); RESOURCE_EXHAUSTED (a server limit) is not; NOT_FOUND of a namespace is
    `NamespaceNotFoundError`; FAILED_PRECONDITION for a tokenizer `TokenizerMismatchError`;
    OUT_OF_RANGE `ResyncRequiredError`; INVALID_ARGUMENT `InvalidArgumentError` (or
    `BatchTooOldError`, `CacheFormatError` by reason); anything else a non-retriable
    `NgramCacheError`.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    reason = _reason(err)
    message = f"{code.name}: {details}" if code is not None else str(details)
    out: NgramCacheError
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.ABORTED):
        out = BackendUnavailableError(message)
    elif code == grpc.StatusCode.NOT_FOUND and reason in (None, "NAMESPACE_NOT_FOUND"):
        out = NamespaceNotFoundError(message)
    elif code == grpc.StatusCode.FAILED_PRECONDITION and reason == "TOKENIZER_MISMATCH":
        out = TokenizerMismatchError(message)
    elif code == grpc.StatusCode.OUT_OF_RANGE:
        out = ResyncRequiredError(message)
    elif code == grpc.StatusCode.INVALID_ARGUMENT and reason == "BATCH_TOO_OLD":
        out = BatchTooOldError(message)
    elif code == grpc.StatusCode.INVALID_ARGUMENT and reason == "CACHE_FORMAT":
        out = CacheFormatError(message)
    elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.FAILED_PRECONDITION):
        out = InvalidArgumentError(message)
    else:  # UNAUTHENTICATED, PERMISSION_DENIED, INTERNAL, UNKNOWN, ...
        out = NgramCacheError(message)
    out.code = code  # type: ignore[attr-defined]
    out.reason = reason  # type: ignore[attr-defined]
    return out


# --- configuration and retry policy -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt k waits uniform(0, min(cap, base * 2**k)) seconds."""

    base: float = 0.05
    cap: float = 2.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * (2 ** min(attempt, 30))))


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
        pull_interval: seconds between two mirror pulls (<= 1).
        push_interval: seconds between two drains of the drafter's deltas.
        max_unacked: most push batches in flight (capped by the server's dedup window).
        max_batch_rows: most rows a push (capped by the server's limit).
        max_pending_rows: rows buffered for pushing; above it: aggregate, then drop the oldest.
        keep_generations: installed generations kept besides the current one.
        connect_timeout: how long the constructor tries the addresses for a first answer.
        ready_timeout: how long the constructor waits for the first sync (download included).
        close_timeout: how long `close` spends flushing pushes.
        rpc_timeout: deadline of a unary call (pushes, List, GetNamespace).
        backoff: the retry policy while calls fail retriably.
        mode: the drafter's mode, ``"compatible"`` (default: llama.cpp's drafts) or ``"match"``
            (longest matches over the sequence, earlier sequences and the static generation's
            corpus index; also ``drafter().draft_tree``).
        drafter_options: more keyword arguments of the `Drafter` (max_sequences, idle_ttl, ...).
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
    backoff: Backoff = Backoff()
    mode: str = "compatible"
    drafter_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("compatible", "match"):
            raise InvalidArgumentError(f"mode must be 'compatible' or 'match', got {self.mode!r}")
        if (self.tls_cert is None) != (self.tls_key is None) or (self.tls_cert is not None and self.tls_ca is None):
            raise InvalidArgumentError("tls_cert and tls_key go together, and with tls_ca")
        if self.mirror not in ("draft", "full"):
            raise InvalidArgumentError(f"mirror must be 'draft' or 'full', got {self.mirror!r}")


def _pem(value: str | bytes | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"{what} {value}: {e.strerror}") from None


def channel_credentials(ca: str | bytes | None, cert: str | bytes | None = None,
                        key: str | bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM CA certificates ``ca`` (a path or the bytes), with a client
    certificate for mutual TLS; None (plaintext) when ``ca`` is None."""
    if ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca, "tls_ca"), private_key=_pem(key, "tls_key"),
                                        certificate_chain=_pem(cert, "tls_cert"))


def aggregate_rows(rows: NDArray[np.int32]) -> NDArray[np.int32]:
    """Sum the counts of identical (n-gram, follower) rows; counts saturate at 2^31-1."""
    if len(rows) <= 1:
        return rows
    keys, inverse = np.unique(rows[:, :KEY_WIDTH], axis=0, return_inverse=True)
    sums = np.bincount(inverse.reshape(-1), weights=rows[:, COUNT].astype(np.float64), minlength=len(keys))
    out = np.empty((len(keys), ROW_WIDTH), dtype=DELTA_DTYPE)
    out[:, :KEY_WIDTH] = keys
    out[:, COUNT] = np.minimum(sums, _INT32_MAX).astype(np.int64)
    return out


# --- the background core ----------------------------------------------------------------

@dataclasses.dataclass
class _Stats:
    generation: int = 0
    mirror_version: int | None = None
    view_id: str = ""
    mirror_last_ok: float = 0.0
    pulled_rows: int = 0
    pulled_bytes: int = 0
    resyncs: int = 0
    drained_rows: int = 0
    drained_count: int = 0
    pushed_rows: int = 0
    acked_rows: int = 0
    acked_count: int = 0
    duplicate_batches: int = 0
    dropped_rows: int = 0
    reconnects: int = 0
    downloads: int = 0
    downloaded_bytes: int = 0
    address: str = ""


class _Channel:
    """The current channel and its stubs; `epoch` counts switches."""

    def __init__(self, address: str, epoch: int, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.epoch = epoch
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = (aio.secure_channel(address, credentials, options=options) if credentials is not None
                        else aio.insecure_channel(address, options=options))
        self.admin = admin_pb2_grpc.AdminStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self.counts = counts_pb2_grpc.CountsStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self.files = static_files_pb2_grpc.StaticFilesStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped


class _Core:
    """Everything that runs on the background loop. Touch it only from that loop (or its stats under `lock`)."""

    def __init__(self, config: ClientConfig, drafter: Drafter, table: CountTable) -> None:
        self.config = config
        self.drafter = drafter
        self.table = table
        self.stats = _Stats()
        self.lock = threading.Lock()  # guards stats and the pending buffer's size for readers
        self.files = GenerationFiles(config.cache_dir, config.namespace)
        self.client_id = f"ngc-{uuid.uuid4().hex}"
        self.metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()
        self.credentials = channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
        self._addr = 0
        self.chan: _Channel | None = None
        self.pending: deque[NDArray[np.int32]] = deque()
        self.pending_rows = 0
        self.in_flight = 0
        self.seq = 0
        self.max_unacked = config.max_unacked
        self.max_batch_rows = config.max_batch_rows
        self.static: StaticCache | None = None
        self.closing: asyncio.Event | None = None
        self.static_ready: asyncio.Event | None = None
        self.mirror_ready: asyncio.Event | None = None

    # channels and calls

    def channel(self) -> _Channel:
        if self.chan is None:
            self.chan = _Channel(self.config.addresses[self._addr], 0, self.credentials)
            with self.lock:
                self.stats.address = self.chan.address
        return self.chan

    async def switch(self, epoch: int) -> None:
        """Move to the next address, unless another task already did since ``epoch``."""
        old = self.chan
        if old is None or old.epoch != epoch:
            return
        self._addr = (self._addr + 1) % len(self.config.addresses)
        self.chan = _Channel(self.config.addresses[self._addr], epoch + 1, self.credentials)
        with self.lock:
            self.stats.reconnects += 1
            self.stats.address = self.chan.address
        log.info("ngramcache client: switching to %s", self.chan.address)
        await old.channel.close(grace=0.2)

    async def retrying(self, what: str, call: Callable[[_Channel], Awaitable[T]],
                       until: float | None = None) -> T:
        """Run ``call`` until it succeeds; retriable failures switch address and back off.

        Raises:
            NgramCacheError: a non-retriable failure, or a retriable one past ``until`` (monotonic).
        """
        attempt = 0
        while True:
            chan = self.channel()
            try:
                return await call(chan)
            except asyncio.CancelledError:
                if self.cancelled_by_us():
                    raise
                # The channel was closed under this call (another task moved to the next address):
                # the same call again, on the channel now current.
                log.debug("%s cancelled by a channel switch; retrying", what)
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not err.retriable:
                    raise err from None
                if getattr(err, "code", None) == grpc.StatusCode.UNAVAILABLE:
                    await self.switch(chan.epoch)
                if until is not None and time.monotonic() >= until:
                    raise err from None
                log.debug("%s failed (%s); retrying", what, err)
            delay = self.config.backoff.delay(attempt)
            attempt += 1
            if until is not None:
                delay = min(delay, max(0.0, until - time.monotonic()))
            await asyncio.sleep(delay)

    # start

    async def connect(self) -> None:
        """Check the namespace and read the server's limits (retrying unreachable addresses until connect_timeout)."""
        until = time.monotonic() + min(self.config.connect_timeout, self.config.ready_timeout)
        timeout = min(self.config.rpc_timeout, 2.0)

        async def get(chan: _Channel) -> admin_pb2.GetNamespaceResponse:
            resp: admin_pb2.GetNamespaceResponse = await chan.admin.GetNamespace(
                admin_pb2.GetNamespaceRequest(name=self.config.namespace), timeout=timeout, metadata=self.metadata)
            return resp

        try:
            ns = (await self.retrying("GetNamespace", get, until)).namespace
        except BackendUnavailableError as e:
            raise BackendUnavailableError(
                f"no ngramcache service answered at {', '.join(self.config.addresses)} within "
                f"{self.config.connect_timeout:g} s (connect_timeout): {e}") from None
        if ns.tokenizer_fingerprint != self.config.fingerprint or ns.vocab_size != self.config.vocab_size:
            raise TokenizerMismatchError(
                f"namespace {self.config.namespace!r} is bound to fingerprint {ns.tokenizer_fingerprint.hex()[:16]}... "
                f"vocab_size {ns.vocab_size}; the client's tokenizer has {self.config.fingerprint.hex()[:16]}... "
                f"vocab_size {self.config.vocab_size}")

        async def info(chan: _Channel) -> admin_pb2.GetServerInfoResponse:
            resp: admin_pb2.GetServerInfoResponse = await chan.admin.GetServerInfo(
                admin_pb2.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata)
            return resp

        limits = (await self.retrying("GetServerInfo", info, until)).limits
        if limits.dedup_window:
            self.max_unacked = max(1, min(self.max_unacked, limits.dedup_window))
        if limits.max_batch_rows:
            self.max_batch_rows = max(1, min(self.max_batch_rows, limits.max_batch_rows))

    async def run(self, started: Callable[[BaseException | None], None]) -> None:
        self.closing = asyncio.Event()
        self.static_ready = asyncio.Event()
        self.mirror_ready = asyncio.Event()
        try:
            await self.connect()
        except BaseException as e:  # reported to the constructor
            started(e)
            await self.shutdown_channel()
            return
        tasks = [asyncio.create_task(self.static_loop(), name="ngc-static"),
                 asyncio.create_task(self.mirror_loop(), name="ngc-mirror")]
        pusher = asyncio.create_task(self.push_loop(), name="ngc-push")
        ready = asyncio.gather(self.static_ready.wait(), self.mirror_ready.wait())
        try:
            await asyncio.wait_for(ready, self.config.ready_timeout)
            started(None)
        except asyncio.TimeoutError:
            log.warning("ngramcache client: first sync not done after %.0f s; going on in the background",
                        self.config.ready_timeout)
            started(None)
        await self.closing.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await pusher  # flushes within close_timeout
        await self.shutdown_channel()

    async def shutdown_channel(self) -> None:
        if self.chan is not None:
            await self.chan.channel.close(grace=None)
            self.chan = None
        self.files.unlock()

    def cancelled_by_us(self) -> bool:
        """Whether a CancelledError is this task's own cancellation (closing), not a call that grpc
        cancelled because its channel was closed by a switch to another address."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+
        if cancelling is not None and cancelling() > 0:
            return True
        return self.closing is not None and self.closing.is_set() and cancelling is None

    async def forever(self, what: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` again and again; errors are logged and retried after a backoff (never fatal)."""
        attempt = 0
        while True:
            try:
                await body()
                attempt = 0
            except asyncio.CancelledError:
                if self.cancelled_by_us():
                    raise
                log.debug("ngramcache client: %s cancelled by a channel switch; again", what)  # not fatal
                await asyncio.sleep(0.05)
            except NgramCacheError as e:
                log.warning("ngramcache client: %s failed: %s", what, e)
                attempt += 1
                await asyncio.sleep(self.config.backoff.delay(attempt) + (0.0 if e.retriable else 1.0))
            except Exception:
                log.exception("ngramcache client: %s failed", what)
                attempt += 1
                await asyncio.sleep(1.0 + self.config.backoff.delay(attempt))

    # static generations

    async def static_loop(self) -> None:
        assert self.static_ready is not None
        ready = self.static_ready

        async def initial() -> None:
            async def lst(chan: _Channel) -> static_files_pb2.ListGenerationsResponse:
                resp: static_files_pb2.ListGenerationsResponse = await chan.files.List(
                    static_files_pb2.ListGenerationsRequest(namespace=self.config.namespace),
                    timeout=self.config.rpc_timeout, metadata=self.metadata)
                return resp

            gens = (await self.retrying("List", lst)).generations
            if gens:
                await self.adopt(gens[-1])
            ready.set()

        async def watch() -> None:
            chan = self.channel()
            try:
                stream = chan.files.Watch(static_files_pb2.WatchRequest(
                    namespace=self.config.namespace, after_generation=self.stats.generation), metadata=self.metadata)
                async for msg in stream:
                    if msg.generation.generation > self.stats.generation:
                        await self.adopt(msg.generation)
                await asyncio.sleep(0.2)  # the server ended the stream (shutting down): watch again
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if getattr(err, "code", None) == grpc.StatusCode.UNAVAILABLE:
                    await self.switch(chan.epoch)
                raise err from None

        while not ready.is_set():
            await self.forever_once("static generations", initial)
        await self.forever("watch", watch)

    async def forever_once(self, what: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` once; on an error log it and back off (the caller loops)."""
        try:
            await body()
        except asyncio.CancelledError:
            if self.cancelled_by_us():
                raise
            await asyncio.sleep(0.05)  # a call cancelled by a channel switch: again
        except NgramCacheError as e:
            log.warning("ngramcache client: %s failed: %s", what, e)
            await asyncio.sleep(self.config.backoff.delay(3) + (0.0 if e.retriable else 1.0))
        except Exception:  # e.g. OSError: the node's cache folder is full or unwritable; never fatal
            log.exception("ngramcache client: %s failed", what)
            await asyncio.sleep(1.0 + self.config.backoff.delay(3))

    async def adopt(self, gen: static_files_pb2.Generation) -> None:
        """Make ``gen`` installed on this node (downloading it if no one did) and attach it."""
        if gen.tokenizer_fingerprint != self.config.fingerprint or gen.vocab_size != self.config.vocab_size:
            raise TokenizerMismatchError(f"generation {gen.generation} is for another tokenizer")
        number = gen.generation
        while not self.files.try_lock():  # another process of the node downloads: wait for it
            await asyncio.sleep(0.05)
        try:
            if not self.files.installed(number, gen.size, gen.sha256):
                await self.download(gen)
            path = self.files.path(number)
            cache = await asyncio.to_thread(StaticCache.open, path)
            if cache.generation <= self.stats.generation:
                return
            self.drafter.set_static(cache)  # the old StaticCache is dropped; its mapping with it
            self.static = cache
            with self.lock:
                self.stats.generation = number
            self.files.prune(number, self.config.keep_generations)
        finally:
            self.files.unlock()

    async def download(self, gen: static_files_pb2.Generation) -> None:
        """Fetch ``gen`` into its .part file (resuming from its size), verify it whole and install it."""
        number, part = gen.generation, self.files.part_path(gen.generation)
        for _ in range(3):  # a verified mismatch restarts from 0 a bounded number of times
            async def fetch(chan: _Channel) -> None:
                offset = part.stat().st_size if part.exists() else 0
                if offset > gen.size:
                    part.unlink()
                    offset = 0
                stream = chan.files.Fetch(static_files_pb2.FetchRequest(
                    namespace=self.config.namespace, generation=number, offset=offset, expected_sha256=gen.sha256),
                    metadata=self.metadata)
                with open(part, "ab") as f:
                    try:
                        async for msg in stream:
                            if msg.WhichOneof("kind") != "chunk":
                                continue
                            if msg.chunk.offset != f.tell():
                                raise CacheFormatError(f"Fetch sent offset {msg.chunk.offset}, expected {f.tell()}")
                            f.write(msg.chunk.data)
                            with self.lock:
                                self.stats.downloaded_bytes += len(msg.chunk.data)
                    finally:
                        f.flush()
                        os.fsync(f.fileno())

            try:
                await self.retrying(f"Fetch {number}", fetch)
            except NgramCacheError as e:
                if getattr(e, "code", None) in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
                    part.unlink(missing_ok=True)  # not the same file any more: start again
                raise
            try:
                await asyncio.to_thread(self.files.verify_part, number, gen.sha256, self.config.fingerprint,
                                        self.config.vocab_size)
            except CacheFormatError as e:
                log.warning("ngramcache client: downloaded generation %d is corrupt (%s); fetching it again", number, e)
                part.unlink(missing_ok=True)
                continue
            self.files.install(number, gen.sha256)
            with self.lock:
                self.stats.downloads += 1
            return
        raise CacheFormatError(f"generation {number} failed verification 3 times")

    # dynamic mirror

    async def pull(self, table: CountTable, since: int | None) -> int:
        """Apply one Pull of the store's counts (export or changes) to ``table``; return the version to resume from."""
        async def call(chan: _Channel) -> int:
            request = counts_pb2.PullRequest(namespace=self.config.namespace, tokenizer_fingerprint=self.config.fingerprint)
            if since is not None:
                request.since_version = since
            version: int | None = None
            async for chunk in chan.counts.Pull(request, timeout=max(30.0, self.config.rpc_timeout),
                                                metadata=self.metadata):
                rows = bytes_to_count_rows(chunk.rows)
                self.count_pulled(rows, chunk.ByteSize())
                if len(rows):
                    table.assign_rows(rows)
                if chunk.complete:
                    version = chunk.version
            if version is None:
                raise BackendUnavailableError("Pull ended before its last chunk")
            return version

        return await self.retrying("Pull", call)

    async def pull_view(self, since: int | None, view_id: str) -> tuple[int, str]:
        """Apply one Pull of the draft view: its changes, or the whole view into a new table swapped in
        (reset); return the (version, view_id) to resume from."""
        async def call(chan: _Channel) -> tuple[int, str]:
            request = counts_pb2.PullRequest(namespace=self.config.namespace, tokenizer_fingerprint=self.config.fingerprint,
                                             view=counts_pb2.PULL_VIEW_DRAFT, view_id=view_id)
            if since is not None:
                request.since_version = since
            target: CountTable | None = None
            async for chunk in chan.counts.Pull(request, timeout=max(30.0, self.config.rpc_timeout),
                                                metadata=self.metadata):
                if target is None:
                    target = CountTable() if chunk.reset else self.table
                rows = bytes_to_count_rows(chunk.rows)
                self.count_pulled(rows, chunk.ByteSize())
                if len(rows):
                    target.assign_rows(rows, zero_removes=True)
                if chunk.complete:
                    if target is not self.table:
                        if since is not None:
                            log.info("ngramcache client: draft view reloaded (view %s)", chunk.view_id[:8])
                            with self.lock:
                                self.stats.resyncs += 1
                        self.drafter.set_dynamic(target)
                        self.table = target
                    return chunk.version, chunk.view_id
            raise BackendUnavailableError("Pull ended before its last chunk")

        return await self.retrying("Pull", call)

    def count_pulled(self, rows: NDArray[np.int64], size: int) -> None:
        with self.lock:
            self.stats.pulled_rows += len(rows)
            self.stats.pulled_bytes += size

    async def mirror_loop(self) -> None:
        assert self.mirror_ready is not None and self.closing is not None
        ready = self.mirror_ready

        async def step() -> None:
            version = self.stats.mirror_version
            if self.config.mirror == "draft":
                version, view_id = await self.pull_view(version, self.stats.view_id)
                with self.lock:
                    self.stats.mirror_version, self.stats.view_id = version, view_id
                    self.stats.mirror_last_ok = time.monotonic()
                ready.set()
                await asyncio.sleep(self.config.pull_interval)
                return
            try:
                if version is None:
                    version = await self.pull(self.table, None)
                else:
                    version = await self.pull(self.table, version)
            except ResyncRequiredError:
                log.info("ngramcache client: mirror resync (version %s no longer reachable)", version)
                fresh = CountTable()
                version = await self.pull(fresh, None)
                self.drafter.set_dynamic(fresh)
                self.table = fresh
                with self.lock:
                    self.stats.resyncs += 1
            with self.lock:
                self.stats.mirror_version = version
                self.stats.mirror_last_ok = time.monotonic()
            ready.set()
            await asyncio.sleep(self.config.pull_interval)

        await self.forever("mirror", step)

    # pushing

    def drain(self) -> None:
        rows = self.drafter.drain_deltas()
        if not len(rows):
            return
        with self.lock:
            self.stats.drained_rows += len(rows)
            self.stats.drained_count += int(rows[:, COUNT].sum(dtype=np.int64))
        self.pending.append(np.ascontiguousarray(rows, dtype=DELTA_DTYPE))
        self.pending_rows += len(rows)
        if self.pending_rows > self.config.max_pending_rows:
            self.shrink()

    def shrink(self) -> None:
        """Over the buffer: sum identical rows; if still over, drop the oldest rows (logged, counted)."""
        merged = aggregate_rows(np.concatenate(list(self.pending)))
        limit = self.config.max_pending_rows
        dropped = 0
        if len(merged) > limit:
            # Summing sorts the rows (their age is lost), so drop from the oldest arrays first.
            arrays = list(self.pending)
            total = sum(len(a) for a in arrays)
            while total > limit:
                excess = total - limit
                if len(arrays[0]) <= excess:
                    dropped += len(arrays.pop(0))
                    total = sum(len(a) for a in arrays)
                else:
                    arrays[0] = arrays[0][excess:]
                    dropped += excess
                    total -= excess
            merged = aggregate_rows(np.concatenate(arrays)) if arrays else np.empty((0, ROW_WIDTH), DELTA_DTYPE)
        self.pending = deque([merged]) if len(merged) else deque()
        self.pending_rows = len(merged)
        if dropped:
            with self.lock:
                self.stats.dropped_rows += dropped
            log.warning("ngramcache client: push buffer full (%d rows); dropped the %d oldest rows", limit, dropped)

    def take_batch(self) -> NDArray[np.int32] | None:
        if not self.pending:
            return None
        rows = aggregate_rows(np.concatenate(list(self.pending)))
        batch, rest = rows[: self.max_batch_rows], rows[self.max_batch_rows:]
        self.pending = deque([rest]) if len(rest) else deque()
        self.pending_rows = len(rest)
        return np.ascontiguousarray(batch)

    async def send(self, seq: int, rows: NDArray[np.int32], until: float | None) -> None:
        """Push one batch, retrying the same (client_id, seq) while the service is unavailable."""
        request = counts_pb2.PushRequest(namespace=self.config.namespace, tokenizer_fingerprint=self.config.fingerprint,
                                         client_id=self.client_id, seq=seq, rows=delta_rows_to_bytes(rows))

        async def call(chan: _Channel) -> counts_pb2.PushResponse:
            resp: counts_pb2.PushResponse = await chan.counts.Push(request, timeout=self.config.rpc_timeout,
                                                                   metadata=self.metadata)
            return resp

        try:
            resp = await self.retrying(f"Push seq {seq}", call, until)
        except NgramCacheError as e:
            with self.lock:
                self.stats.dropped_rows += len(rows)
            log.warning("ngramcache client: push of %d rows (seq %d) dropped: %s", len(rows), seq, e)
            return
        finally:
            self.in_flight -= 1
        with self.lock:
            self.stats.acked_rows += len(rows)
            self.stats.acked_count += int(rows[:, COUNT].sum(dtype=np.int64))
            self.stats.duplicate_batches += int(resp.duplicate)

    async def push_loop(self) -> None:
        assert self.closing is not None
        closing = self.closing
        running: set[asyncio.Task[None]] = set()
        until: float | None = None
        while True:
            if closing.is_set() and until is None:
                until = time.monotonic() + self.config.close_timeout
            self.drain()
            while self.in_flight < self.max_unacked:
                batch = self.take_batch()
                if batch is None:
                    break
                seq, self.seq = self.seq, self.seq + 1
                self.in_flight += 1
                with self.lock:
                    self.stats.pushed_rows += len(batch)
                task = asyncio.create_task(self.send(seq, batch, until))
                running.add(task)
                task.add_done_callback(running.discard)
            if until is not None:
                if (not running and not self.pending) or time.monotonic() >= until:
                    break
                await asyncio.sleep(0.01)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closing.wait(), self.config.push_interval)
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self.pending_rows:
            with self.lock:
                self.stats.dropped_rows += self.pending_rows
            log.warning("ngramcache client: close dropped %d unsent rows", self.pending_rows)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            s = dataclasses.replace(self.stats)
        lag = time.monotonic() - s.mirror_last_ok if s.mirror_last_ok else None
        return {
            "address": s.address, "client_id": self.client_id, "generation": s.generation,
            "mirror": self.config.mirror, "mirror_version": s.mirror_version, "view_id": s.view_id,
            "mirror_rows": self.table.n_entries, "mirror_bytes": self.table.memory_bytes(),
            "pulled_rows": s.pulled_rows, "pulled_bytes": s.pulled_bytes,
            "mirror_lag_seconds": lag, "resyncs": s.resyncs,
            "drained_rows": s.drained_rows, "drained_count": s.drained_count, "pending_rows": self.pending_rows,
            "pushed_rows": s.pushed_rows, "acked_rows": s.acked_rows, "acked_count": s.acked_count,
            "duplicate_batches": s.duplicate_batches, "dropped_rows": s.dropped_rows,
            "reconnects": s.reconnects, "downloads": s.downloads, "downloaded_bytes": s.downloaded_bytes,
        }


# --- the public, synchronous facade -----------------------------------------------------

def _quiet_grpc_poller(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler, less grpc.aio's spurious poller errors.

    grpc.aio has one completion queue per process and every event loop that used it listens
    to its notification socket (grpc issue #25364). With several clients in a process (one
    loop each), a loop that wakes for nothing gets BlockingIOError, and one that hands a
    completion to a client closed meanwhile gets "Event loop is closed". Both are harmless
    (the completion belongs to another loop, or to a finished client), so they are not
    printed as tracebacks; everything else goes to the default handler.
    """
    exc = context.get("exception")
    handle = repr(context.get("handle", ""))
    if "PollerCompletionQueue._handle_events" in handle and (
            isinstance(exc, BlockingIOError) or (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc))):
        log.debug("ngramcache client: ignored grpc.aio poller error: %r", exc)
        return
    loop.default_exception_handler(context)


class NgramClient:
    """A local `Drafter` kept in sync with a namespace of an ngramcache service; a context manager.

    The drafter drafts from the namespace's latest static generation (fetched once per node
    into ``cache_dir``), a mirror of its dynamic counts (pulled at least once a second) and
    its own sequences; what it accepts is pushed in the background, exactly once. While no
    service answers, drafting goes on with what was last synced and pushes wait.

    Thread-safety: the drafter is safe to use from many threads (see `Drafter`); `stats`
    and `close` may be called from any thread.

    Args:
        addresses: ``"host:port"`` or a list of them (tried in order on UNAVAILABLE).
        namespace: the namespace to draft from and push to.
        tokenizer: a `Tokenizer` (anything with ``fingerprint`` and ``vocab_size``) or a
            ``(fingerprint, vocab_size)`` pair.
        cache_dir: the node's generation cache (default ``$XDG_CACHE_HOME/ngramcache``).
        token: a bearer token, or None.
        **options: more `ClientConfig` fields (``tls_ca`` for TLS, ``mirror``, intervals, ...).

    Raises:
        TokenizerMismatchError: the namespace is bound to another tokenizer.
        NamespaceNotFoundError: no such namespace.
        BackendUnavailableError: no address answered within ``connect_timeout`` (default 10 s), or the first sync took longer than ``ready_timeout``.
    """

    def __init__(self, addresses: str | Sequence[str], namespace: str,
                 tokenizer: HasTokenizer | tuple[bytes, int], *, cache_dir: str | os.PathLike[str] | None = None,
                 token: str | None = None, **options: Any) -> None:
        if isinstance(tokenizer, tuple):
            fingerprint, vocab_size = tokenizer
        else:
            fingerprint, vocab_size = tokenizer.fingerprint, tokenizer.vocab_size
        addrs = (addresses,) if isinstance(addresses, str) else tuple(addresses)
        if not addrs:
            raise InvalidArgumentError("addresses must name at least one service")
        if cache_dir is None:
            cache_dir = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ngramcache")
        self.config = ClientConfig(addresses=addrs, namespace=namespace, fingerprint=bytes(fingerprint),
                                   vocab_size=int(vocab_size), cache_dir=os.fspath(cache_dir), token=token, **options)
        table = CountTable()
        self._drafter = Drafter(dynamic=table, fingerprint=self.config.fingerprint, vocab_size=self.config.vocab_size,
                                track_deltas=True, mode=self.config.mode, **self.config.drafter_options)
        self._core = _Core(self.config, self._drafter, table)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ngramcache-sync-{namespace}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join(5)
            self._loop.close()
            self._closed = True
            raise self._start_error

    def _run(self) -> None:
        def started(error: BaseException | None) -> None:
            self._start_error = error
            self._started.set()

        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(_quiet_grpc_poller)
        try:
            self._loop.run_until_complete(self._core.run(started))
        except BaseException as e:  # a bug: never leave the constructor waiting
            log.exception("ngramcache client: background loop failed")
            started(e)
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def drafter(self) -> Drafter:
        """The synced `Drafter` (the same object on every call): draft, accept and end sequences on it."""
        return self._drafter

    def stats(self) -> dict[str, Any]:
        """A snapshot: generation, mirror version/rows/bytes/lag, pulled rows/bytes, pushed/acked/dropped rows, reconnects, downloads."""
        return self._core.snapshot()

    def close(self) -> None:
        """Flush pending pushes (within ``close_timeout``), stop the background thread, release the files."""
        if self._closed:
            return
        self._closed = True
        closing = self._core.closing
        if closing is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(closing.set)
        self._thread.join(self.config.close_timeout + 10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> NgramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed and self._thread.is_alive():
                self.close()

