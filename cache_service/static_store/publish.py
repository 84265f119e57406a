"""Publishing one complete file: verified whole, then given its generation's name without clobbering, fsynced and indexed."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Final

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import (
    CacheFormatError,
    GenerationConflictError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LimitExceededError,
    NamespaceNotFoundError,
    TokenizerMismatchError,
)
from ngramcache.client.kernel.files import fsync_dir, fsync_file, is_disk_full, sha256_of_file

from .index import Entry, GenerationIndex
from .layout import (
    GenerationInfo,
    PublishResult,
    generation_file_name,
    generation_not_found,
    identity,
    info_of,
    sidecar_name,
    write_sidecar,
)

__all__ = ["publish_file"]

log = logging.getLogger("ngramcache.service")

# Filesystems without hard links: publish falls back to rename (no protection against another process).
_NO_LINKS: Final = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def publish_file(index: GenerationIndex, namespace_lock: threading.Lock, namespace: str, src: Path, *,
                 fingerprint: bytes, vocab_size: int, generation: int | None, size: int | None,
                 sha256: bytes | None, known_sha256: bytes | None, restore: bool = False) -> PublishResult:
    """Verify ``src`` whole, then publish it as its generation of ``namespace`` (blocking).

    Takes ownership of ``src``: it is linked into place, or deleted whatever the outcome.
    Does not wake watchers: the caller does, when the result is not ``already_published``.

    Args:
        index: the data directory's index (updated with the new generation).
        namespace_lock: the namespace's lock, held while the numbers are checked and the file linked.
        namespace: a checked namespace name.
        src: the complete file, on the data directory's filesystem.
        fingerprint: the namespace's 32-byte tokenizer fingerprint.
        vocab_size: the namespace's vocabulary size.
        generation, size, sha256: when given, what the file must declare or be.
        known_sha256: the file's SHA-256 when already computed (an upload hashes as it writes).
        restore: install a generation below the latest too (a rebuild's corpus base fetched from
            a peer: an older number that was published elsewhere, never a new one).

    Raises:
        CacheFormatError: not a valid static cache, or a section checksum is wrong.
        InvalidArgumentError: the file differs from ``generation``, ``size`` or ``sha256``,
            or its generation is 0.
        TokenizerMismatchError: its fingerprint or vocab_size is not the namespace's.
        NamespaceNotFoundError: ``src`` vanished (its namespace was dropped meanwhile).
        GenerationNotNewerError: its generation is not above the latest (without ``restore``).
        GenerationConflictError: that generation exists with another SHA-256.
        LimitExceededError: no disk space left.
    """
    published = False
    try:
        cache, digest = _verify(namespace, src, fingerprint=fingerprint, vocab_size=vocab_size,
                                generation=generation, size=size, sha256=sha256, known_sha256=known_sha256)
        with namespace_lock:
            result = _commit(index, namespace, src, cache, digest, restore)
        published = not result.already_published
        return result
    except OSError as exc:
        if is_disk_full(exc):
            raise LimitExceededError(f"no disk space left to publish into {namespace!r}") from exc
        raise
    finally:
        if not published:
            src.unlink(missing_ok=True)


def _verify(namespace: str, src: Path, *, fingerprint: bytes, vocab_size: int, generation: int | None,
            size: int | None, sha256: bytes | None, known_sha256: bytes | None) -> tuple[StaticCache, bytes]:
    """The file's mapping and SHA-256, once every declared value and every section checksum matched."""
    try:
        st = os.stat(src)
    except FileNotFoundError:
        # Uploads live in the namespace's folder, which `drop` deletes whole.
        raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped during the upload") from None
    if size is not None and st.st_size != size:
        raise InvalidArgumentError(f"the file has {st.st_size} bytes, not the declared size of {size}")
    digest = known_sha256 if known_sha256 is not None else sha256_of_file(src)
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
    return cache, digest


def _commit(index: GenerationIndex, namespace: str, src: Path, cache: StaticCache, digest: bytes,
            restore: bool = False) -> PublishResult:
    """Publishes a verified file (the namespace's lock held): check numbers, link, fsync, index."""
    generation = cache.generation
    existing = index.scan(namespace)
    for info in existing:
        if info.generation == generation:
            return _same_generation(info, digest)
    if existing and generation <= existing[-1].generation and not restore:
        raise GenerationNotNewerError(
            f"generation {generation} is not above {existing[-1].generation}, the latest of {namespace!r}")
    data_dir = index.data_dir
    ns_dir = data_dir / namespace
    if not ns_dir.is_dir():  # a file built elsewhere: its namespace's first generation
        ns_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(data_dir)
    final = ns_dir / generation_file_name(generation)
    # A sidecar without its file (a crash's leftover) must not be read as this file's.
    (ns_dir / sidecar_name(generation)).unlink(missing_ok=True)
    now_ns = time.time_ns()
    os.utime(src, ns=(now_ns, now_ns))  # created_unix_ms is the file's mtime
    fsync_file(src)
    st = os.stat(src)  # the published file is this inode: its identity does not change
    entry = Entry(identity(st), info_of(namespace, cache, st, digest), cache)
    # Indexed before the name appears, so a concurrent scan does not hash the file again.
    index.put(namespace, entry)
    linked = False
    try:
        linked = _link(src, final)
    finally:
        if not linked:
            index.discard(namespace, [generation])
    if not linked:  # another process published this generation between the scan and the link
        for info in index.scan(namespace):
            if info.generation == generation:
                return _same_generation(info, digest)
        raise generation_not_found(namespace, generation)  # and pruned or dropped it already
    fsync_dir(ns_dir)
    with contextlib.suppress(CacheFormatError, OSError):  # the same inode, mapped under its final name
        entry = dataclasses.replace(entry, cache=StaticCache.open(final))
    index.put(namespace, entry)  # again: a scan between the put above and the link dropped it
    try:
        write_sidecar(ns_dir, generation, digest)
    except OSError as exc:  # published all the same: the digest is recomputed from the file when needed
        log.warning("could not write the SHA-256 sidecar of %s: %s", final, exc)
    log.info("published generation %d of %r (%d bytes, sha256 %s)", generation, namespace, st.st_size, digest.hex())
    return PublishResult(entry.info, already_published=False)


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


def _same_generation(info: GenerationInfo, digest: bytes) -> PublishResult:
    if info.sha256 == digest:
        return PublishResult(info, already_published=True)
    raise GenerationConflictError(
        f"generation {info.generation} of {info.namespace!r} was published with SHA-256 "
        f"{info.sha256.hex()[:16]}..., not {digest.hex()[:16]}...")
