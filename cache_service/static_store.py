"""StaticStore: the static generation files of each namespace on disk (publish, list, open, watch, retain, drop).

Layout of the data directory (one folder per namespace; the service's is ``<its data_dir>/static``)::

    <data_dir>/<namespace>/00000000000000000007.ngc      generation 7: a static cache file
    <data_dir>/<namespace>/00000000000000000007.sha256   its SHA-256, in `sha256sum` format
    <data_dir>/<namespace>/upload-<random>.tmp           an upload being received

A generation's file name is its number in 20 decimal digits (every uint64 fits), so names
sort like numbers. A generation file is immutable once visible: it is verified whole under
a temporary name, then hard-linked to its final name (which fails if the name exists, so
not even another process sharing the directory can replace a published file), and the
directory is fsynced. Its SHA-256 is computed once, while verifying, and kept in the
sidecar (written after the file is visible; a missing or unreadable sidecar is recomputed
from the file, so a crash between the two is harmless). Any other name (`*.tmp` and
`*.tmp.*` left by a crash mid-upload or mid-write, a sidecar without its file, a file
whose header does not open) is ignored by every reader and removed by `remove_leftovers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Final, TypeVar

import grpc

from ngramcache.client._core import StaticCache, write_file_atomic
from ngramcache.client.errors import (
    CacheFormatError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    NgramCacheError,
    TokenizerMismatchError,
)

from .counts.namespace import normalize_fingerprint, validate_namespace
from .status import CHECKSUM_MISMATCH, GENERATION_NOT_NEWER, ServiceError, limit_exceeded

__all__ = [
    "GENERATION_DIGITS",
    "GenerationInfo",
    "GenerationReader",
    "PublishResult",
    "StaticStore",
    "Upload",
    "generation_file_name",
]

log = logging.getLogger("ngramcache.service")

T = TypeVar("T")

GENERATION_DIGITS: Final = 20
"""Digits of a generation's file name: zero-padded, so names sort like numbers (2^64 - 1 has 20)."""

SHA256_SIZE: Final = 32
"""Bytes of a SHA-256 digest."""

_MAX_GENERATION: Final = 2**64 - 1
_READ_BYTES: Final = 1 << 20
_GENERATION_RE: Final = re.compile(r"(\d{20})\.ngc")
_SIDECAR_RE: Final = re.compile(r"(\d{20})\.sha256")
# Temporary names: ours (upload-*.tmp) and the native atomic writer's (<target>.tmp.<pid>.<hex>).
_TEMPORARY_RE: Final = re.compile(r".*\.tmp(\..*)?")
_SIDECAR_LINE_RE: Final = re.compile(rb"([0-9a-f]{64})  \S+\n?")
_DISK_FULL: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
# Filesystems without hard links: publish falls back to rename (no protection against another process).
_NO_LINKS: Final = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def generation_file_name(generation: int) -> str:
    """The file name of a generation: ``{generation:020d}.ngc``."""
    return f"{generation:0{GENERATION_DIGITS}d}.ngc"


def _sidecar_name(generation: int) -> str:
    return f"{generation:0{GENERATION_DIGITS}d}.sha256"


@dataclasses.dataclass(frozen=True)
class GenerationInfo:
    """One published generation (the fields of ngramcache.v1.Generation).

    Attributes:
        namespace: the namespace it belongs to.
        generation: its number, >= 1; numbers only grow within a namespace.
        size: the file's size in bytes.
        sha256: SHA-256 of the whole file, 32 bytes.
        fingerprint: the tokenizer fingerprint in the file's header, 32 bytes.
        vocab_size: the vocabulary size in the file's header.
        created_unix_ms: when it was published (the file's mtime), ms since the Unix epoch.
        ngram_size: tokens per key, 1..4.
        n_keys: distinct keys in the file.
        n_followers: distinct (key, follower) pairs in the file.
    """

    namespace: str
    generation: int
    size: int
    sha256: bytes
    fingerprint: bytes
    vocab_size: int
    created_unix_ms: int
    ngram_size: int
    n_keys: int
    n_followers: int


