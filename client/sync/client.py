"""NgramClient: a local Drafter kept in sync with the fleet by one background thread (static generations, mirror, pushes).

One implementation: a daemon thread runs one asyncio loop (grpc.aio) that does every
network call; the public API is synchronous, and ``draft``/``accept`` on the drafter it
hands out never wait on the network. The loop runs three tasks over one `SyncState`:
`StaticSync`, `Mirror` and `Pusher` (their modules say what each guarantees), and in match
mode two more for the fleet history: `HistoryPublisher` and `HistoryMirror`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ngramcache.client._core import CountTable, Drafter
from ngramcache.client._proto.v1 import admin_pb2
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    ConnectTimeoutError,
    InvalidArgumentError,
    NgramCacheError,
    ServiceUnreachableError,
    TokenizerMismatchError,
)
from ngramcache.client.kernel.static_files import GenerationFiles, default_cache_dir, prepare_cache_dir
from ngramcache.client.kernel.tasks import cancel_until_done
from ngramcache.client.sync.config import ClientConfig, HasTokenizer
from ngramcache.client.sync.health import HealthWatch
from ngramcache.client.sync.history import HistoryPublisher, HistoryStats
from ngramcache.client.sync.history_mirror import HistoryMirror
from ngramcache.client.sync.mirror import Mirror
from ngramcache.client.sync.pusher import Pusher
from ngramcache.client.sync.state import SyncState
from ngramcache.client.sync.static_sync import StaticSync
from ngramcache.client.wire.address import check_address
from ngramcache.client.wire.diagnose import Diagnosis, diagnose
from ngramcache.client.wire.transport import Channel, read_pem

__all__ = ["NgramClient"]

log = logging.getLogger("ngramcache.client.sync")

T = TypeVar("T")


class SyncLoop:
    """What runs on the background loop: connect, then the static sync, the mirror and the pusher until closed."""

    def __init__(self, config: ClientConfig, drafter: Drafter, table: CountTable) -> None:
        self.state = SyncState(config, drafter)
        self.files = GenerationFiles(config.cache_dir, config.namespace)
        self.static = StaticSync(self.state, self.files)
        self.mirror = Mirror(self.state, table)
        self.pusher = Pusher(self.state)
        self.health = HealthWatch(self.state)
        self.history_stats = HistoryStats()
        self.publisher = HistoryPublisher(self.state, self.history_stats)
        self.history_mirror = HistoryMirror(self.state, self.history_stats, self.publisher.buffer.live)
        self.publisher.enabled = self.history_mirror.enabled = bool(config.history)

    async def connect(self) -> None:
        """Check the namespace and read the server's limits (retrying unreachable addresses until connect_timeout)."""
        state, config = self.state, self.state.config
        until = time.monotonic() + min(config.connect_timeout, config.ready_timeout)
        timeout = min(config.rpc_timeout, 2.0)

        async def get(chan: Channel) -> admin_pb2.GetNamespaceResponse:
            resp: admin_pb2.GetNamespaceResponse = await chan.admin.GetNamespace(
                admin_pb2.GetNamespaceRequest(name=config.namespace), timeout=timeout, metadata=state.metadata)
            return resp

        try:
            ns = (await self._first_answer(state.retrying("GetNamespace", get, until))).namespace
        except ServiceUnreachableError:
            raise
        except BackendUnavailableError as e:
            found = [d for d in await self._diagnoses() if d is not None]
            raise ConnectTimeoutError(config.addresses, config.connect_timeout, found, str(e)) from None
        if ns.tokenizer_fingerprint != config.fingerprint or ns.vocab_size != config.vocab_size:
            raise TokenizerMismatchError(
                f"namespace {config.namespace!r} is bound to fingerprint {ns.tokenizer_fingerprint.hex()[:16]}... "
                f"vocab_size {ns.vocab_size}; the client's tokenizer has {config.fingerprint.hex()[:16]}... "
                f"vocab_size {config.vocab_size}")

        async def info(chan: Channel) -> admin_pb2.GetServerInfoResponse:
            resp: admin_pb2.GetServerInfoResponse = await chan.admin.GetServerInfo(
                admin_pb2.GetServerInfoRequest(), timeout=timeout, metadata=state.metadata)
            return resp

        limits = (await state.retrying("GetServerInfo", info, until)).limits
        self.pusher.limit(limits.dedup_window, limits.max_batch_rows)
        self.publisher.buffer.limit(limits.max_history_records, limits.max_history_record_tokens)
        if config.history and not limits.max_history_records:
            log.warning("ngramcache client: the service at %s does not serve the fleet history (an older version); "
                        "drafting from this client's own history only", state.stats.address or config.addresses[0])
            self.publisher.enabled = self.history_mirror.enabled = False

    async def _diagnoses(self) -> list[Diagnosis | None]:
        """Why each address does not answer (None: it looks fine), probed in threads."""
        config = self.state.config
        ca = read_pem(config.tls_ca, "tls_ca")
        return list(await asyncio.gather(*(asyncio.to_thread(diagnose, a, tls_ca=ca, tls_cert=config.tls_cert,
                                                             tls_key=config.tls_key) for a in config.addresses)))

    async def _first_answer(self, call: Awaitable[T]) -> T:
        """``call`` (the first call to the service), ended early when every address fails for a cause waiting
        cannot fix (TLS on one side only, an untrusted certificate, not a gRPC server): ServiceUnreachableError.

        Refused connections and silent hosts are retried until connect_timeout: a service may be starting."""
        task = asyncio.ensure_future(call)
        delay = 0.2
        while True:
            done, _ = await asyncio.wait({task}, timeout=delay)
            if done:
                return task.result()
            found = await self._diagnoses()
            if found and all(d is not None and d.permanent for d in found):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, NgramCacheError):
                    await task
                raise ServiceUnreachableError(found[0])
            delay = min(delay * 2, 2.0)

    async def run(self, started: Callable[[BaseException | None], None]) -> None:
        state = self.state
        state.closing = asyncio.Event()
        try:
            await self.connect()
        except BaseException as e:  # reported to the constructor
            started(e)
            await self.shutdown()
            return
        tasks = [asyncio.create_task(self.static.run(), name="ngc-static"),
                 asyncio.create_task(self.mirror.run(), name="ngc-mirror"),
                 asyncio.create_task(self.health.run(), name="ngc-health")]
        if self.history_mirror.enabled:
            tasks.append(asyncio.create_task(self.history_mirror.run(), name="ngc-history-mirror"))
        pusher = asyncio.create_task(self.pusher.run(), name="ngc-push")
        publisher = asyncio.create_task(self.publisher.run(), name="ngc-history-push")
        ready = asyncio.gather(self.static.ready.wait(), self.mirror.ready.wait())
        try:
            await asyncio.wait_for(ready, state.config.ready_timeout)
            started(None)
        except asyncio.TimeoutError:
            log.warning("ngramcache client: first sync not done after %.0f s; going on in the background",
                        state.config.ready_timeout)
            started(None)
        await state.closing.wait()
        await cancel_until_done(tasks)
        with contextlib.suppress(Exception):
            await asyncio.gather(pusher, publisher)  # both flush within close_timeout
        await self.shutdown()

    async def shutdown(self) -> None:
        await self.state.channels.close()
        self.files.unlock()

    def snapshot(self) -> dict[str, Any]:
        state = self.state
        with state.lock:
            s = dataclasses.replace(state.stats)
        lag = time.monotonic() - s.mirror_last_ok if s.mirror_last_ok else None
        table = self.mirror.table
        return {
            "address": s.address, "client_id": state.client_id, "generation": s.generation,
            "mirror": state.config.mirror, "mirror_version": s.mirror_version, "view_id": s.view_id,
            "mirror_rows": table.n_entries, "mirror_bytes": table.memory_bytes(),
            "mirror_pulls": s.mirror_pulls, "pulled_rows": s.pulled_rows, "pulled_bytes": s.pulled_bytes,
            "mirror_lag_seconds": lag, "resyncs": s.resyncs,
            "drained_rows": s.drained_rows, "drained_count": s.drained_count, "pending_rows": self.pusher.pending_rows,
            "pushed_rows": s.pushed_rows, "acked_rows": s.acked_rows, "acked_count": s.acked_count,
            "duplicate_batches": s.duplicate_batches, "dropped_rows": s.dropped_rows, "dropped_count": s.dropped_count,
            "unconfirmed_rows": s.unconfirmed_rows, "unconfirmed_count": s.unconfirmed_count,
            "overloaded": s.overloaded, "overload_waits": s.overload_waits, "retry_wait_seconds": s.retry_wait_seconds,
            "push_window": self.pusher.rate.window, "push_batch_rows": self.pusher.rate.batch_rows,
            "reconnects": s.reconnects, "downloads": s.downloads, "downloaded_bytes": s.downloaded_bytes,
            **self.history_snapshot(),
        }

    def history_snapshot(self) -> dict[str, Any]:
        """The fleet history's stats keys (``history_*``)."""
        state, drafter = self.state, self.state.drafter
        with state.lock:
            h = dataclasses.replace(self.history_stats)
        lag = self.history_mirror.lag
        enabled = self.publisher.enabled
        entries = drafter.history_size if state.config.mode == "match" else 0
        return {
            "history": enabled, "history_drained_records": h.drained_records, "history_drained_tokens": h.drained_tokens,
            "history_pending_tokens": self.publisher.buffer.pending_tokens, "history_pushed_batches": h.pushed_batches,
            "history_pushed_records": h.pushed_records, "history_pushed_tokens": h.pushed_tokens,
            "history_stored_records": h.stored_records, "history_stored_tokens": h.stored_tokens,
            "history_skipped_records": h.skipped_records, "history_skipped_tokens": h.skipped_tokens,
            "history_duplicate_batches": h.duplicate_batches, "history_duplicate_records": h.duplicate_records,
            "history_duplicate_tokens": h.duplicate_tokens, "history_dropped_records": h.dropped_records,
            "history_dropped_tokens": h.dropped_tokens + (drafter.history_dropped if enabled else 0),
            "history_unconfirmed_records": h.unconfirmed_records, "history_unconfirmed_tokens": h.unconfirmed_tokens,
            "history_pulled_records": h.pulled_records, "history_pulled_tokens": h.pulled_tokens,
            "history_pulled_bytes": h.pulled_bytes, "history_gaps": h.gaps, "history_tail_streams": h.tail_streams,
            "history_group_pull": enabled and self.history_mirror.groups_per_pull > 0,
            "history_group_pulls": h.group_pulls, "history_group_pulled_records": h.group_pulled_records,
            "history_group_pulled_tokens": h.group_pulled_tokens, "history_group_pulled_bytes": h.group_pulled_bytes,
            "history_appended_tokens": h.appended_tokens, "history_repeated_tokens": h.repeated_tokens,
            "history_restored_tokens": h.restored_tokens,
            "history_lag_ms_p50": lag.quantile(0.5), "history_lag_ms_p99": lag.quantile(0.99),
            # Entries of the drafter's match history (what match_params history_tokens bounds): its tokens plus a
            # separator before each text piece, so not a token count; history_size: an alias, the same value.
            "history_entries": entries, "history_size": entries,
        }


