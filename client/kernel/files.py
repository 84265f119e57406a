"""File helpers every writer of ngramcache files shares: SHA-256 of a file, fsync of a file or a folder, atomic writes, full disks.

Atomic writes are the core's (`write_file_atomic`, native/include/ngc/file_util.h): a
temporary file beside the target, fsync, rename, fsync of the folder. Publishing a file
written another way follows the same order with `fsync_file`, a rename or link, then
`fsync_dir`: the rename is durable only once its folder is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Iterable
from typing import Final

from ngramcache.client._core import write_file_atomic

__all__ = ["READ_BYTES", "fsync_dir", "fsync_file", "is_disk_full", "sha256_of_file", "write_file_atomic",
           "write_lines_atomic"]

READ_BYTES: Final = 1 << 20
"""Bytes read at a time when hashing: memory stays bounded whatever the file's size."""

_DISK_FULL: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


def sha256_of_file(path: str | os.PathLike[str], chunk: int = READ_BYTES) -> bytes:
    """The SHA-256 of a whole file, read ``chunk`` bytes at a time.

    Args:
        path: the file.
        chunk: bytes per read.

    Returns:
        The 32-byte digest.

    Raises:
        OSError: the file cannot be opened or read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.digest()


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data and metadata to its device (before renaming or linking it into place).

    Args:
        path: the file, already written and closed.

    Raises:
        OSError: it cannot be opened, or the device reports an error.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries to its device, so the names created, renamed or deleted in it survive a crash.

    Args:
        path: the folder.

    Raises:
        OSError: it cannot be opened (NotADirectoryError when it is not a folder), or the
            device reports an error.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(exc: OSError) -> bool:
    """True when ``exc`` says the device or the user's quota has no space left (ENOSPC, EDQUOT).

    Args:
        exc: an error of a write, a close, a link or a mkdir.
    """
    return exc.errno in _DISK_FULL


def write_lines_atomic(path: str | os.PathLike[str], lines: Iterable[str]) -> None:
    """Write text ``lines`` to ``path`` atomically, streaming: never a partial file, whatever happens.

    The lines go to ``<path>.tmp.<pid>.<random>`` beside it (the name an interrupted command's
    clean-up looks for), which is fsynced and renamed over ``path``; then the folder is fsynced.

    Raises:
        OSError: naming ``path`` (not the temporary file) when a write or the close fails, a full
            disk for one; the temporary file is removed on any error or interruption.
    """
    target = os.fspath(path)
    tmp = f"{target}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "x") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.filename is None:  # a write or close that failed (a full disk): name the output, not a temporary
            raise OSError(e.errno, e.strerror, target) from None
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(target)))