@dataclasses.dataclass(frozen=True)
class PublishResult:
    """What `StaticStore.publish` did.

    Attributes:
        generation: the generation, now visible.
        already_published: True when this exact file (same generation and SHA-256) had
            been published before; the new copy was discarded.
    """

    generation: GenerationInfo
    already_published: bool


# (st_dev, st_ino, st_size, st_mtime_ns): a file's identity; a cached entry is reused only
# while the file on disk still has it (a namespace dropped and published again gets new files).
_Identity = tuple[int, int, int, int]


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclasses.dataclass(frozen=True)
class _Entry:
    identity: _Identity
    info: GenerationInfo
    cache: StaticCache


class _Subscriber:
    """A watcher's wake-up flag: set (from any thread) when its namespace changes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.dropped = False

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: the watcher is gone
            self.loop.call_soon_threadsafe(self.event.set)


def generation_not_found(namespace: str, generation: int) -> ServiceError:
    """NOT_FOUND for a generation that was never published in ``namespace`` (or was pruned)."""
    what = "no generation" if generation == 0 else f"no generation {generation}"
    return ServiceError(grpc.StatusCode.NOT_FOUND, f"namespace {namespace!r} has {what}")


def _check_namespace(namespace: str) -> str:
    validate_namespace(namespace)
    if namespace in (".", ".."):  # legal characters, but not a folder of the data directory
        raise InvalidArgumentError(f"namespace {namespace!r} is not a valid static file namespace")
    return namespace


def _check_generation(generation: int) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) or not 1 <= generation <= _MAX_GENERATION:
        raise InvalidArgumentError(f"generation must be in [1, 2**64), got {generation!r}")
    return generation


def _check_sha256(sha256: bytes) -> bytes:
    if not isinstance(sha256, bytes) or len(sha256) != SHA256_SIZE:
        raise InvalidArgumentError(f"sha256 must be {SHA256_SIZE} bytes")
    return sha256


def _sha256_of(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            h.update(block)
    return h.digest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(exc: OSError) -> bool:
    return exc.errno in _DISK_FULL


class StaticStore:
    """The static generation files of every namespace under one data directory.

    Generations only grow in a namespace, and a published file never changes; see the
    module docstring for the layout.

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
        self._lock = threading.Lock()  # guards the dictionaries below
        self._entries: dict[str, dict[int, _Entry]] = {}
        self._bad: set[tuple[str, int, _Identity]] = set()  # invalid files already logged
        self._namespace_locks: dict[str, threading.Lock] = {}
        self._subscribers: dict[str, set[_Subscriber]] = {}

    # ----------------------------------------------------------------------------- paths

    def namespace_dir(self, namespace: str) -> Path:
        """The folder of ``namespace``'s generations (which may not exist yet)."""
        return self.data_dir / _check_namespace(namespace)

    def path_of(self, namespace: str, generation: int) -> Path:
        """The path a generation has once published (whether or not it is)."""
        return self.namespace_dir(namespace) / generation_file_name(_check_generation(generation))

    # ----------------------------------------------------------------------- reading

    def generations(self, namespace: str) -> list[GenerationInfo]:
        """The published generations of ``namespace``, oldest first (empty when none).

        Raises:
            InvalidArgumentError: a malformed namespace name.
        """
        return self._scan(_check_namespace(namespace))

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
            ServiceError: NOT_FOUND when it is not (or no longer) published.
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
            ServiceError: NOT_FOUND when it is not published.
        """
        info = self.get(namespace, generation)
        with self._lock:
            entry = self._entries.get(namespace, {}).get(info.generation)
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
            ServiceError: NOT_FOUND (no such generation); FAILED_PRECONDITION reason
                CHECKSUM_MISMATCH (``expected_sha256`` is another file's); OUT_OF_RANGE
                (``offset`` past the end).
            InvalidArgumentError: ``expected_sha256`` neither empty nor 32 bytes.
        """
        if expected_sha256:
            _check_sha256(expected_sha256)
        info = await self._run(self.get, namespace, generation)
        if expected_sha256 and expected_sha256 != info.sha256:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"generation {info.generation} of {namespace!r} is not the file expected (SHA-256 "
                f"{info.sha256.hex()[:16]}..., not {expected_sha256.hex()[:16]}...): fetch it again from offset 0",
                CHECKSUM_MISMATCH)
        if not 0 <= offset <= info.size:
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE,
                               f"offset {offset} is outside generation {info.generation} of {namespace!r} "
                               f"({info.size} bytes)")
        path = self.path_of(namespace, info.generation)

        def open_at() -> BinaryIO:
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                raise generation_not_found(namespace, info.generation) from None
            f.seek(offset)
            return f

        return GenerationReader(self, info, await self._run(open_at), offset)

    # ----------------------------------------------------------------------- writing

    def upload(self, namespace: str, *, generation: int, size: int, sha256: bytes) -> Upload:
        """A new upload into ``namespace``: use it as ``async with``, `write` chunks, then `publish`.

        Args:
            generation: the generation the file declares in its header, >= 1.
            size: the file's exact size in bytes.
            sha256: the SHA-256 of the whole file, 32 bytes.

        Raises:
            InvalidArgumentError: a malformed argument.
        """
        _check_namespace(namespace)
        _check_generation(generation)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a byte count >= 0, got {size!r}")
        return Upload(self, namespace, generation=generation, size=size, sha256=_check_sha256(sha256))

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
            ServiceError: FAILED_PRECONDITION reason GENERATION_NOT_NEWER (not above the
                latest); ALREADY_EXISTS reason CHECKSUM_MISMATCH (that generation exists
                with another SHA-256); RESOURCE_EXHAUSTED (no disk space).
        """
        return await self._publish(namespace, Path(src_path), fingerprint=fingerprint, vocab_size=vocab_size,
                                   generation=generation, size=size, sha256=sha256, known_sha256=None)

    async def _publish(self, namespace: str, src: Path, *, fingerprint: bytes | str, vocab_size: int,
                       generation: int | None, size: int | None, sha256: bytes | None,
                       known_sha256: bytes | None) -> PublishResult:
        try:
            _check_namespace(namespace)
            want_fp = bytes.fromhex(normalize_fingerprint(fingerprint))
        except BaseException:
            src.unlink(missing_ok=True)
            raise
        return await self._run(self._publish_sync, namespace, src, want_fp, int(vocab_size), generation, size,
                               sha256, known_sha256)

    async def retain(self, namespace: str, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` generations; returns the generations deleted.

        Processes that mapped a deleted file keep reading it (POSIX unlink semantics);
        downloads already started finish (`open_reader` holds the file open).

        Raises:
            InvalidArgumentError: ``keep`` < 1 (the latest generation is always kept, so
                the next publish can be checked against it).
        """
        _check_namespace(namespace)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(f"keep must be >= 1, got {keep!r}")
        return await self._run(self._retain_sync, namespace, keep)

    async def drop(self, namespace: str) -> bool:
        """Delete every generation of ``namespace`` (uploads in progress included); end its watchers.

        Returns whether the namespace had a folder. Generation numbers start again from any
        value afterwards (a recreated namespace is a new one).
        """
        _check_namespace(namespace)
        return await self._run(self._drop_sync, namespace)

    # ------------------------------------------------------------------------ watching

    async def watch(self, namespace: str, after_generation: int = 0) -> AsyncIterator[GenerationInfo]:
        """Every generation above ``after_generation``, oldest first, then each new one as published.

        Never ends by itself; stop iterating (or cancel) to stop. A watcher holds one
        wake-up flag, not a queue: a publish only sets it (never blocks, never grows
        memory), and the watcher reads the generations above the last one it yielded, so a
        slow watcher skips none that still exist and sees them in order.

        Raises:
            NamespaceNotFoundError: the namespace was dropped (`drop`) while watching.
        """
        _check_namespace(namespace)
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            self._subscribers.setdefault(namespace, set()).add(sub)
        try:
            last = after_generation
            while True:
                sub.event.clear()  # before reading: a publish from now on wakes the wait below
                if sub.dropped:
                    raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped")
                for info in await self._run(self._scan, namespace):
                    if info.generation > last:
                        yield info
                        last = info.generation
                await sub.event.wait()
        finally:
            with self._lock:
                subs = self._subscribers.get(namespace)
                if subs is not None:
                    subs.discard(sub)
                    if not subs:
                        del self._subscribers[namespace]

    # ----------------------------------------------------------------------- startup

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
        removed: list[Path] = []
        now = time.time()
        for ns_dir in sorted(self.data_dir.iterdir()):
            if not ns_dir.is_dir() or ns_dir.is_symlink():
                continue
            try:
                names = set(os.listdir(ns_dir))
            except OSError as exc:
                log.warning("cannot list %s: %s", ns_dir, exc)
                continue
            removed_here = 0
            for name in sorted(names):
                for path in self._leftovers(ns_dir, name, names, now - min_age_seconds):
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        log.warning("cannot remove %s: %s", path, exc)
                        continue
                    log.info("removed leftover %s", path)
                    removed.append(path)
                    removed_here += 1
            if removed_here:
                _fsync_dir(ns_dir)
        return removed

    @staticmethod
    def _leftovers(ns_dir: Path, name: str, names: set[str], older_than: float) -> list[Path]:
        """What of ``ns_dir/name`` `remove_leftovers` deletes."""
        path = ns_dir / name
        try:
            if _TEMPORARY_RE.fullmatch(name):
                return [path] if path.lstat().st_mtime <= older_than else []
            if m := _SIDECAR_RE.fullmatch(name):
                return [] if generation_file_name(int(m[1])) in names else [path]
            if m := _GENERATION_RE.fullmatch(name):
                try:
                    if StaticCache.open(path).generation != int(m[1]):
                        raise CacheFormatError(f"{path}: its header says another generation")
                except CacheFormatError as exc:
                    log.warning("removing an invalid generation file: %s", exc)
                    return [path, ns_dir / _sidecar_name(int(m[1]))]
        except OSError as exc:
            log.warning("cannot check %s: %s", path, exc)
        return []

    # ------------------------------------------------------------ blocking internals

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(fn, *args)

    def _namespace_lock(self, namespace: str) -> threading.Lock:
        with self._lock:
            return self._namespace_locks.setdefault(namespace, threading.Lock())

    def _scan(self, namespace: str) -> list[GenerationInfo]:
        """The namespace's valid generations on disk, with cached entries reused by file identity."""
        ns_dir = self.data_dir / namespace
        try:
            names = os.listdir(ns_dir)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        with self._lock:
            known = dict(self._entries.get(namespace, {}))
        found: dict[int, _Entry] = {}
        for name in names:
            m = _GENERATION_RE.fullmatch(name)
            if m is None:
                continue
            generation = int(m[1])
            if not 1 <= generation <= _MAX_GENERATION:
                continue
            try:
                st = os.stat(ns_dir / name)
            except FileNotFoundError:  # pruned meanwhile
                continue
            entry = known.get(generation)
            if entry is None or entry.identity != _identity(st):
                entry = self._load(namespace, generation, st)
                if entry is None:
                    continue
            found[generation] = entry
        with self._lock:
            # Keep an entry another thread cached meanwhile for the same file: one mapping each.
            current = self._entries.setdefault(namespace, {})
            for generation, entry in found.items():
                other = current.get(generation)
                if other is not None and other.identity == entry.identity:
                    found[generation] = other
            self._entries[namespace] = found
            if not found:
                del self._entries[namespace]
        return [found[g].info for g in sorted(found)]

    def _load(self, namespace: str, generation: int, st: os.stat_result) -> _Entry | None:
        """Opens a generation file found on disk; None (logged once) when it is not a valid one."""
        path = self.data_dir / namespace / generation_file_name(generation)
        try:
            cache = StaticCache.open(path)
            if cache.generation != generation:
                raise CacheFormatError(f"{path}: its header says generation {cache.generation}")
            digest = self._read_sidecar(namespace, generation)
            if digest is None:
                digest = _sha256_of(path)
                with contextlib.suppress(OSError):  # a read-only directory: keep it in memory only
                    write_file_atomic(self.data_dir / namespace / _sidecar_name(generation),
                                      f"{digest.hex()}  {path.name}\n".encode())
        except FileNotFoundError:
            return None
        except (CacheFormatError, OSError) as exc:
            key = (namespace, generation, _identity(st))
            with self._lock:
                first = key not in self._bad
                self._bad.add(key)
            if first:
                log.warning("ignoring %s: %s", path, exc)
            return None
        return _Entry(_identity(st), self._info(namespace, cache, st, digest), cache)

    @staticmethod
    def _info(namespace: str, cache: StaticCache, st: os.stat_result, digest: bytes) -> GenerationInfo:
        return GenerationInfo(
            namespace=namespace, generation=cache.generation, size=st.st_size, sha256=digest,
            fingerprint=cache.fingerprint, vocab_size=cache.vocab_size, created_unix_ms=st.st_mtime_ns // 1_000_000,
            ngram_size=cache.ngram_size, n_keys=cache.n_keys, n_followers=cache.n_followers)

    def _read_sidecar(self, namespace: str, generation: int) -> bytes | None:
        try:
            data = (self.data_dir / namespace / _sidecar_name(generation)).read_bytes()
        except OSError:
            return None
        m = _SIDECAR_LINE_RE.fullmatch(data)
        return bytes.fromhex(m[1].decode()) if m else None

    def _publish_sync(self, namespace: str, src: Path, fingerprint: bytes, vocab_size: int,
                      generation: int | None, size: int | None, sha256: bytes | None,
                      known_sha256: bytes | None) -> PublishResult:
        published = False
        try:
            try:
                st = os.stat(src)
            except FileNotFoundError:
                # Uploads live in the namespace's folder, which `drop` deletes whole.
                raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped during the upload") from None
            if size is not None and st.st_size != size:
                raise InvalidArgumentError(f"the file has {st.st_size} bytes, not the declared size of {size}")
            digest = known_sha256 if known_sha256 is not None else _sha256_of(src)
            if sha256 is not None and digest != sha256:
                raise InvalidArgumentError(
                    f"the file's SHA-256 is {digest.hex()[:16]}..., not the {sha256.hex()[:16]}... declared")
            cache = StaticCache.open(src)
            cache.verify()
            if generation is not None and cache.generation != generation:
                raise InvalidArgumentError(
                    f"the file's header says generation {cache.generation}, not the {generation} declared")
            if cache.generation < 1:
                raise InvalidArgumentError("a published generation must be >= 1; the file's header says 0")
            if cache.fingerprint != fingerprint:
                raise TokenizerMismatchError(
                    f"namespace {namespace!r} is bound to tokenizer {fingerprint.hex()[:16]}..., "
                    f"the file to {cache.fingerprint.hex()[:16]}...")
            if cache.vocab_size != vocab_size:
                raise TokenizerMismatchError(
                    f"namespace {namespace!r} has vocab_size {vocab_size}, the file {cache.vocab_size}")
            with self._namespace_lock(namespace):
                result = self._commit(namespace, src, cache, digest)
                published = not result.already_published
                return result
        except OSError as exc:
            if _disk_full(exc):
                raise limit_exceeded(f"no disk space left to publish into {namespace!r}") from exc
            raise
        finally:
            if not published:
                src.unlink(missing_ok=True)

    def _commit(self, namespace: str, src: Path, cache: StaticCache, digest: bytes) -> PublishResult:
        """Publishes a verified file (the namespace's lock held): check numbers, link, fsync, announce."""
        generation = cache.generation
        existing = self._scan(namespace)
        for info in existing:
            if info.generation == generation:
                return self._same_generation(info, digest)
        if existing and generation <= existing[-1].generation:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"generation {generation} is not above {existing[-1].generation}, the latest of {namespace!r}",
                GENERATION_NOT_NEWER)
        ns_dir = self.data_dir / namespace
        if not ns_dir.is_dir():  # a file built elsewhere: its namespace's first generation
            ns_dir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.data_dir)
        final = ns_dir / generation_file_name(generation)
        # A sidecar without its file (a crash's leftover) must not be read as this file's.
        (ns_dir / _sidecar_name(generation)).unlink(missing_ok=True)
        now_ns = time.time_ns()
        os.utime(src, ns=(now_ns, now_ns))  # created_unix_ms is the file's mtime
        _fsync_file(src)
        st = os.stat(src)  # the published file is this inode: its identity does not change
        entry = _Entry(_identity(st), self._info(namespace, cache, st, digest), cache)
        # Cached before the name appears, so a concurrent scan does not hash the file again.
        with self._lock:
            self._entries.setdefault(namespace, {})[generation] = entry
        linked = False
        try:
            linked = self._link(src, final)
        finally:
            if not linked:
                with self._lock:
                    self._entries.get(namespace, {}).pop(generation, None)
        if not linked:  # another process published this generation between the scan and the link
            for info in self._scan(namespace):
                if info.generation == generation:
                    return self._same_generation(info, digest)
            raise generation_not_found(namespace, generation)  # and pruned or dropped it already
        _fsync_dir(ns_dir)
        with contextlib.suppress(CacheFormatError, OSError):  # the same inode, mapped under its final name
            entry = dataclasses.replace(entry, cache=StaticCache.open(final))
        with self._lock:  # again: a scan between the insert above and the link dropped it
            self._entries.setdefault(namespace, {})[generation] = entry
        try:
            write_file_atomic(ns_dir / _sidecar_name(generation), f"{digest.hex()}  {final.name}\n".encode())
        except OSError as exc:  # published all the same: the digest is recomputed from the file when needed
            log.warning("could not write the SHA-256 sidecar of %s: %s", final, exc)
        self._wake(namespace)
        log.info("published generation %d of %r (%d bytes, sha256 %s)", generation, namespace, st.st_size,
                 digest.hex())
        return PublishResult(entry.info, already_published=False)

    @staticmethod
    def _link(src: Path, final: Path) -> bool:
        """Gives ``src`` the name ``final`` unless that name exists (False then); ``src`` is gone after True."""
        try:
            os.link(src, final)  # no clobber: a published file is never replaced, even by another process
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            # A filesystem without hard links: rename, guarded by the scan under the namespace's lock.
            os.replace(src, final)
            return True
        os.unlink(src)
        return True

    @staticmethod
    def _same_generation(info: GenerationInfo, digest: bytes) -> PublishResult:
        if info.sha256 == digest:
            return PublishResult(info, already_published=True)
        raise ServiceError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"generation {info.generation} of {info.namespace!r} was published with SHA-256 "
            f"{info.sha256.hex()[:16]}..., not {digest.hex()[:16]}...",
            CHECKSUM_MISMATCH)

    def _retain_sync(self, namespace: str, keep: int) -> list[int]:
        with self._namespace_lock(namespace):
            doomed = [info.generation for info in self._scan(namespace)[:-keep]]
            ns_dir = self.data_dir / namespace
            for generation in doomed:
                # The file first: a sidecar without its file is ignored, a file without one rehashed.
                (ns_dir / generation_file_name(generation)).unlink(missing_ok=True)
                (ns_dir / _sidecar_name(generation)).unlink(missing_ok=True)
            if doomed:
                _fsync_dir(ns_dir)
                with self._lock:
                    entries = self._entries.get(namespace, {})
                    for generation in doomed:
                        entries.pop(generation, None)
                log.info("pruned generations %s of %r", doomed, namespace)
            return doomed

    def _drop_sync(self, namespace: str) -> bool:
        with self._namespace_lock(namespace):
            ns_dir = self.data_dir / namespace
            existed = ns_dir.is_dir()
            if existed:
                shutil.rmtree(ns_dir)
                _fsync_dir(self.data_dir)
            with self._lock:
                self._entries.pop(namespace, None)
                subs = list(self._subscribers.get(namespace, ()))
                for sub in subs:
                    sub.dropped = True
            for sub in subs:
                sub.wake()
            return existed

    def _wake(self, namespace: str) -> None:
        with self._lock:
            subs = list(self._subscribers.get(namespace, ()))
        for sub in subs:
            sub.wake()


