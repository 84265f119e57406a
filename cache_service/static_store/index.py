"""GenerationIndex: the published generations of each namespace as found on disk, each file mapped once per process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from pathlib import Path

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.errors import CacheFormatError
from ngramcache.client.kernel.files import sha256_of_file as _sha256_of

from .layout import (
    GENERATION_RE,
    MAX_GENERATION,
    GenerationInfo,
    Identity,
    generation_file_name,
    identity,
    info_of,
    read_sidecar,
    write_sidecar,
)

__all__ = ["Entry", "GenerationIndex"]

log = logging.getLogger("ngramcache.service")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A generation file as indexed: its identity when read, its record and its mapping."""

    identity: Identity
    info: GenerationInfo
    cache: StaticCache


class GenerationIndex:
    """What is published under one data directory, rescanned on every call and cached by file identity.

    The directory is the truth (other processes may publish into it); the index only saves
    reopening and rehashing files it has seen: an entry is reused while the file still has
    the identity it had when read. A file whose header does not open, or says another
    generation, is skipped (and logged once).

    Thread-safety: every method may be called from any thread; the entries are guarded by
    one lock, never held while reading files.

    Args:
        data_dir: the data directory.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, Entry]] = {}
        self._bad: set[tuple[str, int, Identity]] = set()  # invalid files already logged

    def scan(self, namespace: str) -> list[GenerationInfo]:
        """The namespace's valid generations on disk, oldest first (one listdir, a stat per file)."""
        ns_dir = self.data_dir / namespace
        try:
            names = os.listdir(ns_dir)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        with self._lock:
            known = dict(self._entries.get(namespace, {}))
        found: dict[int, Entry] = {}
        for name in names:
            m = GENERATION_RE.fullmatch(name)
            if m is None:
                continue
            generation = int(m[1])
            if not 1 <= generation <= MAX_GENERATION:
                continue
            try:
                st = os.stat(ns_dir / name)
            except FileNotFoundError:  # pruned meanwhile
                continue
            entry = known.get(generation)
            if entry is None or entry.identity != identity(st):
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

    def entry(self, namespace: str, generation: int) -> Entry | None:
        """The cached entry of a generation (as of the last scan or put), or None."""
        with self._lock:
            return self._entries.get(namespace, {}).get(generation)

    def put(self, namespace: str, entry: Entry) -> None:
        """Cache the entry of a generation being published (so a concurrent scan does not hash it again)."""
        with self._lock:
            self._entries.setdefault(namespace, {})[entry.info.generation] = entry

    def discard(self, namespace: str, generations: list[int]) -> None:
        """Forget generations that were deleted, or never became visible."""
        with self._lock:
            entries = self._entries.get(namespace, {})
            for generation in generations:
                entries.pop(generation, None)

    def forget(self, namespace: str) -> None:
        """Forget a dropped namespace (mappings already handed out stay valid for their holders)."""
        with self._lock:
            self._entries.pop(namespace, None)

    def _load(self, namespace: str, generation: int, st: os.stat_result) -> Entry | None:
        """Opens a generation file found on disk; None (logged once) when it is not a valid one."""
        ns_dir = self.data_dir / namespace
        path = ns_dir / generation_file_name(generation)
        try:
            cache = StaticCache.open(path)
            if cache.generation != generation:
                raise CacheFormatError(f"{path}: its header says generation {cache.generation}")
            digest = read_sidecar(ns_dir, generation)
            if digest is None:
                digest = _sha256_of(path)
                with contextlib.suppress(OSError):  # a read-only directory: keep it in memory only
                    write_sidecar(ns_dir, generation, digest)
        except FileNotFoundError:
            return None
        except (CacheFormatError, OSError) as exc:
            key = (namespace, generation, identity(st))
            with self._lock:
                first = key not in self._bad
                self._bad.add(key)
            if first:
                log.warning("ignoring %s: %s", path, exc)
            return None
        return Entry(identity(st), info_of(namespace, cache, st, digest), cache)
