"""The `CountsStore` interface and the logic every backend shares: argument checks, namespace creation, batches and groups.

Dynamic counts are (n-gram of 1..NGRAM_MAX tokens, follower token) -> count, per cache
namespace. A backend implements the storage primitives (the abstract methods); the rules
live in this package, so both backends give the same answers and the same errors:

* **Exactly once.** A batch is identified by (client_id, seq); `dedup.DedupWindow` keeps
  the seqs of one client applied within ``dedup_window`` of its highest and refuses a seq
  that far behind with `BatchTooOldError`. (The Redis backend runs the same rule inside
  its APPLY Lua script, atomically with the writes.)
* **Groups.** `apply_group` applies the batches of one or several clients as one unit per
  shard: each (client_id, seq) is checked against its dedup record, the batches are summed
  (an entry pushed by ten clients is one increment) and applied with every dedup record,
  atomically; a unit that holds an already-applied batch writes nothing and is redone
  without it, so a group never applies a batch twice or half. The checks and the redo loop
  are here, written once; a backend writes units (`_write_units`) and never calls back.
* **Versions.** `versions.EpochClock` hands out versions and keeps a bounded history;
  `versions.check_version` answers a version outside it with `ResyncRequiredError`
  instead of a silently wrong mirror.
* **Leases.** One rebuild per namespace at a time, under a fenced lease: the backend's
  `leases.Leases`, which the lease methods here call.

The values the calls take and answer are in `values`; callers also import the ones they
use with `CountsStore` from here.

This module never imports a backend; `open_counts_store` (factory.py) does.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError, TokenizerMismatchError

from .config import CountsStoreConfig
from .group import plan_group
from .history import (
    HistoryAppend,
    HistoryBatch,
    HistoryPage,
    HistoryRecord,
    validate_batch_seq,
    validate_limit,
    validate_records,
)
from .layout import EncodedBatch, encode_group
from .leases import CommittedGeneration, Lease, Leases
from .namespace import (
    NamespaceRecord,
    check_tokenizer,
    new_instance_id,
    normalize_fingerprint,
    rerun_if_stale,
    validate_layout,
    validate_namespace,
    validate_vocab_size,
)
from .values import ApplyResult, ChangeSet, GroupItem, ItemOutcome, Seen, Unit, UnitAnswer, validate_client_id, validate_seq

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "ApplyResult",
    "ChangeSet",
    "CommittedGeneration",
    "CountsStore",
    "GroupItem",
    "ItemOutcome",
    "Lease",
    "validate_client_id",
    "validate_seq",
]


class CountsStore(abc.ABC):
    """Dynamic n-gram counts for many namespaces, each bound to one tokenizer.

    Every implementation is safe to share between threads. Use it as a context manager or
    call `close()`. A backend implements the abstract methods (storage primitives) and sets
    ``config`` and ``_leases``; argument checks, namespace creation, groups and the lease
    methods are done here.
    """

    config: CountsStoreConfig
    _leases: Leases  # the backend's rebuild leases (in process: a `LeaseTable`)
    _unit_per_shard: ClassVar[bool]  # a unit is one shard's entries (Redis), or the namespace's (embedded: one lock)

    def create_namespace(self, namespace: str, fingerprint: bytes | str, vocab_size: int, *,
                         buckets: int | None = None, shards: int | None = None) -> NamespaceRecord:
        """Create a namespace bound to a tokenizer, or return it if it already exists with that tokenizer.

        Args:
            namespace: 1..64 characters of [A-Za-z0-9_.-].
            fingerprint: the tokenizer fingerprint, 32 bytes or 64 hex digits.
            vocab_size: tokens lie in [0, vocab_size); at most MAX_VOCAB (2**24).
            buckets: power of two; default ``config.default_buckets``. Ignored if it exists.
            shards: power of two; default 1 (standalone, embedded) or 64 (Cluster).

        Raises:
            TokenizerMismatchError: the namespace exists with another fingerprint or vocab size.
            InvalidArgumentError: a malformed argument.
            BackendUnavailableError: the store could not be reached (retriable).
        """
        return self.ensure_namespace(namespace, fingerprint, vocab_size, buckets=buckets, shards=shards)[0]

    def ensure_namespace(self, namespace: str, fingerprint: bytes | str, vocab_size: int, *,
                         buckets: int | None = None, shards: int | None = None) -> tuple[NamespaceRecord, bool]:
        """`create_namespace`, also saying whether this call created the namespace.

        Returns:
            (the namespace's record, True when this call created it). Of concurrent calls
            for one new name exactly one answers True.

        Raises:
            the errors of `create_namespace`.
        """
        validate_namespace(namespace)
        fp = normalize_fingerprint(fingerprint)
        vocab = validate_vocab_size(vocab_size)
        existing = self._find_namespace(namespace)
        if existing is None:
            nbuckets, nshards = validate_layout(buckets or self.config.default_buckets,
                                                shards or self.config.default_shards or self._default_shards())
            info = NamespaceRecord(namespace, fp, vocab, nbuckets, nshards, new_instance_id(),
                                 self._default_history_partitions())
            existing = self._insert_namespace(info)
            if existing is None:
                return info, True
        check_tokenizer(existing, fp, vocab)
        return existing, False

    def list_namespaces(self, *, after: str = "", limit: int | None = None) -> list[NamespaceRecord]:
        """The namespaces named after ``after``, in name order, at most ``limit`` of them (a page).

        Args:
            after: "" for the first page, else the last name of the previous page.
            limit: most records returned (None: all).

        Raises:
            InvalidArgumentError: ``after`` is not a namespace name, or ``limit`` < 1.
            BackendUnavailableError: the store could not be reached (retriable).
        """
        if after:
            validate_namespace(after)
        if limit is not None and limit < 1:
            raise InvalidArgumentError(f"limit must be >= 1, got {limit}")
        page: list[NamespaceRecord] = []
        for name in sorted(name for name in set(self._namespace_names()) if name > after):
            if limit is not None and len(page) >= limit:
                break
            info = self._find_namespace(name)
            if info is not None:  # None: dropped since it was listed
                page.append(info)
        return page

    @abc.abstractmethod
    def namespace_info(self, namespace: str) -> NamespaceRecord:
        """The namespace's record. Raises NamespaceNotFoundError."""

    @abc.abstractmethod
    def drop_namespace(self, namespace: str) -> bool:
        """Delete a namespace and all its counts; return whether it existed."""

    def apply(self, namespace: str, client_id: str, seq: int, deltas: np.ndarray, *,
              fingerprint: bytes | str | None = None) -> ApplyResult:
        """One sender's one batch, exactly once per (client_id, seq): `apply_group` with one item.

        Raises:
            NgramCacheError: the item's error (nothing of it written): InvalidArgumentError,
                TokenizerMismatchError, NamespaceNotFoundError, BatchTooOldError, or a retriable
                BackendUnavailableError (retry the same client_id, seq and deltas).
        """
        outcome, = self.apply_group(namespace, [GroupItem(client_id, seq, deltas, fingerprint)])
        if not isinstance(outcome, ApplyResult):
            raise outcome
        return outcome

    def apply_group(self, namespace: str, items: Sequence[GroupItem]) -> list[ItemOutcome]:
        """Apply the batches of one or several senders, exactly once per (client_id, seq) each.

        The batches are summed (an entry in ten batches costs one increment) and written as one
        unit per shard (one unit on standalone Redis and embedded): the unit first checks
        every batch's (client_id, seq) against its dedup record and, if none was applied
        before, writes the summed increments and every dedup record atomically. If some were
        applied before, the unit writes nothing and is redone without them. So a retry after a
        lost reply, a timeout, a reconnect or a restart never counts a batch (a unit of it, on
        a Cluster) twice, and a crash never leaves half a unit.

        A sender MUST use a client_id of its own (e.g. a UUID per process), increasing seqs,
        and keep at most ``config.dedup_window`` batches unacknowledged.

        Each item is checked on its own (client_id, seq, tokenizer, rows, dedup window): a bad
        item gets its error in its place in the answer and nothing of it is written, without
        failing the others. An item repeating an earlier item's (client_id, seq) is applied
        after it, as if sent later (so it is a duplicate unless the earlier one was refused).

        Args:
            namespace: an existing namespace.
            items: the batches (int32 delta rows, see `ngramcache.client.kernel.rows.validate_deltas`);
                any senders, any number per sender.

        Returns:
            One outcome per item, in order: its `ApplyResult` (``duplicate`` when it had been
            applied before), or the error that refused it (InvalidArgumentError,
            TokenizerMismatchError: nothing of it written; BatchTooOldError: too old in a
            shard, so not applied there; on a Cluster its units in shards where it is within
            the window may be applied).

        Raises:
            NamespaceNotFoundError: no such namespace.
            InvalidArgumentError: a malformed namespace name.
            BackendUnavailableError: retriable; the items may have been applied, whole or (on a
                Cluster) some of their units, so retry every item with the same
                (client_id, seq, deltas).
        """
        outcomes: list[ItemOutcome | None] = [None] * len(items)
        checked: dict[int, GroupItem] = {}
        for i, item in enumerate(items):
            try:
                checked[i] = dataclasses.replace(item, client_id=validate_client_id(item.client_id),
                                                 seq=validate_seq(item.seq))
            except InvalidArgumentError as exc:
                outcomes[i] = exc
        if checked:  # checked against the record the backend holds, again against a fresh one if it was stale
            done = rerun_if_stale(namespace, functools.partial(self._record, namespace),
                                  functools.partial(self._apply_checked, checked))
            for i, outcome in done.items():
                outcomes[i] = outcome
        assert all(o is not None for o in outcomes), "an item of the group got no outcome"
        return [o for o in outcomes if o is not None]

    @abc.abstractmethod
    def lookup(self, namespace: str, ngram: Sequence[int]) -> dict[int, int]:
        """Followers of one n-gram (1..NGRAM_MAX tokens) and their counts."""

    @abc.abstractmethod
    def version(self, namespace: str) -> int:
        """The current version: take it BEFORE `export` to mirror with `changes_since` afterwards."""

    @abc.abstractmethod
    def changes_since(self, namespace: str, version: int) -> ChangeSet:
        """Current counts of every bucket changed since ``version``, and the new version.

        Raises:
            ResyncRequiredError: ``version`` is older than the history kept (or from another
                incarnation of the namespace); start over from `version` + `export`.
        """

    @abc.abstractmethod
    def export(self, namespace: str, *, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
        """Every count, as int64 count rows (k, ROW_WIDTH) of at most about ``chunk_rows`` rows.

        Each bucket is read atomically; the export is not one point-in-time snapshot, which
        is why a mirror takes `version` first and then catches up with `changes_since`.
        """

    # ----------------------------------------------------------------- the fleet history (rules in `history`)

    def append_history(self, namespace: str, client_id: str, batch_seq: int, records: Sequence[HistoryRecord], *,
                       fingerprint: bytes | None = None) -> HistoryAppend:
        """Append one batch of history records, exactly once per (client_id, batch_seq).

        A sender sends one batch at a time with increasing batch_seqs, so a batch_seq at or
        below the highest this client_id had stored in this namespace is a duplicate (a
        retry): nothing is stored and the answer's ``stored`` is False. On a partitioned
        history (`NamespaceRecord.history_partitions` > 1) the rule holds per partition, for the
        batch's records there: a retry after a try that stored some parts stores the others,
        and its counts are theirs. The records are checked whole
        first; a bad one raises and nothing is stored (the batch_seq is not consumed). Each
        record's client_id is ignored and set to ``client_id``. An empty batch stores nothing
        but consumes its batch_seq.

        Near-duplicate prompts are stored once, best effort: a prompt record (`history.is_prompt`:
        at offset 0, in the group its tokens name) whose (group, tokens) digest
        (`history.duplicate_key`) equals that of one stored in the last
        `history.DUPLICATE_WINDOW_MS` (the same prompt sent by 8 siblings) is skipped and counted
        in the answer's ``skipped_*``; the digests are kept only for that window. No other record
        is ever skipped, so stored + skipped is the whole batch.

        After the append the history is trimmed to ``config.history_budget``: oldest first,
        while it holds more than ``max_bytes`` (4 bytes a token) or records older than
        ``max_age_s``. The check, the appends, the dedup record and the trim are one atomic
        step (one Lua script on Redis, one lock embedded).

        Args:
            namespace: an existing namespace.
            client_id: the sender, 1..128 characters of [A-Za-z0-9_.:@/-].
            batch_seq: the sender's batch number, an integer in [0, 2**53).
            records: at most MAX_BATCH_RECORDS `HistoryRecord`s.
            fingerprint: when given, must match the namespace's tokenizer.

        Returns:
            What this call did: ``stored`` False for a duplicate; else the records and tokens
            stored and skipped (`history.HistoryAppend`).

        Raises:
            InvalidArgumentError: a bad argument or record (the message names the first bad one).
            TokenizerMismatchError: ``fingerprint`` differs from the namespace's.
            NamespaceNotFoundError: no such namespace.
            BackendUnavailableError: retriable; retry with the same (client_id, batch_seq, records).
        """
        validate_client_id(client_id)
        return self._append_history(namespace, client_id, validate_batch_seq(batch_seq), records, fingerprint)

    def append_history_many(self, namespace: str, batches: Sequence[HistoryBatch]) -> list[HistoryAppend | NgramCacheError]:
        """Several senders' batches at once (the service gathers concurrent pushes): each as `append_history` takes it.

        Each batch is checked alone: one refused (a bad record, another tokenizer, a bad
        client_id or batch_seq) gets its error in its place and the others go on. On Redis the
        batches' parts in each partition are one script call (one per partition for all of
        them, not one per batch); each part keeps the exactly-once rule of its batch.

        Returns:
            Per batch, in order: its `HistoryAppend`, or the `NgramCacheError` that refused it.

        Raises:
            NamespaceNotFoundError, BackendUnavailableError: every batch failed (retry each).
        """
        out: list[HistoryAppend | NgramCacheError] = []
        for batch in batches:
            try:
                out.append(self.append_history(namespace, batch.client_id, batch.batch_seq, batch.records,
                                               fingerprint=batch.fingerprint))
            except (InvalidArgumentError, TokenizerMismatchError) as exc:
                out.append(exc)
        return out

    def read_history(self, namespace: str, after: str = "", limit: int = 1024, *,
                     groups: Collection[str] = ()) -> HistoryPage:
        """Records stored after cursor ``after``, oldest first, at most ``limit`` of them.

        A partitioned history (`NamespaceRecord.history_partitions` > 1, a Cluster) is read in
        every partition at once and merged by store time (fair: the oldest first, whichever
        partition holds them), so a page is oldest first per partition and nearly so across
        them; its cursors are composite (`history.parse_cursor`).

        Args:
            namespace: an existing namespace.
            after: "" from the oldest kept record, else the cursor of a previous page (or of a
                record). A cursor of another incarnation (a namespace dropped and recreated, a
                restarted embedded store, another namespace) is answered from the oldest kept
                record with ``gap=True``.
            limit: 1..65536.
            groups: a hint for a group-first read: only the partitions holding these groups
                are read (the page may still hold other groups' records of those partitions:
                the caller filters; the cursor moves in those partitions alone). Empty: all.

        Raises:
            InvalidArgumentError: a malformed cursor or limit.
            NamespaceNotFoundError: no such namespace.
            BackendUnavailableError: retriable.
        """
        if not isinstance(after, str):
            raise InvalidArgumentError(f"cursor must be a string, got {type(after).__name__}")
        if isinstance(groups, str):
            raise InvalidArgumentError("groups must be a collection of group names, not a string")
        return self._read_history(namespace, after, validate_limit(limit), tuple(groups))

    def history_stats(self, namespace: str) -> dict[str, int]:
        """What the namespace's history keeps now: {"records": .., "tokens": .., "bytes": ..} (for metrics).

        Raises:
            NamespaceNotFoundError, BackendUnavailableError.
        """
        return self._history_stats(namespace)

    # ----------------------------------------------------------------- rebuild leases (rules in `leases`)

    def acquire_lease(self, namespace: str, holder: str, ttl_ms: int) -> Lease:
        """Take the rebuild lease of ``namespace`` for ``ttl_ms`` ms (``holder``: who asks, for messages).

        Raises:
            LeaseHeldError: another holder has it; its holder and the ms it has left are in the message.
        """
        return self._leases.acquire(namespace, holder, ttl_ms)

    def renew_lease(self, lease: Lease, ttl_ms: int) -> bool:
        """Extend ``lease`` to ``ttl_ms`` ms from now; False when it was lost (expired, taken)."""
        return self._leases.renew(lease, ttl_ms)

    def release_lease(self, lease: Lease) -> bool:
        """Give ``lease`` up; False when it was already lost."""
        return self._leases.release(lease)

    def commit_generation(self, lease: Lease, generation: int, location: str, kind: str = "rebuild", *,
                          keep_base: bool = True) -> None:
        """Record ``generation`` (made by ``kind`` at ``location``) as the namespace's newest, under ``lease``.

        The namespace's corpus base (`CommittedGeneration.base`) moves in the same atomic step: a
        ``kind`` "publish" becomes the base itself; a rebuild carries the previous base, or drops it
        with ``keep_base=False``.

        Raises:
            LeaseLostError: ``lease`` is no longer the namespace's current lease.
            GenerationNotNewerError: ``generation`` is not above the committed one.
        """
        self._leases.commit(lease, generation, location, kind, keep_base=keep_base)

    def committed_generation(self, namespace: str) -> CommittedGeneration:
        """The newest committed generation of ``namespace`` (generation 0: none) and its corpus base."""
        return self._leases.committed(namespace)

    def close(self) -> None:  # noqa: B027 - a hook with a no-op default, not an abstract method
        """Release connections (and, embedded, write a last snapshot)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- backend primitives

    def _default_shards(self) -> int:
        """Shards of a new namespace when neither the call nor the config says."""
        return 1

    def _default_history_partitions(self) -> int:
        """History partitions of a new namespace (a backend that keeps one history per namespace: 1)."""
        return 1

    @abc.abstractmethod
    def _find_namespace(self, namespace: str) -> NamespaceRecord | None:
        """The stored record of a (validated) namespace name, or None."""

    @abc.abstractmethod
    def _namespace_names(self) -> Iterable[str]:
        """The names of every namespace, in any order (a name may repeat)."""

    @abc.abstractmethod
    def _insert_namespace(self, info: NamespaceRecord) -> NamespaceRecord | None:
        """Store a new namespace unless one of that name exists: return None, or the existing record."""

    @abc.abstractmethod
    def _record(self, namespace: str, stale: NamespaceRecord | None = None) -> NamespaceRecord:
        """The record a write is checked against: the one the backend holds (``stale`` None), else read again.

        Raises:
            NamespaceNotFoundError: no such namespace (with ``stale``: also when the store still
                holds that instance but lost its data).
            InvalidArgumentError: a malformed name.
        """

    @abc.abstractmethod
    def _write_units(self, info: NamespaceRecord, units: list[Unit]) -> list[UnitAnswer]:
        """Write each unit atomically with its pairs' dedup records, unless one of them was applied before or is
        too old: then nothing of it. Answer per unit (`values.UnitAnswer`); the units of one call are
        independent (on Redis they run pipelined, on their shards' nodes).

        Raises:
            StaleNamespace: the namespace is no longer the instance of ``info`` (nothing written).
            NamespaceNotFoundError, BackendUnavailableError.
        """

    def _append_history(self, namespace: str, client_id: str, batch_seq: int, records: Sequence[HistoryRecord],
                        fingerprint: bytes | None) -> HistoryAppend:
        """`append_history` with a valid client_id and batch_seq; check with `_check_history` first."""
        raise NgramCacheError(f"{type(self).__name__} keeps no fleet history")

    def _read_history(self, namespace: str, after: str, limit: int, groups: tuple[str, ...] = ()) -> HistoryPage:
        """`read_history` with a valid limit (``after`` parsed by `history.parse_cursor`)."""
        raise NgramCacheError(f"{type(self).__name__} keeps no fleet history")

    def _history_stats(self, namespace: str) -> dict[str, int]:
        raise NgramCacheError(f"{type(self).__name__} keeps no fleet history")

    @staticmethod
    def _check_history(info: NamespaceRecord, fingerprint: bytes | None, client_id: str,
                       records: Sequence[HistoryRecord]) -> list[HistoryRecord]:
        """Check the tokenizer and every record against a namespace before anything is stored."""
        check_tokenizer(info, fingerprint)
        return validate_records(records, client_id, info.vocab_size)

    def _apply_checked(self, items: dict[int, GroupItem], info: NamespaceRecord) -> dict[int, ItemOutcome]:
        """`apply_group` of the items whose client_ids and seqs are valid, against the namespace's record.

        The one redo loop of every backend. Each unit key (a shard, or the namespace) has a queue
        of units, one per wave (`group.plan_group`); a round writes the head of every queue
        (`_write_units`). A unit written is done; one that found some pairs applied before (or
        too old) wrote nothing and goes again without them: their increments leave its sum, so
        nothing counts twice and nothing is lost. A redo drops a pair, so this ends; it happens
        only after retries.
        """
        plan = plan_group(info, items, self.config.max_batch_rows, self._unit_per_shard)
        done, tally, queues = plan.done, plan.tally, plan.queues
        sums: dict[tuple[int, ...], EncodedBatch] = {}  # the items of a redone unit, summed once
        while queues:
            heads = [(key, *queue[0]) for key, queue in queues.items()]
            answers = self._write_units(info, [Unit(key, batch, [(items[i].client_id, items[i].seq) for i in alive])
                                               for key, alive, batch in heads])
            for (key, alive, _), answer in zip(heads, answers):
                queue = queues[key]
                queue.popleft()
                if answer is None:
                    for i in alive:
                        tally[i][1] += 1
                else:
                    for i, seen in zip(alive, answer):
                        if seen is Seen.APPLIED:
                            tally[i][2] += 1
                        elif isinstance(seen, NgramCacheError):
                            done[i] = seen  # too old in this shard: not applied there
                    fresh = tuple(i for i, seen in zip(alive, answer) if seen is Seen.NEW)
                    if fresh:
                        if fresh not in sums:
                            sums[fresh] = encode_group([items[i].deltas for i in fresh], info).batch
                        queue.appendleft((fresh, sums[fresh]))
                if not queue:
                    del queues[key]
        for i, (units, applied, duplicates, entries) in tally.items():
            done.setdefault(i, ApplyResult(units, applied, duplicates, entries))
        return done
