"""The in-process backend of the counts store, for one machine with no Redis configured.

It keeps the same layout and guarantees as the Redis backend (buckets, exactly-once per
(client_id, seq), versions and bounded change history as roaring bitmaps of bucket ids),
inside one process. With a path it snapshots itself to that file every
``snapshot_seconds`` and on `close()`, atomically (write a temporary file, fsync, rename,
fsync the directory), and reloads the file when opened.

**A crash or kill loses at most the last snapshot interval**: the batches applied since
the last snapshot are gone, and so are their dedup records, so a sender that retries one
of them gets it applied again (once). After a reload every version handed out before is
answered with `ResyncRequiredError`, because the counts behind those versions may be lost.

The fleet history (`embedded_history`) is kept in memory only, not in the snapshot: a
restarted embedded store starts with an empty history window.

Snapshot file (little-endian): magic ``NGCSNAP\\x01``, '<Q' header length, a JSON header
(format, per namespace its record, current version, entry count and dedup seqs, and the
committed generation records with their corpus bases, `leases.CommittedGeneration`), then
per namespace its entries' keys as int32 (k, KEY_WIDTH) and their counts as int64 (k,),
then a '<I' CRC32 of everything before it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import pyroaring

from ngramcache.client._core import write_file_atomic
from ngramcache.client.kernel.errors import BatchTooOldError, InvalidArgumentError, NgramCacheError, SnapshotFormatError
from ngramcache.client.kernel.rows import (
    COUNT,
    DELTA_DTYPE,
    KEY_WIDTH,
    ROW_WIDTH,
    validate_deltas,
)

from .config import CountsStoreConfig
from .dedup import DedupWindow
from .embedded_history import NamespaceHistory
from .history import HistoryAppend, HistoryPage, HistoryRecord
from .layout import (
    EncodedBatch,
    decode_fields,
    fields_and_buckets,
    ngram_bucket,
    ngram_key,
)
from .leases import LeaseTable
from .namespace import (
    NamespaceRecord,
    StaleNamespace,
    namespace_changed,
    no_such_namespace,
    normalize_fingerprint,
    validate_layout,
    validate_namespace,
    validate_vocab_size,
)
from .store import CountsStore
from .values import ChangeSet, Seen, Unit, UnitAnswer, validate_client_id
from .versions import EpochClock, check_version, now_ms

__all__ = ["EmbeddedCountsStore"]

log = logging.getLogger(__name__)

_MAGIC: Final = b"NGCSNAP\x01"
_FORMAT: Final = 1
_KEY_DTYPE: Final = np.dtype("<i4")  # the snapshot's key columns: delta rows' int32, little-endian
_COUNT_DTYPE: Final = np.dtype("<i8")
_EXPIRE_EVERY: Final = 4096  # applies between sweeps of expired dedup records


class _Namespace:
    """One namespace's counts and change history; guarded by the store's lock."""

    def __init__(self, info: NamespaceRecord, start: int, dedup_ttl_ms: int) -> None:
        self.info = info
        self.history = NamespaceHistory(dedup_ttl_ms)  # in memory only: not in the snapshot
        self.buckets: dict[int, dict[bytes, int]] = {}
        self.dedup: dict[str, DedupWindow] = {}
        self.clock = EpochClock(start)
        self.open = pyroaring.BitMap()  # buckets changed since clock.cur
        self.closed: list[tuple[int, pyroaring.BitMap]] = []  # (end version, buckets), oldest first


class EmbeddedCountsStore(CountsStore):
    """Counts in this process, optionally snapshotted to a file. Thread-safe (one lock): a unit is a whole namespace.

    Args:
        config: a `CountsStoreConfig` whose url is None/"" (memory only) or
            ``embedded://PATH`` (snapshot file; ``embedded:///abs/path`` for an absolute one).

    Raises:
        InvalidArgumentError: the config names another backend.
        SnapshotFormatError: the snapshot file exists but is not a valid snapshot.
    """

    _unit_per_shard = False
    _leases: LeaseTable  # kept in the snapshot

    def __init__(self, config: CountsStoreConfig | None = None) -> None:
        self.config = config or CountsStoreConfig()
        if self.config.address.kind != "embedded":
            raise InvalidArgumentError(f"EmbeddedCountsStore needs an embedded:// URL, not {self.config.address.kind}")
        self.path = self.config.address.path
        self._lock = threading.RLock()
        self._namespaces: dict[str, _Namespace] = {}
        self._leases = LeaseTable()  # leases in this process only; the committed records are in the snapshot
        self._closed = False
        self._applies = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.path and os.path.exists(self.path):
            self._load(self.path)
        if self.path and self.config.snapshot_seconds > 0:
            self._thread = threading.Thread(target=self._snapshot_loop, name="ngc-snapshot", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"EmbeddedCountsStore(path={self.path!r})"

    # ----------------------------------------------------------------- namespaces

    def _ns(self, namespace: str) -> _Namespace:
        validate_namespace(namespace)
        ns = self._namespaces.get(namespace)
        if ns is None:
            raise no_such_namespace(namespace)
        return ns

    def _find_namespace(self, namespace: str) -> NamespaceRecord | None:
        with self._lock:
            ns = self._namespaces.get(namespace)
            return None if ns is None else ns.info

    def _namespace_names(self) -> list[str]:
        with self._lock:
            return list(self._namespaces)

    def _insert_namespace(self, info: NamespaceRecord) -> NamespaceRecord | None:
        with self._lock:
            existing = self._namespaces.get(info.name)
            if existing is not None:
                return existing.info
            self._namespaces[info.name] = _Namespace(info, now_ms(), self.config.dedup_ttl_ms)
            return None

    def namespace_info(self, namespace: str) -> NamespaceRecord:
        with self._lock:
            return self._ns(namespace).info

    def drop_namespace(self, namespace: str) -> bool:
        validate_namespace(namespace)
        with self._lock:
            self._leases.forget_base(namespace)  # its files go with it
            return self._namespaces.pop(namespace, None) is not None

    # ----------------------------------------------------------------- writes

    def _record(self, namespace: str, stale: NamespaceRecord | None = None) -> NamespaceRecord:
        with self._lock:  # always the current record: nothing is cached
            return self._ns(namespace).info

    def _write_units(self, info: NamespaceRecord, units: list[Unit]) -> list[UnitAnswer]:
        fields = [unit.batch.field_list() for unit in units]  # outside the lock: the expensive part
        with self._lock:
            ns = self._ns(info.name)
            if ns.info.instance != info.instance:
                raise StaleNamespace
            return [self._write_unit(ns, unit, unit_fields) for unit, unit_fields in zip(units, fields)]

    def _write_unit(self, ns: _Namespace, unit: Unit, fields: list[bytes]) -> UnitAnswer:
        """One unit, all or nothing (the caller holds the lock): written with its dedup records if no pair was seen."""
        seen: list[Seen | NgramCacheError] = []
        for client_id, seq in unit.pairs:
            dedup = ns.dedup.get(client_id)
            try:
                seen.append(Seen.APPLIED if dedup is not None and dedup.seen(seq) else Seen.NEW)
            except BatchTooOldError as exc:
                seen.append(exc)
        if any(s is not Seen.NEW for s in seen):
            return seen
        self._write(ns, unit.batch, fields)
        for client_id, seq in unit.pairs:
            dedup = ns.dedup.get(client_id)
            if dedup is None:
                dedup = ns.dedup[client_id] = DedupWindow(self.config.dedup_window)
            dedup.record(seq)
        return None

    def _write(self, ns: _Namespace, enc: EncodedBatch, fields: list[bytes]) -> None:
        """Add an encoded batch's increments (``fields``: its `field_list`) and mark its buckets changed; the caller holds the lock."""
        buckets = ns.buckets
        for bucket, field, count in zip(enc.buckets.tolist(), fields, enc.counts.tolist()):
            entries = buckets.get(bucket)
            if entries is None:
                entries = buckets[bucket] = {}
            entries[field] = entries.get(field, 0) + count
        ns.open.update(enc.buckets.tolist())
        self._applies += 1
        if self._applies % _EXPIRE_EVERY == 0:
            self._expire_dedup()

    # ----------------------------------------------------------------- the fleet history (`embedded_history`)

    def _append_history(self, namespace: str, client_id: str, batch_seq: int, records: Sequence[HistoryRecord],
                        fingerprint: bytes | None) -> HistoryAppend:
        with self._lock:
            info = self._ns(namespace).info
        checked = self._check_history(info, fingerprint, client_id, records)  # outside the lock
        with self._lock:
            ns = self._ns(namespace)
            if ns.info.instance != info.instance:
                raise namespace_changed(namespace, "append_history")
            return ns.history.append(client_id, batch_seq, checked, self.config.history_budget, now_ms())

    def _read_history(self, namespace: str, after: str, limit: int, groups: tuple[str, ...] = ()) -> HistoryPage:
        with self._lock:  # one history per namespace: groups is only a hint
            return self._ns(namespace).history.read(after, limit, self.config.history_budget, now_ms())

    def _history_stats(self, namespace: str) -> dict[str, int]:
        with self._lock:
            ns = self._ns(namespace)
            ns.history.trim(self.config.history_budget, now_ms())
            return ns.history.stats()

    # ----------------------------------------------------------------- reads

    def lookup(self, namespace: str, ngram: Sequence[int]) -> dict[int, int]:
        with self._lock:
            ns = self._ns(namespace)
            info = ns.info
            key = ngram_key(ngram, info)
            entries = ns.buckets.get(ngram_bucket(ngram, info), {})
            size = len(key) + info.token_width
            found = {f: c for f, c in entries.items() if len(f) == size and f.startswith(key)}
        return {int.from_bytes(f[len(key):], "little"): c for f, c in found.items()}

    def _tick(self, ns: _Namespace) -> None:
        """Advance the namespace's clock; on a new epoch, close the open change piece and trim history."""
        if not ns.clock.tick(now_ms(), self.config.epoch_ms, self.config.history_epochs):
            return
        if ns.open:
            ns.closed.append((ns.clock.cur, ns.open))
            ns.open = pyroaring.BitMap()
        floor = ns.clock.floor
        while ns.closed and ns.closed[0][0] <= floor:
            ns.closed.pop(0)

    def version(self, namespace: str) -> int:
        with self._lock:
            ns = self._ns(namespace)
            self._tick(ns)
            return ns.clock.cur

    def changes_since(self, namespace: str, version: int) -> ChangeSet:
        since = int(version)
        with self._lock:
            ns = self._ns(namespace)
            self._tick(ns)
            check_version(namespace, since, ns.clock.floor, ns.clock.cur)
            changed = pyroaring.BitMap.union(ns.open, *(bits for end, bits in ns.closed if end > since))
            rows = self._rows(ns, changed)
            return ChangeSet(ns.clock.cur, rows, np.array(changed, dtype=np.uint32))

    def _rows(self, ns: _Namespace, buckets: Iterable[int]) -> np.ndarray:
        fields: list[bytes] = []
        counts: list[int] = []
        for bucket in buckets:
            entries = ns.buckets.get(bucket)
            if entries:
                fields.extend(entries)
                counts.extend(entries.values())
        return decode_fields(fields, counts, ns.info.token_width)

    def export(self, namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        with self._lock:
            ns = self._ns(namespace)
            ids = sorted(ns.buckets)
        i = 0
        while i < len(ids):
            with self._lock:  # a chunk at a time, so writers are not blocked for the whole export
                picked: list[int] = []
                rows = 0
                while i < len(ids) and rows < chunk_rows:
                    rows += len(ns.buckets.get(ids[i], ()))
                    picked.append(ids[i])
                    i += 1
                chunk = self._rows(ns, picked)
            if len(chunk):
                yield chunk

    # ----------------------------------------------------------------- snapshots

    def snapshot(self) -> None:
        """Write the whole store to the snapshot file atomically (no-op without a path)."""
        if not self.path:
            return
        with self._lock:
            # "committed" (optional: older snapshots lack it, older readers ignore it): the generation records.
            header: dict[str, Any] = {"format": _FORMAT, "namespaces": [], "committed": self._leases.to_json()}
            blobs: list[bytes] = []
            for name, ns in self._namespaces.items():
                rows = self._rows(ns, list(ns.buckets))
                header["namespaces"].append({
                    "name": name, "fingerprint": ns.info.fingerprint, "vocab_size": ns.info.vocab_size,
                    "buckets": ns.info.buckets, "shards": ns.info.shards, "instance": ns.info.instance,
                    "cur": ns.clock.cur, "entries": len(rows),
                    "dedup": {cid: sorted(d.seqs) for cid, d in ns.dedup.items()},
                })
                blobs.append(np.ascontiguousarray(rows[:, :KEY_WIDTH], dtype=_KEY_DTYPE).tobytes())
                blobs.append(np.ascontiguousarray(rows[:, COUNT], dtype=_COUNT_DTYPE).tobytes())
        head = json.dumps(header, separators=(",", ":")).encode()
        body = b"".join([_MAGIC, struct.pack("<Q", len(head)), head, *blobs])
        data = body + struct.pack("<I", zlib.crc32(body))
        write_file_atomic(self.path, data)  # temporary file, fsync, rename, fsync of the directory
        log.debug("snapshot of %d namespace(s) written to %s", len(header["namespaces"]), self.path)

    def _load(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < len(_MAGIC) + 12 or data[:len(_MAGIC)] != _MAGIC:
            raise SnapshotFormatError(f"{path} is not a counts store snapshot (bad magic or too short)")
        body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
        if zlib.crc32(body) != crc:
            raise SnapshotFormatError(f"{path} is truncated or corrupt (checksum mismatch)")
        (head_len,) = struct.unpack_from("<Q", body, len(_MAGIC))
        pos = len(_MAGIC) + 8
        try:
            header = json.loads(body[pos:pos + head_len])
            if header.get("format") != _FORMAT:
                raise SnapshotFormatError(f"{path} has snapshot format {header.get('format')}, expected {_FORMAT}")
            pos += head_len
            start = now_ms()
            for entry in header["namespaces"]:
                k = int(entry["entries"])
                keys = np.frombuffer(body, dtype=_KEY_DTYPE, count=k * KEY_WIDTH, offset=pos).reshape(k, KEY_WIDTH)
                pos += k * KEY_WIDTH * _KEY_DTYPE.itemsize
                counts = np.frombuffer(body, dtype=_COUNT_DTYPE, count=k, offset=pos)
                pos += k * _COUNT_DTYPE.itemsize
                info = NamespaceRecord(validate_namespace(entry["name"]), normalize_fingerprint(entry["fingerprint"]),
                                     validate_vocab_size(entry["vocab_size"]),
                                     *validate_layout(entry["buckets"], entry["shards"]), str(entry["instance"]))
                # The keys checked as delta rows of count 1 (the counts are int64, checked apart).
                check = np.empty((k, ROW_WIDTH), dtype=DELTA_DTYPE)
                check[:, :KEY_WIDTH] = keys
                check[:, COUNT] = 1
                validate_deltas(check, info.vocab_size)
                if k and int(counts.min()) <= 0:
                    raise SnapshotFormatError(f"{path} holds a count <= 0")
                # Versions handed out before the restart may cover lost writes: start above them.
                ns = _Namespace(info, max(int(entry["cur"]) + 1, start), self.config.dedup_ttl_ms)
                matrix, lengths, buckets = fields_and_buckets(check, info)
                flat = matrix.tobytes()
                width = matrix.shape[1]
                for i, (bucket, length, count) in enumerate(zip(buckets.tolist(), lengths.tolist(),
                                                               counts.tolist())):
                    ns.buckets.setdefault(bucket, {})[flat[i * width:i * width + length]] = count
                ns.dedup = {validate_client_id(cid): DedupWindow(self.config.dedup_window, (int(s) for s in seqs))
                            for cid, seqs in entry["dedup"].items()}
                self._namespaces[info.name] = ns
            if pos != len(body):
                raise SnapshotFormatError(f"{path} has {len(body) - pos} unexpected trailing bytes")
            self._leases.load_json(header.get("committed", {}))
        except SnapshotFormatError:
            raise
        except (ValueError, KeyError, TypeError, InvalidArgumentError) as exc:
            self._namespaces.clear()
            raise SnapshotFormatError(f"{path} is not a valid snapshot: {exc}") from None
        log.debug("loaded %d namespace(s) from %s", len(self._namespaces), path)

    def _snapshot_loop(self) -> None:
        while not self._stop.wait(self.config.snapshot_seconds):
            try:
                self.snapshot()
                self._expire_dedup()
            except Exception:  # keep snapshotting; the next interval may succeed (disk full, ...)
                log.exception("counts store snapshot to %s failed", self.path)

    def _expire_dedup(self) -> None:
        limit = time.monotonic() - self.config.dedup_ttl_seconds
        with self._lock:
            for ns in self._namespaces.values():
                for cid in [cid for cid, d in ns.dedup.items() if d.touched < limit]:
                    del ns.dedup[cid]

    def close(self) -> None:
        """Stop the snapshot thread and write a last snapshot (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.snapshot()
