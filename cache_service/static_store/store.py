"""StaticStore: the static generation files of each namespace on disk (publish, list, open, watch, retain, drop)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import ChecksumMismatchError, InvalidArgumentError, NgramCacheError, OffsetOutOfRangeError

from ..counts.namespace import normalize_fingerprint
from . import retention
from .index import GenerationIndex
from .layout import (
    GenerationInfo,
    PublishResult,
    check_generation,
    check_namespace,
    check_sha256,
    check_size,
    generation_file_name,
    generation_not_found,
)
from .publish import publish_file
from .upload import GenerationReader, Upload
from .watch import Watchers, watch_generations

__all__ = ["StaticStore"]

T = TypeVar("T")


class StaticStore:
    """The static generation files of every namespace under one data directory.

    Generations only grow in a namespace, and a published file never changes; see
    `ngramcache.cache_service.static_store.layout` for the layout.

    Blocking: the coroutines (`publish`, `retain`, `drop`, `watch`, `open_reader` and
    `Upload`) run their file work (hashing, `verify()`, fsync) in threads
    (`asyncio.to_thread`) and never block the loop. The plain methods (`generations`,
    `latest`, `get`, `open`) read the directory: one listdir and a stat per file, plus an
    O(1) header read the first time a file is seen; they are cheap enough for the loop,
    except the first sight of a file without its SHA-256 sidecar (one copied in by
    hand), which hashes it: call them in a thread where that matters.

    Thread-safety: one store may be shared by any number of tasks, loops and threads. Its
    in-memory index is guarded by a lock; publish, retain and drop of one namespace are
    serialized by that namespace's lock (taken in a worker thread, never on a loop).
    Watchers are woken on their own loop. Several processes may share the directory: they read
    each other's generations (rescanned on every call, cached by file identity), a
    generation number is published at most once (hard link, no clobber), but watchers
    are only woken by publishes of their own process, and a process does not see another
    one's temporary files as in use (see `remove_leftovers`).

    Args:
        data_dir: the data directory (created if missing).
    """

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._index = GenerationIndex(self.data_dir)
        self._subscribers = Watchers()
        self._lock = threading.Lock()  # guards the dictionary of namespace locks
        self._namespace_locks: dict[str, threading.Lock] = {}

    def namespace_dir(self, namespace: str) -> Path:
        """The folder of ``namespace``'s generations (which may not exist yet)."""
        return self.data_dir / check_namespace(namespace)

    def path_of(self, namespace: str, generation: int) -> Path:
        """The path a generation has once published (whether or not it is)."""
        return self.namespace_dir(namespace) / generation_file_name(check_generation(generation))

    # Reading.

    def generations(self, namespace: str) -> list[GenerationInfo]:
        """The published generations of ``namespace``, oldest first (empty when none).

        Raises:
            InvalidArgumentError: a malformed namespace name.
        """
        return self._index.scan(check_namespace(namespace))

    def namespaces(self) -> list[str]:
        """The namespaces with at least one published generation, sorted. Blocking (lists folders)."""
        out = []
        for d in sorted(p for p in self.data_dir.iterdir() if p.is_dir()):
            try:
                if self.generations(d.name):
                    out.append(d.name)
            except NgramCacheError:
                continue  # not a namespace folder
        return out

    def latest(self, namespace: str) -> GenerationInfo | None:
        """The newest published generation of ``namespace``, or None."""
        found = self.generations(namespace)
        return found[-1] if found else None

    def get(self, namespace: str, generation: int = 0) -> GenerationInfo:
        """One generation; 0 means the latest.

        Raises:
            GenerationNotFoundError: it is not (or no longer) published.
            InvalidArgumentError: a malformed namespace name.
        """
        found = self.generations(namespace)
        if generation == 0 and found:
            return found[-1]
        for info in found:
            if info.generation == generation:
                return info
        raise generation_not_found(namespace, generation)

    def open(self, namespace: str, generation: int = 0) -> StaticCache:
        """The generation's file, memory-mapped once per process and shared by every caller.

        The mapping stays valid for its holders after the file is pruned or dropped
        (POSIX keeps an unlinked file's pages until the last mapping goes).

        Raises:
            GenerationNotFoundError: it is not published.
        """
        info = self.get(namespace, generation)
        entry = self._index.entry(namespace, info.generation)
        if entry is None:  # dropped between the two calls
            raise generation_not_found(namespace, info.generation)
        return entry.cache

    async def open_reader(self, namespace: str, generation: int = 0, *, offset: int = 0,
                          expected_sha256: bytes = b"") -> GenerationReader:
        """A reader of the generation's file from ``offset`` (for downloads); close it when done.

        The file is opened before this returns, so pruning it meanwhile does not break the read.

        Args:
            generation: the generation; 0 for the latest.
            offset: the first byte to read, in [0, size].
            expected_sha256: empty, or the SHA-256 the caller expects the file to have.

        Raises:
            GenerationNotFoundError: no such generation.
            ChecksumMismatchError: ``expected_sha256`` is another file's.
            OffsetOutOfRangeError: ``offset`` is past the end.
            InvalidArgumentError: ``expected_sha256`` neither empty nor 32 bytes.
        """
        if expected_sha256:
            check_sha256(expected_sha256)
        info = await self._run(self.get, namespace, generation)
        if expected_sha256 and expected_sha256 != info.sha256:
            raise ChecksumMismatchError(
                f"generation {info.generation} of {namespace!r} is not the file expected (SHA-256 "
                f"{info.sha256.hex()[:16]}..., not {expected_sha256.hex()[:16]}...): fetch it again from offset 0")
        if not 0 <= offset <= info.size:
            raise OffsetOutOfRangeError(f"offset {offset} is outside generation {info.generation} of {namespace!r} "
                                        f"({info.size} bytes)")
        path = self.path_of(namespace, info.generation)

        def open_at() -> BinaryIO:
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                raise generation_not_found(namespace, info.generation) from None
            f.seek(offset)
            return f

        return GenerationReader(info, await self._run(open_at), offset)

    # Writing.

    def upload(self, namespace: str, *, generation: int, size: int, sha256: bytes) -> Upload:
        """A new upload into ``namespace``: use it as ``async with``, `write` chunks, then `publish`.

        Args:
            generation: the generation the file declares in its header, >= 1.
            size: the file's exact size in bytes.
            sha256: the SHA-256 of the whole file, 32 bytes.

        Raises:
            InvalidArgumentError: a malformed argument.
        """
        check_namespace(namespace)
        check_generation(generation)
        check_size(size)
        return Upload(self.namespace_dir(namespace), self._publish, namespace, generation=generation, size=size,
                      sha256=check_sha256(sha256))

    async def publish(self, namespace: str, src_path: str | os.PathLike[str], *, fingerprint: bytes | str,
                      vocab_size: int, generation: int | None = None, size: int | None = None,
                      sha256: bytes | None = None) -> PublishResult:
        """Verify a complete file whole, then publish it atomically and wake the watchers.

        The store takes ownership of ``src_path``: it is renamed into place, or deleted
        whatever the outcome. It MUST be on the data directory's filesystem (`upload`
        writes into the namespace's folder).

        Args:
            namespace: the namespace (its folder is created if needed).
            src_path: the file, fully written.
            fingerprint: the namespace's tokenizer fingerprint (32 bytes or 64 hex digits).
            vocab_size: the namespace's vocabulary size.
            generation, size, sha256: when given, what the file must declare or be.

        Returns:
            The generation published, with ``already_published`` when this exact file was.

        Raises:
            CacheFormatError: not a valid static cache, or a section checksum is wrong.
            InvalidArgumentError: the file differs from ``generation``, ``size`` or
                ``sha256``, or its generation is 0.
            TokenizerMismatchError: its fingerprint or vocab_size is not the namespace's.
            GenerationNotNewerError: its generation is not above the latest.
            GenerationConflictError: that generation exists with another SHA-256.
            LimitExceededError: no disk space left.
        """
        return await self._publish(namespace, Path(src_path), fingerprint=fingerprint, vocab_size=vocab_size,
                                   generation=generation, size=size, sha256=sha256, known_sha256=None)

    async def _publish(self, namespace: str, src: Path, *, fingerprint: bytes | str, vocab_size: int,
                       generation: int | None, size: int | None, sha256: bytes | None,
                       known_sha256: bytes | None, restore: bool = False) -> PublishResult:
        """`publish`, with the SHA-256 an `Upload` computed while writing."""
        try:
            check_namespace(namespace)
            want_fp = bytes.fromhex(normalize_fingerprint(fingerprint))
        except BaseException:
            src.unlink(missing_ok=True)
            raise
        return await self._run(self._publish_sync, namespace, src, want_fp, int(vocab_size), generation, size,
                               sha256, known_sha256, restore)

    def _publish_sync(self, namespace: str, src: Path, fingerprint: bytes, vocab_size: int,
                      generation: int | None, size: int | None, sha256: bytes | None,
                      known_sha256: bytes | None, restore: bool) -> PublishResult:
        result = publish_file(self._index, self._namespace_lock(namespace), namespace, src, fingerprint=fingerprint,
                              vocab_size=vocab_size, generation=generation, size=size, sha256=sha256,
                              known_sha256=known_sha256, restore=restore)
        if not result.already_published and not restore:
            self._subscribers.wake(namespace)
        return result

    async def retain(self, namespace: str, keep: int, *, protect: int = 0) -> list[int]:
        """Delete all but the newest ``keep`` generations and ``protect``; returns the generations deleted.

        ``protect`` (0: none) is the namespace's corpus base, which every rebuild folds in
        (`CommittedGeneration.base`): it stays whatever its age.

        Processes that mapped a deleted file keep reading it (POSIX unlink semantics);
        downloads already started finish (`open_reader` holds the file open).

        Raises:
            InvalidArgumentError: ``keep`` < 1 (the latest generation is always kept, so
                the next publish can be checked against it).
        """
        check_namespace(namespace)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(f"keep must be >= 1, got {keep!r}")
        return await self._run(self._retain_sync, namespace, keep, protect)

    def _retain_sync(self, namespace: str, keep: int, protect: int) -> list[int]:
        with self._namespace_lock(namespace):
            return retention.prune(self._index, namespace, keep, protect=protect)

    async def drop(self, namespace: str) -> bool:
        """Delete every generation of ``namespace`` (uploads in progress included); end its watchers.

        Returns whether the namespace had a folder. Generation numbers start again from any
        value afterwards (a recreated namespace is a new one).
        """
        check_namespace(namespace)
        return await self._run(self._drop_sync, namespace)

    def _drop_sync(self, namespace: str) -> bool:
        with self._namespace_lock(namespace):
            existed = retention.remove_namespace(self._index, namespace)
            self._subscribers.end(namespace)
            return existed

    # Watching.

    def watch(self, namespace: str, after_generation: int = 0) -> AsyncIterator[GenerationInfo]:
        """Every generation above ``after_generation``, oldest first, then each new one as published.

        Never ends by itself; stop iterating (or cancel) to stop. A watcher holds one
        wake-up flag, not a queue: a publish only sets it (never blocks, never grows
        memory), and the watcher reads the generations above the last one it yielded, so a
        slow watcher skips none that still exist and sees them in order.

        Raises:
            InvalidArgumentError: a malformed namespace name.
            NamespaceNotFoundError: the namespace was dropped (`drop`) while watching.
        """
        return watch_generations(self._subscribers, self._scan_in_thread, namespace, after_generation)

    async def _scan_in_thread(self, namespace: str) -> list[GenerationInfo]:
        return await self._run(self._index.scan, namespace)

    # Startup.

    def remove_leftovers(self, min_age_seconds: float = 0.0) -> list[Path]:
        """Delete what a crash can leave in the data directory; call once at startup. Blocking.

        Removes temporary files (``*.tmp``, ``*.tmp.*``) at least ``min_age_seconds`` old,
        sidecars without their generation, and generation files whose header does not
        open (checked in O(1), not verified). Other files are left alone (and ignored).
        When several processes share the directory, pass an age longer than any upload
        takes, so another process's upload in progress is not deleted.

        Returns:
            The paths deleted.
        """
        return retention.remove_leftovers(self.data_dir, min_age_seconds)

    # Blocking internals.

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(fn, *args)

    def _namespace_lock(self, namespace: str) -> threading.Lock:
        with self._lock:
            return self._namespace_locks.setdefault(namespace, threading.Lock())