def _cancel_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels the loop's tasks still pending once the client's work ended and lets them finish, as asyncio.run does:
    grpc.aio's own task that awaits a cancelled stream's status can still be waiting, and a task destroyed pending
    prints "Task was destroyed but it is pending!" when the loop closes."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if tasks:
        loop.run_until_complete(cancel_until_done(tasks))


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
    into ``cache_dir``), a mirror of its dynamic counts (its changes pulled as the service takes them) and
    its own sequences; what it accepts is pushed in the background, exactly once. While no
    service answers, drafting goes on with what was last synced and pushes wait.

    Thread-safety: the drafter is safe to use from many threads (see `Drafter`); `stats`
    and `close` may be called from any thread.

    Args:
        addresses: ``"host:port"`` or a list of them (tried in order on UNAVAILABLE).
        namespace: the namespace to draft from and push to.
        tokenizer: a `Tokenizer` (anything with ``fingerprint`` and ``vocab_size``) or a
            ``(fingerprint, vocab_size)`` pair.
        cache_dir: the node's generation cache (default ``$XDG_CACHE_HOME/ngramcache``, created with its
            parents); a given folder is created when its parent exists.
        token: a bearer token, or None.
        **options: more `ClientConfig` fields (``tls_ca`` for TLS, ``mirror``, intervals, ...).

    Raises:
        TokenizerMismatchError: the namespace is bound to another tokenizer.
        NamespaceNotFoundError: no such namespace.
        ConnectTimeoutError: (a BackendUnavailableError) no address answered within ``connect_timeout``
            (default 10 s); the message says what a probe of each address found (refused, unknown host,
            ...), ``diagnoses`` holds them and ``message(names)`` words them with other names for the settings.
        BackendUnavailableError: the first sync took longer than ``ready_timeout``.
        ServiceUnreachableError: at once, when every address fails for a cause waiting cannot fix (TLS on
            one side only, an untrusted certificate, not a gRPC server).
        InvalidArgumentError: an address is not ``HOST:PORT`` (a URL such as ``http://...``, no port), or
            ``cache_dir`` cannot be used (its parent folder is missing, it is a file, it is not writable).
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
        for a in addrs:
            check_address(a, "addresses" if len(addrs) > 1 else "address")
        cache_dir = prepare_cache_dir(default_cache_dir() if cache_dir is None else cache_dir,
                                      create_parents=cache_dir is None)
        self.config = ClientConfig(addresses=addrs, namespace=namespace, fingerprint=bytes(fingerprint),
                                   vocab_size=int(vocab_size), cache_dir=os.fspath(cache_dir), token=token, **options)
        table = CountTable()
        history: dict[str, Any] = {"track_history": True} if self.config.history else {}
        self._drafter = Drafter(dynamic=table, fingerprint=self.config.fingerprint, vocab_size=self.config.vocab_size,
                                track_deltas=True, mode=self.config.mode, **history, **self.config.drafter_options)
        self._sync = SyncLoop(self.config, self._drafter, table)
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
            self._loop.run_until_complete(self._sync.run(started))
        except BaseException as e:  # a bug: never leave the constructor waiting
            log.exception("ngramcache client: background loop failed")
            started(e)
        finally:
            with contextlib.suppress(Exception):
                _cancel_leftover_tasks(self._loop)
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def drafter(self) -> Drafter:
        """The synced `Drafter` (the same object on every call): draft, accept and end sequences on it."""
        return self._drafter

    def set_group(self, seq: int, group: str) -> None:
        """Tag sequence ``seq`` with ``group`` in the fleet history: sequences sampled from one prompt share it.

        Call it before the sequence's first accept; without it a sequence's group is a hash of
        its first accepted tokens (its prompt).

        Raises:
            InvalidArgumentError: the fleet history is off (compatible mode, or ``history=False``),
                or ``group`` is not 1..64 characters of [A-Za-z0-9_.:-].
        """
        if not self.config.history:
            raise InvalidArgumentError("set_group needs the fleet history (mode='match', history on)")
        self._sync.publisher.buffer.set_group(seq, group)

    def stats(self) -> dict[str, Any]:
        """A snapshot: generation, mirror version/rows/bytes/lag, pulled rows/bytes, pushed/acked/dropped/unconfirmed rows,
        overload (pushes shed, rate halvings, seconds waited, the current window and batch rows), reconnects, downloads;
        the fleet history's ``history_*`` keys (drained, pushed, dropped, pulled records/tokens/bytes by the tail and
        ``history_group_*`` by the live groups' pulls, tokens appended and tokens received again, gaps, the lag from a
        record's store time to this client in ms, p50 and p99 over the last 1000 records)."""
        return self._sync.snapshot()

    def close(self) -> None:
        """Flush pending pushes (within ``close_timeout``), stop the background thread, release the files."""
        if self._closed:
            return
        self._closed = True
        closing = self._sync.state.closing
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

