"""NamespaceRegistry: the drafting state the service keeps per namespace.

For every namespace a request has named, the service keeps one `LiveNamespace`: a native
`Drafter` bound to the namespace's tokenizer whose sequences are the drafting sessions, a
mirror of the namespace's dynamic counts (a `CountTable` filled from a full export, then
kept current by `changes_since` every `mirror_interval` seconds and applied as upserts
while sessions draft: no draft waits on the store), and the latest static generation of
the `StaticStore`, swapped in when a newer one is published. Each generation file is mapped
once per process and shared by every session. Each refresh also folds the changed rows into
the namespace's `DraftView`, what clients mirroring the draft view pull.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import numpy as np

from ngramcache.client._core import CountTable, Drafter
from ngramcache.client.kernel.errors import NamespaceNotFoundError, NgramCacheError, ResyncRequiredError
from ngramcache.client.kernel.tasks import cancel_until_done

from .counts import NamespaceRecord
from .draft_view import DraftView, ViewPolicy
from .peer_sync import PeerSync
from .static_store import StaticStore
from .store_runner import StoreRunner

log = logging.getLogger("ngramcache.service")

SCAN_FACTOR = 5
"""Namespaces not live on a replica are checked for newer committed generations every SCAN_FACTOR x peer_sync_interval."""


@dataclasses.dataclass
class MirrorState:
    """How current a namespace's dynamic mirror is."""

    version: int | None = None  # the store version the mirror reflects; None before the first export
    rows_applied: int = 0
    last_refresh: float = 0.0  # time.monotonic() of the last successful refresh
    errors: int = 0


class LiveNamespace:
    """One namespace's drafter, dynamic mirror and static generation (see module docstring)."""

    def __init__(self, info: NamespaceRecord, *, max_sessions: int, session_memory: int,
                 view_policy: ViewPolicy | None = None,
                 on_match_drafter: Callable[[str, Drafter], None] | None = None) -> None:
        self.info = info
        self.view_policy = view_policy
        self.fingerprint = bytes.fromhex(info.fingerprint)
        self.dynamic = CountTable()
        self.drafter = Drafter(dynamic=self.dynamic, fingerprint=self.fingerprint, vocab_size=info.vocab_size,
                               max_sequences=max_sessions, max_memory=session_memory)
        self._limits = (max_sessions, session_memory)
        self._match_drafter: Drafter | None = None  # made on the first match-mode session
        self._on_match_drafter = on_match_drafter  # the fleet history feeds and publishes it
        self.mirror = MirrorState()
        self.view: DraftView | None = None  # made after the first export
        self.view_refreshed = time.monotonic()  # when the view last took changes
        self.generation = 0  # of the attached static cache; 0: none
        self.dropped = False
        self._tasks: list[asyncio.Task[None]] = []

    def attach_static(self, cache: object, generation: int) -> None:
        if generation > self.generation:
            self.drafter.set_static(cache)  # type: ignore[arg-type]
            if self._match_drafter is not None:
                self._match_drafter.set_static(cache)  # type: ignore[arg-type]
            self.generation = generation

    def set_dynamic(self, table: CountTable) -> None:
        """Swaps in a new dynamic mirror for every drafter of the namespace."""
        self.dynamic = table
        self.drafter.set_dynamic(table)
        if self._match_drafter is not None:
            self._match_drafter.set_dynamic(table)

    def drafter_for(self, mode: str) -> Drafter:
        """The namespace's drafter of `mode` ("compatible" or "match"): both share the dynamic
        mirror and the static generation; the match one also keeps the namespace's recent
        sequences (its history) for every session to match against."""
        if mode == "compatible":
            return self.drafter
        if self._match_drafter is None:
            d = Drafter(dynamic=self.dynamic, fingerprint=self.fingerprint, vocab_size=self.info.vocab_size,
                        max_sequences=self._limits[0], max_memory=self._limits[1], mode="match",
                        track_history=self._on_match_drafter is not None)
            cache = self.drafter.static
            if cache is not None:
                d.set_static(cache)
            self._match_drafter = d
            if self._on_match_drafter is not None:
                self._on_match_drafter(self.info.name, d)
        return self._match_drafter


