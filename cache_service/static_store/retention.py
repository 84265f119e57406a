"""Deleting files: old generations past the number kept, a dropped namespace's folder, and what a crash left behind."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import CacheFormatError
from ngramcache.client.kernel.files import fsync_dir

from .index import GenerationIndex
from .layout import GENERATION_RE, SIDECAR_RE, TEMPORARY_RE, generation_file_name, sidecar_name

__all__ = ["prune", "remove_leftovers", "remove_namespace"]

log = logging.getLogger("ngramcache.service")


def prune(index: GenerationIndex, namespace: str, keep: int, *, protect: int = 0) -> list[int]:
    """Delete all but the newest ``keep`` generations and ``protect`` (the namespace's lock held); return those deleted.

    Args:
        index: the data directory's index (the deleted generations leave it).
        namespace: a checked namespace name.
        keep: generations kept, >= 1.
        protect: a generation never deleted, whatever its age (the corpus base); 0: none.

    Raises:
        OSError: a file or the folder could not be deleted or fsynced.
    """
    doomed = [info.generation for info in index.scan(namespace)[:-keep] if info.generation != protect]
    ns_dir = index.data_dir / namespace
    for generation in doomed:
        # The file first: a sidecar without its file is ignored, a file without one rehashed.
        (ns_dir / generation_file_name(generation)).unlink(missing_ok=True)
        (ns_dir / sidecar_name(generation)).unlink(missing_ok=True)
    if doomed:
        fsync_dir(ns_dir)
        index.discard(namespace, doomed)
        log.info("pruned generations %s of %r", doomed, namespace)
    return doomed


def remove_namespace(index: GenerationIndex, namespace: str) -> bool:
    """Delete the namespace's folder, uploads in progress included (its lock held); True when it had one.

    Raises:
        OSError: the folder could not be deleted or the data directory fsynced.
    """
    ns_dir = index.data_dir / namespace
    existed = ns_dir.is_dir()
    if existed:
        shutil.rmtree(ns_dir)
        fsync_dir(index.data_dir)
    index.forget(namespace)
    return existed


def remove_leftovers(data_dir: Path, min_age_seconds: float = 0.0) -> list[Path]:
    """Delete what a crash can leave in the data directory (`StaticStore.remove_leftovers`); return the paths deleted.

    Args:
        data_dir: the data directory.
        min_age_seconds: temporary files younger than this are spared (another process's upload).
    """
    removed: list[Path] = []
    now = time.time()
    for ns_dir in sorted(data_dir.iterdir()):
        if not ns_dir.is_dir() or ns_dir.is_symlink():
            continue
        try:
            names = set(os.listdir(ns_dir))
        except OSError as exc:
            log.warning("cannot list %s: %s", ns_dir, exc)
            continue
        removed_here = 0
        for name in sorted(names):
            for path in _leftovers(ns_dir, name, names, now - min_age_seconds):
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
            fsync_dir(ns_dir)
    return removed


def _leftovers(ns_dir: Path, name: str, names: set[str], older_than: float) -> list[Path]:
    """What of ``ns_dir/name`` `remove_leftovers` deletes."""
    path = ns_dir / name
    try:
        if TEMPORARY_RE.fullmatch(name):
            return [path] if path.lstat().st_mtime <= older_than else []
        if m := SIDECAR_RE.fullmatch(name):
            return [] if generation_file_name(int(m[1])) in names else [path]
        if m := GENERATION_RE.fullmatch(name):
            try:
                if StaticCache.open(path).generation != int(m[1]):
                    raise CacheFormatError(f"{path}: its header says another generation")
            except CacheFormatError as exc:
                log.warning("removing an invalid generation file: %s", exc)
                return [path, ns_dir / sidecar_name(int(m[1]))]
    except OSError as exc:
        log.warning("cannot check %s: %s", path, exc)
    return []
