"""Static sync: the namespace's latest generation, listed, watched, fetched once per node, verified and attached to the drafter."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc

from ngramcache.client._core import StaticCache
from ngramcache.client._proto.v1 import static_files_pb2
from ngramcache.client.kernel.errors import CacheFormatError, NgramCacheError, TokenizerMismatchError
from ngramcache.client.kernel.retry import retry
from ngramcache.client.kernel.static_files import GenerationFiles
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.transport import Channel, error_from_rpc

__all__ = ["StaticSync"]

log = logging.getLogger("ngramcache.client.sync")


class StaticSync:
    """Keeps the drafter on the namespace's newest generation (a task of the background loop).

    Args:
        state: the shared sync state.
        files: the node's generation folder for the namespace (shared by its processes).
    """

    def __init__(self, state: SyncState, files: GenerationFiles) -> None:
        self.state = state
        self.files = files
        self.static: StaticCache | None = None
        self.ready = asyncio.Event()  # set once the first List is answered (and its generation attached)

    async def run(self) -> None:
        state, config = self.state, self.state.config

        async def initial() -> None:
            async def lst(chan: Channel) -> static_files_pb2.ListGenerationsResponse:
                resp: static_files_pb2.ListGenerationsResponse = await chan.files.List(
                    static_files_pb2.ListGenerationsRequest(namespace=config.namespace),
                    timeout=config.rpc_timeout, metadata=state.metadata)
                return resp

            gens = (await state.retrying("List", lst)).generations
            if gens:
                await self.adopt(gens[-1])
            self.ready.set()

        async def watch() -> None:
            chan = state.channels.current()
            try:
                stream = chan.files.Watch(static_files_pb2.WatchRequest(
                    namespace=config.namespace, after_generation=state.stats.generation), metadata=state.metadata)
                async for msg in stream:
                    if msg.generation.generation > state.stats.generation:
                        await self.adopt(msg.generation)
                await asyncio.sleep(0.2)  # the server ended the stream (shutting down): watch again
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if getattr(err, "code", None) == grpc.StatusCode.UNAVAILABLE:
                    await state.channels.switch(chan.epoch)
                raise err from None

        await state.once("static generations", initial)
        await state.forever("watch", watch)

    async def adopt(self, gen: static_files_pb2.Generation) -> None:
        """Make ``gen`` installed on this node (downloading it if no one did) and attach it."""
        state, config = self.state, self.state.config
        if gen.tokenizer_fingerprint != config.fingerprint or gen.vocab_size != config.vocab_size:
            raise TokenizerMismatchError(f"generation {gen.generation} is for another tokenizer")
        number = gen.generation
        while not self.files.try_lock():  # another process of the node downloads: wait for it
            await asyncio.sleep(0.05)
        try:
            if not self.files.installed(number, gen.size, gen.sha256):
                await self.download(gen)
            path = self.files.path(number)
            cache = await asyncio.to_thread(StaticCache.open, path)
            if cache.generation <= state.stats.generation:
                return
            state.drafter.set_static(cache)  # the old StaticCache is dropped; its mapping with it
            self.static = cache
            with state.lock:
                state.stats.generation = number
            self.files.prune(number, config.keep_generations)
        finally:
            self.files.unlock()

    async def download(self, gen: static_files_pb2.Generation) -> None:
        """Fetch ``gen`` into its .part file (resuming from its size), verify it whole and install it."""
        state, config = self.state, self.state.config
        number, part = gen.generation, self.files.part_path(gen.generation)

        async def fetch(chan: Channel) -> None:
            offset = part.stat().st_size if part.exists() else 0
            if offset > gen.size:
                part.unlink()
                offset = 0
            stream = chan.files.Fetch(static_files_pb2.FetchRequest(
                namespace=config.namespace, generation=number, offset=offset, expected_sha256=gen.sha256),
                metadata=state.metadata)
            with open(part, "ab") as f:
                try:
                    async for msg in stream:
                        if msg.WhichOneof("kind") != "chunk":
                            continue
                        if msg.chunk.offset != f.tell():
                            raise CacheFormatError(f"Fetch sent offset {msg.chunk.offset}, expected {f.tell()}")
                        f.write(msg.chunk.data)
                        with state.lock:
                            state.stats.downloaded_bytes += len(msg.chunk.data)
                finally:
                    f.flush()
                    os.fsync(f.fileno())

        async def fetch_and_verify() -> None:
            try:
                await state.retrying(f"Fetch {number}", fetch)
            except NgramCacheError as e:
                if getattr(e, "code", None) in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
                    part.unlink(missing_ok=True)  # not the same file any more: start again
                raise
            await asyncio.to_thread(self.files.verify_part, number, gen.sha256, config.fingerprint, config.vocab_size)

        def corrupt(e: CacheFormatError, attempt: int) -> float:  # a bad offset, or a whole file that fails its check
            log.warning("ngramcache client: downloaded generation %d is corrupt (%s); fetching it again", number, e)
            part.unlink(missing_ok=True)
            return 0.0

        try:  # a corrupt download starts again from byte 0, a bounded number of times
            await retry(fetch_and_verify, corrupt, errors=CacheFormatError, attempts=3)
        except CacheFormatError as e:
            raise CacheFormatError(f"generation {number} failed verification 3 times (the last: {e})") from None
        self.files.install(number, gen.sha256)
        with state.lock:
            state.stats.downloads += 1
