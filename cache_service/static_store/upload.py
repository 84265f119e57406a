"""Transfers of whole files: an `Upload` received chunk by chunk into a namespace's folder, and a `GenerationReader` for downloads."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

from ngramcache.client.kernel.errors import InvalidArgumentError, LimitExceededError
from ngramcache.client.kernel.files import is_disk_full

from .layout import GenerationInfo, PublishResult

__all__ = ["GenerationReader", "PublishUpload", "Upload"]


class PublishUpload(Protocol):
    """What publishes a complete upload (`StaticStore._publish`): verifies ``src`` and links it into place.

    It takes ownership of ``src`` (renamed into place, or deleted whatever the outcome).
    """

    async def __call__(self, namespace: str, src: Path, *, fingerprint: bytes | str, vocab_size: int,
                       generation: int | None, size: int | None, sha256: bytes | None,
                       known_sha256: bytes | None, restore: bool = False) -> PublishResult: ...


class Upload:
    """A file being received into a namespace's folder, ended by `publish` or discarded.

    Use it as ``async with store.upload(...) as up``: chunks go to ``up.write`` in file
    order, then ``await up.publish(...)``; leaving the block any other way (an error, a
    cancelled call, a client gone) deletes the partial file. The SHA-256 is computed as
    the bytes are written. Not thread-safe: one task drives an upload.

    Args:
        namespace_dir: the namespace's folder (created on entry if missing); the partial file is written there,
            on the data directory's filesystem, so publishing renames it.
        publish: publishes the complete file (`StaticStore._publish`).
    """

    def __init__(self, namespace_dir: Path, publish: PublishUpload, namespace: str, *, generation: int, size: int,
                 sha256: bytes) -> None:
        self.namespace = namespace
        self.generation = generation
        self.size = size
        self.sha256 = sha256
        self.received = 0
        self.path: Path | None = None
        self._namespace_dir = namespace_dir
        self._publish = publish
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._done = False

    async def __aenter__(self) -> Upload:
        self._file = await asyncio.to_thread(self._create)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.discard()

    def _create(self) -> BinaryIO:
        ns_dir = self._namespace_dir
        try:
            ns_dir.mkdir(parents=True, exist_ok=True)
            self.path = ns_dir / f"upload-{secrets.token_hex(8)}.tmp"
            return open(self.path, "xb")
        except OSError as exc:
            if is_disk_full(exc):
                raise LimitExceededError("no disk space left for an upload") from exc
            raise

    async def write(self, offset: int, data: bytes) -> None:
        """Append the bytes at ``offset`` of the file.

        Raises:
            InvalidArgumentError: ``offset`` is not the bytes received so far, or the data
                goes past the declared size.
            LimitExceededError: the disk is full.
        """
        if self._file is None or self._done:
            raise RuntimeError("write() outside `async with`, or after publish()")
        if offset != self.received:
            raise InvalidArgumentError(f"a chunk at offset {offset}; the next byte expected is {self.received}")
        if len(data) > self.size - self.received:
            raise InvalidArgumentError(f"the upload goes past its declared size of {self.size} bytes")
        await asyncio.to_thread(self._write, self._file, data)
        self.received += len(data)

    def _write(self, f: BinaryIO, data: bytes) -> None:
        try:
            f.write(data)
        except OSError as exc:
            if is_disk_full(exc):
                raise LimitExceededError("no disk space left for the upload") from exc
            raise
        self._hash.update(data)

    async def publish(self, *, fingerprint: bytes | str, vocab_size: int, restore: bool = False) -> PublishResult:
        """Verify the complete upload and publish it (`StaticStore.publish`, same errors).

        With ``restore``, a generation below the latest may be installed (a rebuild's corpus base
        fetched from a peer); watchers are not woken (they follow the latest).

        Raises:
            InvalidArgumentError: fewer bytes were received than the declared size.
        """
        if self._file is None or self._done or self.path is None:
            raise RuntimeError("publish() outside `async with`, or twice")
        if self.received != self.size:
            raise InvalidArgumentError(f"the upload ended after {self.received} of its {self.size} bytes")
        f, self._file = self._file, None
        self._done = True
        try:
            await asyncio.to_thread(f.close)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise LimitExceededError("no disk space left for the upload") from exc
            raise
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        return await self._publish(
            self.namespace, self.path, fingerprint=fingerprint, vocab_size=vocab_size, generation=self.generation,
            size=self.size, sha256=self.sha256, known_sha256=self._hash.digest(), restore=restore)

    def discard(self) -> None:
        """Delete the partial file (nothing when it was handed to publish)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if not self._done and self.path is not None:
            self.path.unlink(missing_ok=True)
        self._done = True


class GenerationReader:
    """An open generation file read from an offset (a download); close it when done.

    Not thread-safe: one task reads it. Async context manager.

    Attributes:
        info: the generation being read.
        offset: the byte offset of the next read.
    """

    def __init__(self, info: GenerationInfo, f: BinaryIO, offset: int) -> None:
        self.info = info
        self.offset = offset
        self._file = f

    async def read(self, max_bytes: int) -> bytes:
        """The next bytes, at most ``max_bytes``; empty at the end of the file."""
        data = await asyncio.to_thread(self._file.read, min(max_bytes, self.info.size - self.offset))
        self.offset += len(data)
        return data

    def close(self) -> None:
        self._file.close()

    async def __aenter__(self) -> GenerationReader:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()
