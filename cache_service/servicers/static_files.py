"""The StaticFiles servicer: List, Fetch, Watch and Publish over the `StaticStore`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from grpc import aio

from ngramcache.client._proto.v1 import static_files_pb2, static_files_pb2_grpc
from ngramcache.client.kernel.errors import GenerationConflictError, GenerationNotNewerError, InvalidArgumentError

from ..counts.namespace import NamespaceRecord
from ..rebuild import Rebuilder
from ..static_store import GenerationInfo, PublishResult, StaticStore, publish_refused
from ..status import limit_exceeded
from ..store_runner import StoreRunner

MAX_CHUNK_BYTES = 1 << 20
"""Most bytes of a Fetch chunk (static_files.proto: at most 1 MiB when the server sends)."""


def generation_pb(info: GenerationInfo) -> static_files_pb2.Generation:
    """The wire form of a generation."""
    return static_files_pb2.Generation(
        namespace=info.namespace, generation=info.generation, size=info.size, sha256=info.sha256,
        tokenizer_fingerprint=info.fingerprint, vocab_size=info.vocab_size, created_unix_ms=info.created_unix_ms,
        ngram_size=info.ngram_size, n_keys=info.n_keys, n_followers=info.n_followers)


class StaticFilesServicer(static_files_pb2_grpc.StaticFilesServicer):
    """List, Fetch, Watch and Publish static generation files.

    Every RPC first looks its namespace up in the counts store (NOT_FOUND when it does not
    exist; Publish takes the tokenizer to check from there), then calls the static store.

    Thread-safety: handlers run on the server's event loop; file I/O runs on the store's
    executor, counts store calls on the runner's pool.

    Args:
        store: the generation files.
        runner: the executor that owns the counts store (namespace records).
        max_file_bytes: the largest file Publish accepts (ServerLimits.max_static_file_bytes).
        chunk_bytes: bytes of a Fetch chunk, at most 1 MiB.
        rebuilder: when given, a Publish takes the namespace's rebuild lease and commits its
            generation number in the counts store, as a rebuild does (other replicas fetch it,
            and no replica publishes that number again).
    """

    def __init__(self, store: StaticStore, runner: StoreRunner, *, max_file_bytes: int,
                 chunk_bytes: int = MAX_CHUNK_BYTES, rebuilder: Rebuilder | None = None) -> None:
        self._rebuilder = rebuilder
        if max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}]")
        self._store = store
        self._runner = runner
        self.max_file_bytes = max_file_bytes
        self.chunk_bytes = chunk_bytes

    async def _namespace(self, namespace: str) -> NamespaceRecord:
        # InvalidArgumentError for a malformed name, NamespaceNotFoundError for an unknown one.
        return await self._runner.call(self._runner.store.namespace_info, namespace)

    async def List(self, request: static_files_pb2.ListGenerationsRequest,
                   context: aio.ServicerContext) -> static_files_pb2.ListGenerationsResponse:
        await self._namespace(request.namespace)
        found = await asyncio.to_thread(self._store.generations, request.namespace)
        return static_files_pb2.ListGenerationsResponse(generations=[generation_pb(info) for info in found])

    async def Fetch(self, request: static_files_pb2.FetchRequest,
                    context: aio.ServicerContext) -> AsyncIterator[static_files_pb2.FetchResponse]:
        await self._namespace(request.namespace)
        reader = await self._store.open_reader(request.namespace, request.generation, offset=request.offset,
                                               expected_sha256=request.expected_sha256)
        async with reader:
            yield static_files_pb2.FetchResponse(header=generation_pb(reader.info))
            while True:
                offset = reader.offset
                data = await reader.read(self.chunk_bytes)
                if not data:
                    return
                yield static_files_pb2.FetchResponse(chunk=static_files_pb2.FileChunk(offset=offset, data=data))

    async def Watch(self, request: static_files_pb2.WatchRequest,
                    context: aio.ServicerContext) -> AsyncIterator[static_files_pb2.WatchResponse]:
        await self._namespace(request.namespace)
        async for info in self._store.watch(request.namespace, request.after_generation):
            yield static_files_pb2.WatchResponse(generation=generation_pb(info))

    async def Publish(self, request_iterator: AsyncIterator[static_files_pb2.PublishRequest],
                      context: aio.ServicerContext) -> static_files_pb2.PublishResponse:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgumentError("the first message of a Publish must be its header")
        header = first.header
        if header.size > self.max_file_bytes:
            raise limit_exceeded(f"a static file has at most {self.max_file_bytes} bytes, this one {header.size}")
        if header.generation == 0:  # before any byte is sent: the refusal names the fix
            namespace = await self._namespace(header.namespace)
            raise publish_refused(namespace.name, 0, await self._latest(namespace.name))
        upload = self._store.upload(header.namespace, generation=header.generation, size=header.size,
                                    sha256=header.sha256)
        namespace = await self._namespace(header.namespace)
        latest = await self._latest(namespace.name)
        if header.generation < latest:
            raise publish_refused(namespace.name, header.generation, latest)
        async with upload:  # a failed or abandoned upload leaves no file behind
            async for request in requests:
                if request.WhichOneof("kind") != "chunk":
                    raise InvalidArgumentError("a Publish has one header, then only chunks")
                await upload.write(request.chunk.offset, request.chunk.data)
            def publish() -> Awaitable[PublishResult]:
                return upload.publish(fingerprint=namespace.fingerprint, vocab_size=namespace.vocab_size)

            try:
                if self._rebuilder is not None:
                    result = await self._rebuilder.committed_publish(namespace.name, header.generation, publish)
                else:
                    result = await publish()
            except GenerationNotNewerError:  # another publish or rebuild got there first
                raise publish_refused(namespace.name, header.generation, await self._latest(namespace.name)) from None
            except GenerationConflictError as e:  # the same number with other content
                latest = await self._latest(namespace.name)
                raise GenerationConflictError(
                    f"{e}: build the file again with `ngramcache build --generation N`, N > {latest}") from None
        return static_files_pb2.PublishResponse(generation=generation_pb(result.generation),
                                                already_published=result.already_published)

    async def _latest(self, namespace: str) -> int:
        """The namespace's latest generation: this replica's, or the one committed in the store if above."""
        local = await asyncio.to_thread(self._store.latest, namespace)
        committed = await self._runner.call(self._runner.store.committed_generation, namespace)
        return max(local.generation if local else 0, committed.generation)
