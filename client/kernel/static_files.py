"""A node's local copies of a namespace's static generations: paths, the download lock, verification, install, pruning.

Layout: ``<cache_dir>/<namespace>/<generation>.ngc`` (installed, verified),
``<generation>.ngc.part`` (a download in progress, resumed from its size),
``<generation>.ngc.sha256`` (the hex SHA-256 the installer verified) and ``.lock`` (an
``fcntl.flock`` held by the one process of the node that downloads; the others wait,
then find the installed file). Nothing here talks to the network: ``NgramClient``
(``ngramcache.client.sync``) streams the bytes in.

Thread-safety: a `GenerationFiles` holds no mutable state beyond the lock's file
descriptor; use one lock holder per instance at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from pathlib import Path

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import CacheFormatError, InvalidArgumentError, TokenizerMismatchError
from ngramcache.client.kernel.files import fsync_dir, sha256_of_file

__all__ = ["GenerationFiles", "default_cache_dir", "prepare_cache_dir", "sha256_of_file"]  # sha256_of_file: ngramcache.client.kernel.files's, kept here for its users

log = logging.getLogger("ngramcache.client.static_files")  # a logger name that log configs can rely on, whatever folder holds the module

def default_cache_dir() -> str:
    """A node's generation cache when none is given: ``$XDG_CACHE_HOME/ngramcache`` (``~/.cache/ngramcache``)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ngramcache")


def prepare_cache_dir(cache_dir: str | os.PathLike[str], *, create_parents: bool = False) -> str:
    """Check ``cache_dir`` and create it (its parent must exist unless ``create_parents``); returns it as a str.

    A given cache_dir is created when its parent folder exists, never a whole chain of folders a
    typo would make; the default one (`default_cache_dir`) is created with its parents.

    Raises:
        InvalidArgumentError: naming ``cache_dir`` and the path: its parent does not exist, it or a
            part of it is not a folder, or it cannot be created or written.
    """
    path = os.fspath(cache_dir)
    if not path:
        raise InvalidArgumentError("cache_dir is empty: give the folder that keeps the node's generation files")
    parent = os.path.dirname(os.path.abspath(path))
    if not create_parents and not os.path.isdir(parent):
        raise InvalidArgumentError(f"cache_dir {path}: its parent folder {parent} does not exist: create it, or "
                                   "give another cache_dir")
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise InvalidArgumentError(f"cache_dir {path} exists and is not a folder") from None
    except OSError as e:
        raise InvalidArgumentError(f"cache_dir {path} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"cache_dir {path}: permission denied (the client writes generation files in it)")
    return path


_INSTALLED = re.compile(r"^(\d+)\.ngc$")


class GenerationFiles:
    """The generation files of one namespace under ``cache_dir``.

    Args:
        cache_dir: the node's cache directory (shared by the node's processes).
        namespace: the namespace (a valid name contains no path separator).
    """

    def __init__(self, cache_dir: str | os.PathLike[str], namespace: str) -> None:
        self.dir = Path(cache_dir) / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None

    def path(self, generation: int) -> Path:
        """Where generation ``generation`` is installed."""
        return self.dir / f"{generation}.ngc"

    def part_path(self, generation: int) -> Path:
        """Where its download in progress accumulates."""
        return self.dir / f"{generation}.ngc.part"

    def _sidecar(self, generation: int) -> Path:
        return self.dir / f"{generation}.ngc.sha256"

    def try_lock(self) -> bool:
        """Take the node-wide download lock without waiting; True when taken (release with `unlock`)."""
        if self._lock_fd is not None:
            return True
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def unlock(self) -> None:
        """Release the download lock (closing the descriptor releases the flock)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def installed(self, generation: int, size: int, sha256: bytes) -> bool:
        """True when that generation is installed with this size and the SHA-256 its installer verified.

        The file is not hashed again (a node's processes would each read it whole); its
        sidecar records what was verified before the atomic rename.
        """
        path, sidecar = self.path(generation), self._sidecar(generation)
        try:
            return path.stat().st_size == size and sidecar.read_text().strip() == sha256.hex()
        except OSError:
            return False

    def verify_part(self, generation: int, sha256: bytes, fingerprint: bytes, vocab_size: int) -> None:
        """Verify a complete download: whole-file SHA-256, every section checksum, tokenizer, generation.

        Raises:
            CacheFormatError: a checksum differs, or the file is not a valid static cache of that generation.
            TokenizerMismatchError: the file is for another tokenizer.
        """
        part = self.part_path(generation)
        if sha256_of_file(part) != sha256:
            raise CacheFormatError(f"{part}: SHA-256 differs from the generation's")
        cache = StaticCache.open(part)
        cache.verify()
        if cache.generation != generation:
            raise CacheFormatError(f"{part}: holds generation {cache.generation}, expected {generation}")
        if cache.fingerprint != fingerprint or cache.vocab_size != vocab_size:
            raise TokenizerMismatchError(f"{part}: tokenizer differs from the client's")

    def install(self, generation: int, sha256: bytes) -> Path:
        """Rename a verified download into place (atomic), after writing its sidecar; return the path."""
        sidecar = self._sidecar(generation)
        tmp = sidecar.with_suffix(".sha256.tmp")
        tmp.write_text(sha256.hex() + "\n")
        os.replace(tmp, sidecar)
        path = self.path(generation)
        os.replace(self.part_path(generation), path)
        fsync_dir(self.dir)
        return path

    def generations(self) -> list[int]:
        """Installed generations, oldest first."""
        found = (_INSTALLED.match(p.name) for p in self.dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def prune(self, current: int, keep: int) -> list[int]:
        """Remove installed generations other than ``current`` and the ``keep`` newest; return those removed.

        Call while holding the lock. A file still mapped by a process stays readable by it
        (unlinking removes the name, not the mapping).
        """
        gens = self.generations()
        kept = set(gens[-keep:]) | {current} if keep > 0 else {current}
        removed = []
        for gen in gens:
            if gen in kept or gen > current:
                continue
            for p in (self.path(gen), self._sidecar(gen), self.part_path(gen)):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            removed.append(gen)
        if removed:
            log.info("removed old generations %s of %s", removed, self.dir)
        return removed
