"""The Admin servicer: create, describe, list and drop namespaces, describe the server, run rebuilds."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from typing import Final

from grpc import aio

from ngramcache.client._core import MAX_DRAFT, MAX_VOCAB, NGRAM_MAX
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc
from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError
from ngramcache.client.kernel.version import __version__

from ..counts.namespace import NamespaceRecord, validate_namespace
from ..rebuild import Rebuilder, RebuildJob, RebuildOptions
from ..store_runner import StoreRunner

PROTOCOL: Final = admin_pb2.DESCRIPTOR.package
"""The wire package served: "ngramcache.v1"."""

V1_CAPABILITIES: Final = ("drafting.session", "drafting.draft", "drafting.match_mode", "drafting.tree", "counts.push",
                          "counts.pull", "static_files.fetch", "static_files.watch", "static_files.publish", "admin",
                          "counts.history")
"""Every capability of a complete v1 server (admin.proto, GetServerInfoResponse.capabilities)."""

DEFAULT_PAGE_SIZE: Final = 100
MAX_PAGE_SIZE: Final = 1000

# CountsStoreConfig.address.kind -> GetServerInfoResponse.counts_backend
_BACKEND_NAMES: Final = {"embedded": "embedded", "redis": "redis", "cluster": "redis-cluster",
                          "sentinel": "redis-sentinel"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """The limits a server applies (admin.proto ServerLimits; 0 means no limit where the proto says so).

    The dedup window is the counts store's and is not repeated here; ``max_batch_rows`` is
    capped at the store's own ``max_batch_rows`` (as `CountsServicer.max_push_rows` is).
    """

    max_message_bytes: int
    max_draft_tokens: int
    max_step_tokens: int
    max_session_tokens: int
    max_sessions: int
    max_batch_rows: int
    max_chunk_rows: int
    max_static_file_bytes: int
    max_draft: int = MAX_DRAFT
    ngram_max: int = NGRAM_MAX
    max_vocab: int = MAX_VOCAB
    max_history_records: int = 0  # 0: no fleet history served
    max_history_record_tokens: int = 0
    max_history_wait_ms: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """What GetServerInfo says beyond what the counts store tells (its backend, its dedup window).

    Attributes:
        limits: the server's limits.
        capabilities: the optional features it serves (dotted lowercase names).
        auth_required: whether calls need a bearer token.
        version: the ngramcache version it runs.
    """

    limits: ServerLimits
    capabilities: tuple[str, ...] = V1_CAPABILITIES
    auth_required: bool = False
    version: str = __version__


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Namespaces in the service's counts store (through its `StoreRunner`) and the server's description.

    Admin-only enforcement (CreateNamespace, DropNamespace) belongs to the auth interceptor.
    Thread-safety: handlers run on the server's event loop; the store calls run on the
    runner's pool.

    Args:
        runner: the executor that owns the counts store.
        server_info: what GetServerInfo answers.
        on_drop: called with the name after every DropNamespace, on the event loop, so
            the service forgets the namespace's live state (sessions, mirrors).
    """

    def __init__(self, runner: StoreRunner, *, server_info: ServerInfo,
                 on_drop: Callable[[str], object] | None = None,
                 latest_generation: Callable[[str], int] | None = None,
                 rebuilder: Rebuilder | None = None) -> None:
        self._runner = runner
        self._rebuilder = rebuilder
        self._latest_generation = latest_generation
        self._store = runner.store
        self._on_drop = on_drop
        config = self._store.config
        limits = server_info.limits
        self._server_info = admin_pb2.GetServerInfoResponse(
            version=server_info.version, protocol=PROTOCOL, capabilities=list(server_info.capabilities),
            counts_backend=_BACKEND_NAMES[config.address.kind], auth_required=server_info.auth_required,
            limits=admin_pb2.ServerLimits(
                max_message_bytes=limits.max_message_bytes, max_draft=limits.max_draft, ngram_max=limits.ngram_max,
                max_vocab=limits.max_vocab, max_draft_tokens=limits.max_draft_tokens,
                max_step_tokens=limits.max_step_tokens, max_session_tokens=limits.max_session_tokens,
                max_sessions=limits.max_sessions, max_batch_rows=min(limits.max_batch_rows, config.max_batch_rows),
                dedup_window=config.dedup_window, max_chunk_rows=limits.max_chunk_rows,
                max_static_file_bytes=limits.max_static_file_bytes,
                max_history_records=limits.max_history_records,
                max_history_record_tokens=limits.max_history_record_tokens,
                max_history_wait_ms=limits.max_history_wait_ms))

    async def CreateNamespace(self, request: admin_pb2.CreateNamespaceRequest,
                              context: aio.ServicerContext) -> admin_pb2.CreateNamespaceResponse:
        info, created = await self._runner.call(
            self._store.ensure_namespace, request.name, request.tokenizer_fingerprint, request.vocab_size,
            buckets=request.buckets or None, shards=request.shards or None)
        return admin_pb2.CreateNamespaceResponse(namespace=await self._describe(info), created=created)

    async def GetNamespace(self, request: admin_pb2.GetNamespaceRequest,
                           context: aio.ServicerContext) -> admin_pb2.GetNamespaceResponse:
        info = await self._runner.call(self._store.namespace_info, request.name)
        return admin_pb2.GetNamespaceResponse(namespace=await self._describe(info))

    async def ListNamespaces(self, request: admin_pb2.ListNamespacesRequest,
                             context: aio.ServicerContext) -> admin_pb2.ListNamespacesResponse:
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = request.page_token  # the last name of the previous page
        if after:
            try:
                validate_namespace(after)
            except InvalidArgumentError:
                raise InvalidArgumentError(f"page_token {after!r} is not one this server gave") from None
        # One more than a page: whether it comes tells whether there is a next page.
        infos = await self._runner.call(self._store.list_namespaces, after=after, limit=size + 1)
        page = infos[:size]
        described = await asyncio.gather(*(self._describe_if_present(info) for info in page))
        return admin_pb2.ListNamespacesResponse(
            namespaces=[ns for ns in described if ns is not None],
            next_page_token=page[-1].name if len(infos) > size else "")

    async def DropNamespace(self, request: admin_pb2.DropNamespaceRequest,
                            context: aio.ServicerContext) -> admin_pb2.DropNamespaceResponse:
        existed = await self._runner.call(self._store.drop_namespace, request.name)
        if self._on_drop is not None:
            result = self._on_drop(request.name)
            if inspect.isawaitable(result):
                await result
        return admin_pb2.DropNamespaceResponse(existed=existed)

    async def GetServerInfo(self, request: admin_pb2.GetServerInfoRequest,
                            context: aio.ServicerContext) -> admin_pb2.GetServerInfoResponse:
        return self._server_info

    async def StartRebuild(self, request: admin_pb2.StartRebuildRequest,
                           context: aio.ServicerContext) -> admin_pb2.RebuildStatus:
        rebuilder = self._need_rebuilder()
        # include_previous (deprecated) is ignored: the corpus base is folded unless skip_base.
        options = RebuildOptions(min_count=request.min_count or 1, ngram_size=request.ngram_size,
                                 base=not request.skip_base, decay=request.decay or 1.0,
                                 corpus=tuple(request.corpus), memory_budget=request.memory_budget or (1 << 30),
                                 keep=request.keep or rebuilder.default_keep, history=not request.skip_history)
        task = await rebuilder.start(request.namespace, options)
        job = await asyncio.shield(task) if request.wait else rebuilder.job(request.namespace)
        return self._status_message(job, rebuilder.holder)

    async def GetRebuildStatus(self, request: admin_pb2.GetRebuildStatusRequest,
                               context: aio.ServicerContext) -> admin_pb2.RebuildStatus:
        validate_namespace(request.namespace)
        rebuilder = self._need_rebuilder()
        await self._runner.call(self._store.namespace_info, request.namespace)  # NOT_FOUND for an unknown one
        return self._status_message(rebuilder.job(request.namespace), rebuilder.holder)

    def _need_rebuilder(self) -> Rebuilder:
        if self._rebuilder is None:
            raise InvalidArgumentError("this server runs no rebuilds")
        return self._rebuilder

    @staticmethod
    def _status_message(s: RebuildJob, holder: str) -> admin_pb2.RebuildStatus:
        return admin_pb2.RebuildStatus(
            namespace=s.namespace, state=s.state, phase=s.phase, generation=s.generation, lease_token=s.lease_token,
            started_unix_ms=s.started_unix_ms, finished_unix_ms=s.finished_unix_ms, previous_rows=s.previous_rows,
            dynamic_rows=s.dynamic_rows, corpus_tokens=s.corpus_tokens, n_keys=s.n_keys, n_followers=s.n_followers,
            file_bytes=s.file_bytes, error=s.error, holder=holder, history_tokens=s.history_tokens,
            base_generation=s.base_generation)

    async def _describe(self, info: NamespaceRecord) -> admin_pb2.Namespace:
        version = await self._runner.call(self._store.version, info.name)
        latest = 0
        if self._latest_generation is not None:
            latest = await asyncio.to_thread(self._latest_generation, info.name)
        return admin_pb2.Namespace(
            name=info.name, tokenizer_fingerprint=bytes.fromhex(info.fingerprint), vocab_size=info.vocab_size,
            buckets=info.buckets, shards=info.shards, instance=info.instance, counts_version=version,
            latest_generation=latest)

    async def _describe_if_present(self, info: NamespaceRecord) -> admin_pb2.Namespace | None:
        try:
            return await self._describe(info)
        except NamespaceNotFoundError:  # dropped since it was listed
            return None
