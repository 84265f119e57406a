"""The Counts servicer: Push applies delta batches exactly once, Pull streams a namespace's counts (or its draft view) in chunks; PushHistory, PullHistory and SubscribeHistory carry the fleet history."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

import numpy as np
from grpc import aio

from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.errors import BackendUnavailableError, InvalidArgumentError
from ngramcache.client.wire.codec import (
    DELTA_ROW_BYTES,
    TOKEN_BYTES,
    bytes_to_delta_rows,
    bytes_to_tokens,
    count_rows_to_bytes,
    tokens_to_bytes,
)

from ..counts.export import CountsExporter, split_rows
from ..counts.history import MAX_BATCH_RECORDS, MAX_RECORD_TOKENS, HistoryRecord
from ..counts.namespace import check_tokenizer
from ..counts.values import GroupItem
from ..history_tail import HistoryTails
from ..metrics import Metrics
from ..namespaces import NamespaceRegistry
from ..push_batcher import PushBatcher
from ..status import limit_exceeded
from ..store_runner import StoreRunner

DEFAULT_CHUNK_ROWS = 16384
"""Rows of a Pull chunk when the request says 0 (counts.proto: 16384 rows, 896 KiB)."""

MAX_PULL_WAIT_MS = 5000
"""Longest wait of a draft view Pull with nothing new (PullRequest.wait_ms is capped at it)."""


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
        push_queue_rows: most rows of pushes waiting for the store per namespace; more are
            shed with OVERLOADED (see `PushBatcher`).
        history: the fleet history's tails (None: PushHistory, PullHistory and SubscribeHistory are INVALID_ARGUMENT).
    """

    def __init__(self, runner: StoreRunner, *, max_push_rows: int, max_chunk_rows: int,
                 metrics: Metrics | None = None, push_batch_window_ms: float = 0.0,
                 push_group_rows: int | None = None, registry: NamespaceRegistry | None = None,
                 push_queue_rows: int = 1 << 18, history: HistoryTails | None = None) -> None:
        if max_push_rows < 1 or max_chunk_rows < 1:
            raise ValueError("max_push_rows and max_chunk_rows must be >= 1")
        store = runner.store
        self.max_push_rows = min(max_push_rows, store.config.max_batch_rows)
        self.max_chunk_rows = max_chunk_rows
        self.batcher = PushBatcher(runner, window=push_batch_window_ms / 1000,
                                   max_group_rows=push_group_rows or store.config.max_batch_rows,
                                   max_queue_rows=push_queue_rows, metrics=metrics)
        self.exporter = CountsExporter(runner)
        self._metrics = metrics
        self._registry = registry
        self.history = history
        # Each record's wire form, made once: a replica's tail serves the same ring records to every
        # client of the fleet (a record's entry goes when the ring drops the record).
        self._wire: weakref.WeakKeyDictionary[HistoryRecord, counts_pb2.HistoryRecord] = weakref.WeakKeyDictionary()

    async def Push(self, request: counts_pb2.PushRequest, context: aio.ServicerContext) -> counts_pb2.PushResponse:
        rows = len(request.rows) // DELTA_ROW_BYTES
        if rows > self.max_push_rows:
            raise limit_exceeded(f"a Push carries at most {self.max_push_rows} rows, got {rows}")
        deltas = bytes_to_delta_rows(request.rows)  # InvalidArgumentError unless a whole number of rows
        # The store checks this push's client id, seq, tokenizer and every row before it writes
        # anything, and applies it together with the pushes that arrive meanwhile (PushBatcher),
        # once per (client_id, seq); the answer comes after that store call returned. The
        # caller's deadline goes along: a push that cannot be applied before it is shed (OVERLOADED).
        result = await self.batcher.push(request.namespace, GroupItem(
            request.client_id, request.seq, deltas, request.tokenizer_fingerprint), context.time_remaining())
        if self._metrics is not None:
            self._metrics.pushed(rows, duplicate=result.duplicate)
        return counts_pb2.PushResponse(duplicate=result.duplicate, units=result.units, applied_units=result.applied,
                                       duplicate_units=result.duplicates, entries=result.entries)  # version: deprecated, 0

    async def Pull(self, request: counts_pb2.PullRequest,
                   context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullResponse]:
        namespace = request.namespace
        chunk_rows = min(request.max_chunk_rows or DEFAULT_CHUNK_ROWS, self.max_chunk_rows)
        if request.view == counts_pb2.PULL_VIEW_DRAFT and self._registry is not None:
            # The view is the registry's, which holds the namespace's record (its mirror finds a drop within a
            # refresh, as for Sessions): no store call per Pull, which every client makes every pull_interval.
            live = await self._registry.get(namespace)
            check_tokenizer(live.info, request.tokenizer_fingerprint)
            async for chunk in self._pull_view(request, chunk_rows, context):
                yield chunk
            return
        info = await self.exporter.namespace(namespace, request.tokenizer_fingerprint)
        if request.view == counts_pb2.PULL_VIEW_DRAFT:
            async for chunk in self._pull_view(request, chunk_rows, context):
                yield chunk
            return
        if request.view != counts_pb2.PULL_VIEW_STORE:
            raise InvalidArgumentError(f"unknown Pull view {request.view}")
        if request.HasField("since_version"):
            chunks = self.exporter.changes(namespace, request.since_version, chunk_rows)
        else:
            chunks = self.exporter.export(info, chunk_rows)
        async with contextlib.aclosing(chunks):  # a call that ends early closes the store's export now
            async for part in chunks:
                yield _chunk(part.rows, part.version, part.complete)

    async def _pull_view(self, request: counts_pb2.PullRequest, chunk_rows: int,
                         context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullResponse]:
        """The draft view's changes since (view_id, since_version), or the whole view with reset; with nothing new
        and ``wait_ms``, the changes of the view's next update (within the wait and the caller's deadline). With
        ``follow``, the same again and again from the version just sent, until the caller cancels."""
        if self._registry is None:
            raise InvalidArgumentError("this server does not serve draft views")
        view_id, since = request.view_id, request.since_version if request.HasField("since_version") else None
        wait = min(request.wait_ms, MAX_PULL_WAIT_MS) / 1000
        if request.follow:
            wait = wait or MAX_PULL_WAIT_MS / 1000  # the stream's silence is bounded: an empty batch after it
        interval = min(request.min_interval_ms, MAX_PULL_WAIT_MS) / 1000
        while True:
            view = (await self._registry.get(request.namespace)).view  # NOT_FOUND once dropped
            if view is None:
                raise BackendUnavailableError(f"the draft view of {request.namespace!r} is not built yet")
            changes = view.changes_since(view_id, since) if since is not None else None
            if changes is not None and not len(changes) and wait:
                left = context.time_remaining()
                left = float("inf") if left is None else left - 0.5  # answer before the deadline
                if left <= 0 and request.follow:
                    return  # the caller's deadline is near: end the stream (it pulls again)
                await view.wait_newer(view_id, since or 0, max(0.0, min(wait, left)))
                changes = view.changes_since(view_id, since or 0)
            if changes is not None:
                view_id, version, reset, rows = view.view_id, view.version, False, changes
            else:
                view_id, version, rows = await asyncio.to_thread(view.export_rows)
                reset = True
            for part, complete in split_rows(rows, chunk_rows):
                yield _chunk(part, version, complete, view_id, reset=reset)
            since = version
            if not request.follow:
                return
            if interval:
                await asyncio.sleep(interval)  # the changes of the interval go as one batch

    async def PushHistory(self, request: counts_pb2.PushHistoryRequest,
                          context: aio.ServicerContext) -> counts_pb2.PushHistoryResponse:
        history = self._history()
        if len(request.records) > MAX_BATCH_RECORDS:
            raise limit_exceeded(f"a PushHistory carries at most {MAX_BATCH_RECORDS} records, got {len(request.records)}")
        records = []
        for i, r in enumerate(request.records):
            if len(r.tokens) > MAX_RECORD_TOKENS * TOKEN_BYTES:
                raise limit_exceeded(f"history record {i}: at most {MAX_RECORD_TOKENS} tokens, got "
                                     f"{len(r.tokens) // TOKEN_BYTES}")
            # The store checks the rest (group, offset, token range, client id) for the whole batch first.
            records.append(HistoryRecord(request.client_id, r.seq, r.group, r.offset, bytes_to_tokens(r.tokens)))
        done = await history.push(request.namespace, request.client_id, request.seq, records,
                                  request.tokenizer_fingerprint)
        return counts_pb2.PushHistoryResponse(duplicate=not done.stored, records_stored=done.records,
                                              tokens_stored=done.tokens, records_skipped=done.skipped_records,
                                              tokens_skipped=done.skipped_tokens)

    async def PullHistory(self, request: counts_pb2.PullHistoryRequest,
                          context: aio.ServicerContext) -> counts_pb2.PullHistoryResponse:
        history = self._history()
        page = await history.pull(request.namespace, request.tokenizer_fingerprint, request.after,
                                  max_records=request.max_records, wait=request.wait_ms / 1000,
                                  exclude_client_id=request.exclude_client_id, groups=tuple(request.groups))
        return counts_pb2.PullHistoryResponse(records=[self._wire_record(r) for r in page.records], cursor=page.cursor,
                                              gap=page.gap)

    async def SubscribeHistory(self, request: counts_pb2.PullHistoryRequest,
                               context: aio.ServicerContext) -> AsyncIterator[counts_pb2.PullHistoryResponse]:
        # grpc.aio writes each yielded message before it asks for the next: a reader that does not read holds its
        # stream's one page here and costs the others nothing.
        pages = self._history().subscribe(
            request.namespace, request.tokenizer_fingerprint, request.after, max_records=request.max_records,
            wait=request.wait_ms / 1000, exclude_client_id=request.exclude_client_id, groups=tuple(request.groups))
        async with contextlib.aclosing(pages):
            async for page in pages:
                yield counts_pb2.PullHistoryResponse(records=[self._wire_record(r) for r in page.records],
                                                     cursor=page.cursor, gap=page.gap)

    def _wire_record(self, record: HistoryRecord) -> counts_pb2.HistoryRecord:
        wire = self._wire.get(record)
        if wire is None:
            wire = self._wire[record] = counts_pb2.HistoryRecord(
                seq=record.seq, group=record.group, offset=record.offset, tokens=tokens_to_bytes(record.tokens),
                client_id=record.client_id, time_ms=record.time_ms)
        return wire

    def _history(self) -> HistoryTails:
        if self.history is None:
            raise InvalidArgumentError("this server does not serve the fleet history")
        return self.history


def _chunk(rows: np.ndarray, version: int, complete: bool, view_id: str = "", reset: bool = False) -> counts_pb2.PullResponse:
    return counts_pb2.PullResponse(rows=count_rows_to_bytes(rows), version=version, complete=complete, view_id=view_id,
                                   reset=reset)
