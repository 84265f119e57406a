"""The Counts servicer: Push applies delta batches exactly once, Pull streams a namespace's counts (or its draft view) in chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Generator, Iterator

import numpy as np
from grpc import aio

from ngramcache.client._proto.codec import DELTA_ROW_BYTES, bytes_to_delta_rows, count_rows_to_bytes
from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.errors import BackendUnavailableError, InvalidArgumentError
from ngramcache.client.rows import empty_counts

from ..counts.namespace import check_tokenizer
from ..counts.store import GroupItem, namespace_changed
from ..metrics import Metrics
from ..namespaces import NamespaceRegistry
from ..push_batcher import PushBatcher
from ..status import limit_exceeded
from ..store_runner import StoreRunner

DEFAULT_CHUNK_ROWS = 16384
"""Rows of a Pull chunk when the request says 0 (counts.proto: 16384 rows, 896 KiB)."""


class CountsServicer(counts_pb2_grpc.CountsServicer):
    """Push and Pull over the service's counts store, called through its `StoreRunner`; concurrent
    pushes of a namespace are applied together by its `PushBatcher` (``batcher``).

    Thread-safety: handlers run on the server's event loop; the store calls run on the
    runner's pool (the store is thread-safe).

    Args:
        runner: the executor that owns the counts store.
        max_push_rows: most rows of a Push (RESOURCE_EXHAUSTED beyond); capped at the
            store's ``max_batch_rows`` (`max_push_rows` holds the limit applied, the value
            for ServerLimits.max_batch_rows).
        max_chunk_rows: most rows of a Pull chunk, whatever the request asks
            (ServerLimits.max_chunk_rows).
        metrics: where to count pushed rows (None: nowhere).
        push_batch_window_ms: how long a group of pushes waits for more before it goes to
            the store (0: it goes as soon as the store is free; see `PushBatcher`).
        push_group_rows: most rows of one group of pushes (None: the store's
            ``max_batch_rows``, so no store call is bigger than the biggest single push).
        registry: the live namespaces, whose draft views a Pull with view = PULL_VIEW_DRAFT
            reads (None: such a Pull is INVALID_ARGUMENT).
    """

    def __init__(self, runner: StoreRunner, *, max_push_rows: int, max_chunk_rows: int,
                 metrics: Metrics | None = None, push_batch_window_ms: float = 0.0,
                 push_group_rows: int | None = None, registry: NamespaceRegistry | None = None) -> None:
        if max_push_rows < 1 or max_chunk_rows < 1:
            raise ValueError("max_push_rows and max_chunk_rows must be >= 1")
        self._runner = runner
        self._store = runner.store
        self.max_push_rows = min(max_push_rows, self._store.config.max_batch_rows)
        self.max_chunk_rows = max_chunk_rows
        self.batcher = PushBatcher(runner, window=push_batch_window_ms / 1000,
                                   max_group_rows=push_group_rows or self._store.config.max_batch_rows)
        self._metrics = metrics  # observability (issue 8)
        self._registry = registry

    async def Push(self, request: counts_pb2.PushRequest, context: aio.ServicerContext) -> counts_pb2.PushResponse:
        rows = len(request.rows) // DELTA_ROW_BYTES
        if rows > self.max_push_rows:
            raise limit_exceeded(f"a Push carries at most {self.max_push_rows} rows, got {rows}")
        deltas = bytes_to_delta_rows(request.rows)  # InvalidArgumentError unless a whole number of rows
        # The store checks this push's client id, seq, tokenizer and every row before it writes
        # anything, and applies it together with the pushes that arrive meanwhile (PushBatcher),
        # once per (client_id, seq); the answer comes after that store call returned.
        result, version = await self.batcher.push(request.namespace, GroupItem(
            request.client_id, request.seq, deltas, request.tokenizer_fingerprint))
        if self._metrics is not None:
            self._metrics.pushed(rows, duplicate=result.duplicate)
        return counts_pb2.PushResponse(duplicate=result.duplicate, units=result.units, applied_units=result.applied,
                                       duplicate_units=result.duplicates, entries=result.entries, version=version)

    async def Pull(self, request: counts_pb2.PullRequest,
                   context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullResponse]:
        namespace = request.namespace
        chunk_rows = min(request.max_chunk_rows or DEFAULT_CHUNK_ROWS, self.max_chunk_rows)
        info = await self._runner.call(self._store.namespace_info, namespace)
        check_tokenizer(info, request.tokenizer_fingerprint)
        if request.view == counts_pb2.PULL_VIEW_DRAFT:
            async for chunk in self._pull_view(request, chunk_rows):
                yield chunk
            return
        if request.view != counts_pb2.PULL_VIEW_STORE:
            raise InvalidArgumentError(f"unknown Pull view {request.view}")
        if request.HasField("since_version"):
            change = await self._runner.call(self._store.changes_since, namespace, request.since_version)
            for rows, complete in _split(change.rows, chunk_rows):
                yield _chunk(rows, change.version, complete)
            return
        # Version first, then the export: changes_since(version) covers what changes during it.
        version = await self._runner.call(self._store.version, namespace)
        # The export is read one store chunk per executor call, never whole in memory.
        parts = await self._runner.call(self._store.export, namespace, chunk_rows=chunk_rows)
        try:
            held: list[np.ndarray] = []  # rows read but not sent: fewer than chunk_rows + one store chunk
            held_rows = 0
            while (part := await self._runner.call(next, parts, None)) is not None:
                held.append(part)
                held_rows += len(part)
                if held_rows > chunk_rows:  # keep the rest back: the last chunk must say complete
                    pending = np.concatenate(held)
                    sendable = (len(pending) - 1) // chunk_rows * chunk_rows
                    for rows, _ in _split(pending[:sendable], chunk_rows):
                        yield _chunk(rows, version, False)
                    held, held_rows = [pending[sendable:]], len(pending) - sendable
        finally:
            with contextlib.suppress(ValueError, RuntimeError):  # still running in a worker (a cancelled call)
                await self._runner.call(_close, parts)
        # The export read the incarnation the version belongs to only if it was not dropped meanwhile.
        now = await self._runner.call(self._store.namespace_info, namespace)
        if now.instance != info.instance:
            raise namespace_changed(namespace, "the export")
        yield _chunk(np.concatenate(held) if held else empty_counts(), version, True)


    async def _pull_view(self, request: counts_pb2.PullRequest,
                         chunk_rows: int) -> AsyncIterator[counts_pb2.PullResponse]:
        """The draft view's changes since (view_id, since_version), or the whole view with reset."""
        if self._registry is None:
            raise InvalidArgumentError("this server does not serve draft views")
        view = (await self._registry.get(request.namespace)).view
        if view is None:
            raise BackendUnavailableError(f"the draft view of {request.namespace!r} is not built yet")
        if request.HasField("since_version"):
            changes = view.changes_since(request.view_id, request.since_version)
            if changes is not None:
                for part, complete in _split(changes, chunk_rows):
                    yield _chunk(part, view.version, complete, view.view_id, reset=False)
                return
        view_id, version, rows = await asyncio.to_thread(view.export_rows)
        for part, complete in _split(rows, chunk_rows):
            yield _chunk(part, version, complete, view_id, reset=True)


def _split(rows: np.ndarray, chunk_rows: int) -> Iterator[tuple[np.ndarray, bool]]:
    """(rows of at most chunk_rows, last?) pieces of ``rows``; one empty last piece for no rows."""
    if len(rows) == 0:
        yield rows, True
        return
    for start in range(0, len(rows), chunk_rows):
        yield rows[start:start + chunk_rows], start + chunk_rows >= len(rows)


def _close(it: Iterator[np.ndarray]) -> None:
    """Let an export the call no longer reads release what it holds (a generator's finally blocks)."""
    if isinstance(it, Generator):
        it.close()


def _chunk(rows: np.ndarray, version: int, complete: bool, view_id: str = "", reset: bool = False) -> counts_pb2.PullResponse:
    return counts_pb2.PullResponse(rows=count_rows_to_bytes(rows), version=version, complete=complete, view_id=view_id,
                                   reset=reset)
