"""The data directory's layout: file names, what a generation is (`GenerationInfo`), argument checks and SHA-256 sidecars.

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

import dataclasses
import os
import re
from pathlib import Path
from typing import Final

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import GenerationNotFoundError, GenerationNotNewerError, InvalidArgumentError
from ngramcache.client.kernel.files import write_file_atomic

from ..counts.namespace import validate_namespace

__all__ = [
    "GENERATION_DIGITS",
    "GENERATION_RE",
    "MAX_GENERATION",
    "SHA256_SIZE",
    "SIDECAR_RE",
    "TEMPORARY_RE",
    "GenerationInfo",
    "Identity",
    "PublishResult",
    "check_generation",
    "check_namespace",
    "check_sha256",
    "check_size",
    "generation_file_name",
    "generation_not_found",
    "identity",
    "info_of",
    "publish_refused",
    "read_sidecar",
    "sidecar_name",
    "write_sidecar",
]

GENERATION_DIGITS: Final = 20
"""Digits of a generation's file name: zero-padded, so names sort like numbers (2^64 - 1 has 20)."""

SHA256_SIZE: Final = 32
"""Bytes of a SHA-256 digest."""

MAX_GENERATION: Final = 2**64 - 1
"""The largest generation number (a uint64 on the wire and in the file header)."""

GENERATION_RE: Final = re.compile(r"(\d{20})\.ngc")
SIDECAR_RE: Final = re.compile(r"(\d{20})\.sha256")
TEMPORARY_RE: Final = re.compile(r".*\.tmp(\..*)?")
"""Temporary names: ours (upload-*.tmp, rebuild-*.tmp) and the native atomic writer's (<target>.tmp.<pid>.<hex>)."""

_SIDECAR_LINE_RE: Final = re.compile(rb"([0-9a-f]{64})  \S+\n?")


def generation_file_name(generation: int) -> str:
    """The file name of a generation: ``{generation:020d}.ngc``."""
    return f"{generation:0{GENERATION_DIGITS}d}.ngc"


def sidecar_name(generation: int) -> str:
    """The file name of a generation's SHA-256 sidecar: ``{generation:020d}.sha256``."""
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


def info_of(namespace: str, cache: StaticCache, st: os.stat_result, digest: bytes) -> GenerationInfo:
    """The record of a generation file from its header, its stat and its SHA-256."""
    return GenerationInfo(
        namespace=namespace, generation=cache.generation, size=st.st_size, sha256=digest,
        fingerprint=cache.fingerprint, vocab_size=cache.vocab_size, created_unix_ms=st.st_mtime_ns // 1_000_000,
        ngram_size=cache.ngram_size, n_keys=cache.n_keys, n_followers=cache.n_followers)


Identity = tuple[int, int, int, int]
"""(st_dev, st_ino, st_size, st_mtime_ns): a file's identity; a cached record is reused only while
the file on disk still has it (a namespace dropped and published again gets new files)."""


def identity(st: os.stat_result) -> Identity:
    """The identity of the file ``st`` describes."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def generation_not_found(namespace: str, generation: int) -> GenerationNotFoundError:
    """The error for a generation that was never published in ``namespace`` (or was pruned); 0 means any."""
    what = "no generation" if generation == 0 else f"no generation {generation}"
    return GenerationNotFoundError(f"namespace {namespace!r} has {what}")


def publish_refused(namespace: str, generation: int, latest: int) -> InvalidArgumentError | GenerationNotNewerError:
    """The error for a Publish of ``generation`` (0, or not above ``latest``), naming the fix."""
    fix = f"build the file again with `ngramcache build --generation N`, N > {latest}"
    if generation == 0:
        return InvalidArgumentError(f"the file's header says generation 0, which is never published (the latest of "
                                    f"{namespace!r} is {latest}): {fix}")
    return GenerationNotNewerError(f"generation {generation} of {namespace!r} is not above its latest, {latest}: {fix}")


def check_namespace(namespace: str) -> str:
    """``namespace`` when it names a folder of the data directory.

    Raises:
        InvalidArgumentError: a malformed namespace name, or ``.`` or ``..``.
    """
    validate_namespace(namespace)
    if namespace in (".", ".."):  # legal characters, but not a folder of the data directory
        raise InvalidArgumentError(f"namespace {namespace!r} is not a valid static file namespace")
    return namespace


def check_generation(generation: int) -> int:
    """``generation`` when it is a generation number, in [1, 2**64).

    Raises:
        InvalidArgumentError: anything else (0, a bool, a float, ...).
    """
    if isinstance(generation, bool) or not isinstance(generation, int) or not 1 <= generation <= MAX_GENERATION:
        raise InvalidArgumentError(f"generation must be in [1, 2**64), got {generation!r}")
    return generation


def check_sha256(sha256: bytes) -> bytes:
    """``sha256`` when it is a SHA-256 digest (32 bytes).

    Raises:
        InvalidArgumentError: not 32 bytes.
    """
    if not isinstance(sha256, bytes) or len(sha256) != SHA256_SIZE:
        raise InvalidArgumentError(f"sha256 must be {SHA256_SIZE} bytes")
    return sha256


def check_size(size: int) -> int:
    """``size`` when it is a byte count (>= 0).

    Raises:
        InvalidArgumentError: negative, or not an int.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgumentError(f"size must be a byte count >= 0, got {size!r}")
    return size


def read_sidecar(ns_dir: Path, generation: int) -> bytes | None:
    """The SHA-256 a generation's sidecar records; None when it is missing, unreadable or malformed."""
    try:
        data = (ns_dir / sidecar_name(generation)).read_bytes()
    except OSError:
        return None
    m = _SIDECAR_LINE_RE.fullmatch(data)
    return bytes.fromhex(m[1].decode()) if m else None


def write_sidecar(ns_dir: Path, generation: int, digest: bytes) -> None:
    """Write a generation's sidecar atomically, in `sha256sum` format (so `sha256sum -c` checks the folder).

    Raises:
        OSError: it could not be written (the digest can always be recomputed from the file).
    """
    write_file_atomic(ns_dir / sidecar_name(generation), f"{digest.hex()}  {generation_file_name(generation)}\n".encode())
