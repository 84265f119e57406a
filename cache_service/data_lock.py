"""One server per data directory: an exclusive lock on ``<data_dir>/serve.lock``, held while `ngramcache serve` runs.

Two servers on one data directory would both write the embedded store's snapshot and the
generation files. The lock is an ``flock`` (released by the kernel when the process dies, so
a crash leaves nothing to clean up); the file holds the owner's pid for the error message.
Worker processes of ``serve --workers N`` run under their parent's lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["HELD_BY_PARENT_ENV", "DataDirLock"]

LOCK_NAME = "serve.lock"
HELD_BY_PARENT_ENV = "NGRAMCACHE_DATA_DIR_LOCK_HELD"  # set for `--workers` children: the parent holds it


class DataDirLock:
    """The lock of one data directory; a context manager. Not thread-safe (one per process)."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (creating the directory if needed).

        Raises:
            InvalidArgumentError: another server holds it (the message names its pid).
            OSError: the directory cannot be created or the file opened.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise InvalidArgumentError(
                f"data directory {self.path.parent} is in use by another ngramcache serve (pid {owner}); "
                "stop it or give another --data-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