class Upload:
    """A file being received into a namespace's folder, ended by `publish` or discarded.

    Use it as ``async with store.upload(...) as up``: chunks go to ``up.write`` in file
    order, then ``await up.publish(...)``; leaving the block any other way (an error, a
    cancelled call, a client gone) deletes the partial file. The SHA-256 is computed as
    the bytes are written. Not thread-safe: one task drives an upload.
    """

    def __init__(self, store: StaticStore, namespace: str, *, generation: int, size: int, sha256: bytes) -> None:
        self.namespace = namespace
        self.generation = generation
        self.size = size
        self.sha256 = sha256
        self.received = 0
        self.path: Path | None = None
        self._store = store
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._done = False

    async def __aenter__(self) -> Upload:
        self._file = await self._store._run(self._create)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.discard()

    def _create(self) -> BinaryIO:
        ns_dir = self._store.namespace_dir(self.namespace)
        try:
            ns_dir.mkdir(parents=True, exist_ok=True)
            self.path = ns_dir / f"upload-{secrets.token_hex(8)}.tmp"
            return open(self.path, "xb")
        except OSError as exc:
            if _disk_full(exc):
                raise limit_exceeded("no disk space left for an upload") from exc
            raise

    async def write(self, offset: int, data: bytes) -> None:
        """Append the bytes at ``offset`` of the file.

        Raises:
            InvalidArgumentError: ``offset`` is not the bytes received so far, or the data
                goes past the declared size.
            ServiceError: RESOURCE_EXHAUSTED when the disk is full.
        """
        if self._file is None or self._done:
            raise RuntimeError("write() outside `async with`, or after publish()")
        if offset != self.received:
            raise InvalidArgumentError(f"a chunk at offset {offset}; the next byte expected is {self.received}")
        if len(data) > self.size - self.received:
            raise InvalidArgumentError(f"the upload goes past its declared size of {self.size} bytes")
        await self._store._run(self._write, self._file, data)
        self.received += len(data)

    def _write(self, f: BinaryIO, data: bytes) -> None:
        try:
            f.write(data)
        except OSError as exc:
            if _disk_full(exc):
                raise limit_exceeded("no disk space left for the upload") from exc
            raise
        self._hash.update(data)

    async def publish(self, *, fingerprint: bytes | str, vocab_size: int) -> PublishResult:
        """Verify the complete upload and publish it (`StaticStore.publish`, same errors).

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
            await self._store._run(f.close)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            if _disk_full(exc):
                raise limit_exceeded("no disk space left for the upload") from exc
            raise
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        return await self._store._publish(
            self.namespace, self.path, fingerprint=fingerprint, vocab_size=vocab_size, generation=self.generation,
            size=self.size, sha256=self.sha256, known_sha256=self._hash.digest())

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

    def __init__(self, store: StaticStore, info: GenerationInfo, f: BinaryIO, offset: int) -> None:
        self.info = info
        self.offset = offset
        self._store = store
        self._file = f

    async def read(self, max_bytes: int) -> bytes:
        """The next bytes, at most ``max_bytes``; empty at the end of the file."""
        data = await self._store._run(self._file.read, min(max_bytes, self.info.size - self.offset))
        self.offset += len(data)
        return data

    def close(self) -> None:
        self._file.close()

    async def __aenter__(self) -> GenerationReader:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()