class NamespaceRegistry:
    """Creates a `LiveNamespace` on first use and keeps its mirror and generation current.

    Thread-safety: used from the server's event loop only.
    """

    def __init__(self, runner: StoreRunner, static_store: StaticStore, *, mirror_interval: float, max_sessions: int,
                 session_memory: int, view_policy: ViewPolicy | None = None, peer_sync: PeerSync | None = None,
                 peer_interval: float = 1.0, on_match_drafter: Callable[[str, Drafter], None] | None = None) -> None:
        self._runner = runner
        self._static = static_store
        self._interval = mirror_interval
        self._max_sessions = max_sessions
        self._session_memory = session_memory
        self._view_policy = view_policy
        self.peer_sync = peer_sync
        self._peer_interval = peer_interval
        self._live: dict[str, LiveNamespace] = {}
        self.on_match_drafter = on_match_drafter  # called with each namespace's match drafter when it is made
        self._opening: dict[str, asyncio.Future[LiveNamespace]] = {}
        self._closed = False
        self._scan: asyncio.Task[None] | None = None
        self._scanning: dict[str, asyncio.Task[None]] = {}  # the fleet scan's checks in progress, by namespace

    def live(self) -> dict[str, LiveNamespace]:
        return dict(self._live)

    async def get(self, namespace: str) -> LiveNamespace:
        """The live state of `namespace`, opened (export mirrored, generation attached) on first use.

        Raises:
            NamespaceNotFoundError: no such namespace in the counts store.
            BackendUnavailableError: the store cannot be reached.
        """
        ns = self._live.get(namespace)
        if ns is not None and not ns.dropped:
            return ns
        pending = self._opening.get(namespace)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[LiveNamespace] = asyncio.get_running_loop().create_future()
        self._opening[namespace] = fut
        try:
            ns = await self._open(namespace)
            fut.set_result(ns)
            return ns
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters get it through shield
            raise
        finally:
            del self._opening[namespace]

    async def _open(self, namespace: str) -> LiveNamespace:
        info = await self._runner.call(self._runner.store.namespace_info, namespace)
        ns = LiveNamespace(info, max_sessions=self._max_sessions, session_memory=self._session_memory,
                           view_policy=self._view_policy, on_match_drafter=self.on_match_drafter)
        await self._full_export(ns, ns.dynamic)
        ns.view = await asyncio.to_thread(DraftView, ns.dynamic, self._view_policy)
        await self._sync_from_peers(ns)
        latest = self._static.latest(namespace)
        if latest is not None:
            ns.attach_static(await asyncio.to_thread(self._static.open, namespace, latest.generation), latest.generation)
        self._live[namespace] = ns
        ns._tasks.append(asyncio.create_task(self._mirror_loop(ns), name=f"mirror:{namespace}"))
        ns._tasks.append(asyncio.create_task(self._watch_loop(ns), name=f"watch:{namespace}"))
        if self.peer_sync is not None:
            ns._tasks.append(asyncio.create_task(self._peer_loop(ns), name=f"peers:{namespace}"))
        log.info("namespace %s live: %d mirrored rows, store version %s, generation %d", namespace,
                 ns.mirror.rows_applied, ns.mirror.version, ns.generation)
        return ns

    async def _full_export(self, ns: LiveNamespace, table: CountTable) -> None:
        store = self._runner.store
        version = await self._runner.call(store.version, ns.info.name)
        it = await self._runner.call(store.export, ns.info.name)
        rows = 0
        while True:
            chunk: np.ndarray | None = await self._runner.call(next, it, None)
            if chunk is None:
                break
            await asyncio.to_thread(table.assign_rows, np.ascontiguousarray(chunk, dtype=np.int64))
            rows += len(chunk)
        ns.mirror.version = version
        ns.mirror.rows_applied += rows
        ns.mirror.last_refresh = time.monotonic()

    async def refresh(self, ns: LiveNamespace) -> None:
        """One mirror refresh: changes since the mirrored version, or a full resync."""
        store = self._runner.store
        assert ns.mirror.version is not None
        try:
            cs = await self._runner.call(store.changes_since, ns.info.name, ns.mirror.version)
        except ResyncRequiredError:
            log.warning("namespace %s: mirror too far behind the store; resyncing from a full export", ns.info.name)
            fresh = CountTable()
            await self._full_export(ns, fresh)
            ns.set_dynamic(fresh)
            if ns.view is not None:
                ns.view.install(*await asyncio.to_thread(ns.view.build, fresh, ns.view.scale))
            return
        if len(cs.rows):
            rows = np.ascontiguousarray(cs.rows, dtype=np.int64)
            await asyncio.to_thread(ns.dynamic.assign_rows, rows)
            ns.mirror.rows_applied += len(cs.rows)
            view = ns.view
            if view is not None:
                now = time.monotonic()
                diff, scale = await asyncio.to_thread(view.diff, rows, now - ns.view_refreshed)
                ns.view_refreshed = now
                if scale != view.scale:
                    log.info("namespace %s: draft view over its budgets (%d rows, %d rows/s); key minimum x%d",
                             ns.info.name, view.policy.max_rows, view.policy.max_rows_per_second, scale)
                view.apply(diff, scale)
        ns.mirror.version = cs.version
        ns.mirror.last_refresh = time.monotonic()

    async def _mirror_loop(self, ns: LiveNamespace) -> None:
        while not ns.dropped:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh(ns)
            except NamespaceNotFoundError:
                self._forget(ns)
            except NgramCacheError as e:  # store down: drafting goes on with the mirror it has
                ns.mirror.errors += 1
                log.warning("namespace %s: mirror refresh failed (%s); retrying", ns.info.name, e)
            except Exception:
                ns.mirror.errors += 1
                log.exception("namespace %s: mirror refresh failed", ns.info.name)

    async def _sync_from_peers(self, ns: LiveNamespace) -> None:
        """Install a generation another replica committed, if newer than ours (errors are logged)."""
        if self.peer_sync is None:
            return
        try:
            await self.peer_sync.sync(ns.info)
        except NgramCacheError as e:
            log.warning("namespace %s: checking the committed generation failed: %s", ns.info.name, e)

    async def _peer_loop(self, ns: LiveNamespace) -> None:
        while not ns.dropped:
            await asyncio.sleep(self._peer_interval)
            await self._sync_from_peers(ns)

    def start_fleet_scan(self) -> None:
        """Installs, every `SCAN_FACTOR` x peer_interval, the generations other replicas committed for
        namespaces nobody has used on this replica yet, so a generation is listed on every replica
        without waiting for a client (live namespaces are checked by their own loop).

        Each namespace is checked in a task of its own, at most one at a time per namespace: a
        builder that hangs (a Fetch from it waits for its deadline) holds up only its own namespaces."""
        if self.peer_sync is not None and self._scan is None:
            self._scan = asyncio.create_task(self._scan_loop(), name="peers:scan")

    def scanning(self) -> set[str]:
        """The namespaces the fleet scan is checking now (a fetch from their builder in progress, say)."""
        return set(self._scanning)

    async def _scan_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(SCAN_FACTOR * self._peer_interval)
            try:
                infos = await self._runner.call(self._runner.store.list_namespaces)
            except NgramCacheError as e:
                log.warning("listing the namespaces to check their committed generations failed: %s", e)
                continue
            for info in infos:
                if info.name not in self._live and info.name not in self._scanning and not self._closed:
                    task = asyncio.create_task(self._scan_one(info), name=f"peers:scan:{info.name}")
                    self._scanning[info.name] = task
                    task.add_done_callback(functools.partial(self._scan_done, info.name))

    async def _scan_one(self, info: NamespaceRecord) -> None:
        assert self.peer_sync is not None
        try:
            await self.peer_sync.sync(info)
        except NgramCacheError as e:
            log.warning("namespace %s: checking the committed generation failed: %s", info.name, e)

    def _scan_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._scanning.get(name) is task:
            del self._scanning[name]
        if not task.cancelled() and task.exception() is not None:
            log.error("namespace %s: checking the committed generation failed", name, exc_info=task.exception())

    async def _watch_loop(self, ns: LiveNamespace) -> None:
        try:
            async for gen in self._static.watch(ns.info.name, ns.generation):  # ends NOT_FOUND on a drop
                if ns.dropped:
                    return
                try:
                    cache = await asyncio.to_thread(self._static.open, ns.info.name, gen.generation)
                    ns.attach_static(cache, gen.generation)
                    log.info("namespace %s: drafting from generation %d", ns.info.name, gen.generation)
                except NgramCacheError as e:
                    log.error("namespace %s: generation %d not attached: %s", ns.info.name, gen.generation, e)
        except NamespaceNotFoundError:
            self._forget(ns)

    def _forget(self, ns: LiveNamespace) -> None:
        ns.dropped = True
        if self._live.get(ns.info.name) is ns:
            del self._live[ns.info.name]
        current = asyncio.current_task()
        for t in ns._tasks:
            if t is not current:
                t.cancel()

    def drop(self, namespace: str) -> None:
        """Forgets `namespace` (dropped by Admin): its sessions end NOT_FOUND at their next step."""
        ns = self._live.get(namespace)
        if ns is not None:
            self._forget(ns)

    async def close(self) -> None:
        self._closed = True
        scans = [t for t in (self._scan, *self._scanning.values()) if t is not None]
        await cancel_until_done(scans)
        tasks = [t for ns in self._live.values() for t in ns._tasks]
        for ns in list(self._live.values()):
            self._forget(ns)
        await cancel_until_done(tasks)
