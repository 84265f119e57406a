"""The `CountsStore` interface and the logic every backend shares: argument checks, dedup window, epoch clock, resync checks and error texts.

Dynamic counts are (n-gram of 1..NGRAM_MAX tokens, follower token) -> count, per cache
namespace. A backend implements the storage primitives (the abstract methods); the rules
live here, so both backends give the same answers and the same errors:

* **Exactly once.** A batch is identified by (client_id, seq). `DedupWindow` keeps the
  seqs of one client applied within ``dedup_window`` of its highest; a seq that far behind
  is refused with `BatchTooOldError`. (The Redis backend runs the same rule inside its
  APPLY Lua script, atomically with the writes.)
* **Groups.** `apply_group` applies the batches of several clients as one unit per
  shard: each (client_id, seq) is checked against its dedup record, the batches are summed
  (an entry pushed by ten clients is one increment) and applied with every dedup record,
  atomically; a unit that holds an already-applied batch writes nothing and is redone
  without it, so a group never applies a batch twice or half.
* **Versions.** A version is the time in milliseconds at which an epoch opened, bumped by
  at least one. `EpochClock` advances it at most once per ``epoch_seconds`` and keeps
  ``history_epochs`` epochs; its oldest is the floor (the Redis backend's TICK script
  mirrors it). A fresh history (a new namespace, an embedded store reloaded from its
  snapshot) therefore starts above every version handed out before it, and
  `check_version` answers an old version with `ResyncRequiredError` instead of a silently
  wrong mirror.

This module never imports a backend; `open_counts_store` (factory.py) does.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

import numpy as np

from ngramcache.client.errors import (
    BatchTooOldError,
    GenerationNotNewerError,
    InvalidArgumentError,
    LeaseHeldError,
    LeaseLostError,
    NamespaceNotFoundError,
    NgramCacheError,
    ResyncRequiredError,
)
from ngramcache.client.rows import COUNT, validate_deltas

from .config import CountsStoreConfig
from .layout import MAX_AGGREGATED_COUNT
from .namespace import (
    NamespaceInfo,
    check_tokenizer,
    new_instance_id,
    normalize_fingerprint,
    validate_layout,
    validate_namespace,
    validate_vocab_size,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "MAX_SEQ",
    "ApplyResult",
    "ChangeSet",
    "CountsStore",
    "DedupWindow",
    "EpochClock",
    "GroupItem",
    "ItemOutcome",
    "batch_too_old",
    "check_version",
    "history_lost",
    "namespace_changed",
    "no_such_namespace",
    "now_ms",
    "validate_client_id",
    "validate_seq",
]

MAX_SEQ: Final = 2**53 - 1
"""Largest seq: seqs travel through Lua numbers (doubles)."""

_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")


# --------------------------------------------------------------------------- values


@dataclasses.dataclass(frozen=True)
class Lease:
    """A rebuild lease: the namespace, who holds it, and its fencing token (grows with each acquisition)."""

    namespace: str
    holder: str
    token: int


@dataclasses.dataclass(frozen=True)
class CommittedGeneration:
    """The newest generation committed under a lease: its number (0: none), where it was built, the
    token, and how it was made ("rebuild", or "publish" for a file published as it is)."""

    generation: int
    location: str
    token: int
    kind: str = "rebuild"


def check_lease_args(namespace: str, holder: str, ttl_ms: int) -> None:
    validate_namespace(namespace)
    if not holder or len(holder) > 256 or "|" in holder:
        raise InvalidArgumentError("a lease holder is 1..256 characters without '|'")
    check_ttl(ttl_ms)


def check_ttl(ttl_ms: int) -> None:
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or not 1 <= ttl_ms <= 86_400_000:
        raise InvalidArgumentError(f"lease ttl_ms must be in 1..86400000, got {ttl_ms!r}")


def lease_held(namespace: str, holder: str, left_ms: int) -> LeaseHeldError:
    return LeaseHeldError(f"the rebuild lease of {namespace!r} is held by {holder} for {left_ms} ms more "
                          "(a rebuild is running there)")


def lease_lost(lease: Lease) -> LeaseLostError:
    return LeaseLostError(f"the rebuild lease of {lease.namespace!r} (token {lease.token}) expired or was taken "
                          "over; nothing was committed")


def not_newer(namespace: str, generation: int, committed: int) -> GenerationNotNewerError:
    return GenerationNotNewerError(f"generation {generation} of {namespace!r} is not above the committed "
                                   f"generation {committed}")


class LeaseTable:
    """Rebuild leases and committed generations in this process (the embedded store's). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[str, int, float]] = {}  # namespace -> (holder, token, expires monotonic)
        self._fence: dict[str, int] = {}
        self._committed: dict[str, CommittedGeneration] = {}

    def _current(self, namespace: str) -> tuple[str, int, float] | None:
        cur = self._leases.get(namespace)
        if cur is not None and cur[2] <= time.monotonic():
            del self._leases[namespace]
            return None
        return cur

    def acquire(self, namespace: str, holder: str, ttl_ms: int) -> Lease:
        check_lease_args(namespace, holder, ttl_ms)
        with self._lock:
            cur = self._current(namespace)
            if cur is not None and cur[0] != holder:
                raise lease_held(namespace, cur[0], int((cur[2] - time.monotonic()) * 1000))
            token = self._fence.get(namespace, 0) + 1
            self._fence[namespace] = token
            self._leases[namespace] = (holder, token, time.monotonic() + ttl_ms / 1000)
            return Lease(namespace, holder, token)

    def _holds(self, lease: Lease) -> bool:
        cur = self._current(lease.namespace)
        return cur is not None and cur[0] == lease.holder and cur[1] == lease.token

    def renew(self, lease: Lease, ttl_ms: int) -> bool:
        check_ttl(ttl_ms)
        with self._lock:
            if not self._holds(lease):
                return False
            self._leases[lease.namespace] = (lease.holder, lease.token, time.monotonic() + ttl_ms / 1000)
            return True

    def release(self, lease: Lease) -> bool:
        with self._lock:
            if not self._holds(lease):
                return False
            del self._leases[lease.namespace]
            return True

    def commit(self, lease: Lease, generation: int, location: str, kind: str = "rebuild") -> None:
        with self._lock:
            if not self._holds(lease):
                raise lease_lost(lease)
            committed = self._committed.get(lease.namespace)
            if committed is not None and generation <= committed.generation:
                raise not_newer(lease.namespace, generation, committed.generation)
            self._committed[lease.namespace] = CommittedGeneration(generation, location, lease.token, kind)

    def committed(self, namespace: str) -> CommittedGeneration:
        validate_namespace(namespace)
        with self._lock:
            return self._committed.get(namespace, CommittedGeneration(0, "", 0))


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What `CountsStore.apply` did with a batch.

    Attributes:
        units: units the batch touched (1 on standalone Redis and embedded; up to
            ``shards`` on a Cluster; 0 for an empty batch).
        applied: units applied by this call.
        duplicates: units already applied earlier (by a previous attempt of the same batch).
        entries: distinct (n-gram, follower) entries in the batch after summing repeats.
    """

    units: int
    applied: int
    duplicates: int
    entries: int

    @property
    def duplicate(self) -> bool:
        """True when every unit had already been applied: the whole call was a retry."""
        return self.units > 0 and self.duplicates == self.units


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise comparison of the arrays
class GroupItem:
    """One batch of a group given to `CountsStore.apply_group`: what one `apply` call would take.

    Attributes:
        client_id: the sender, 1..128 characters of [A-Za-z0-9_.:@/-].
        seq: the batch number of this sender, in [0, 2**53).
        deltas: int32 delta rows, see `ngramcache.client.rows.validate_deltas`.
        fingerprint: when not None, must match the namespace's tokenizer.
    """

    client_id: str
    seq: int
    deltas: np.ndarray
    fingerprint: bytes | str | None = None


ItemOutcome: TypeAlias = ApplyResult | NgramCacheError
"""What `CountsStore.apply_group` did with one item: its result, or the error that refused it."""


@dataclasses.dataclass(frozen=True)
class ChangeSet:
    """The answer of `CountsStore.changes_since`.

    Attributes:
        version: pass it to the next `changes_since` call.
        rows: int64 count rows (k, ROW_WIDTH) (see client.rows): the current absolute
            counts of every entry in the changed buckets (unused token slots -1). Counts
            never decrease, so setting each entry of a mirror to its row's count (an
            upsert, not an addition) brings the mirror up to date.
        buckets: uint32 array of the changed bucket ids, sorted.
    """

    version: int
    rows: np.ndarray
    buckets: np.ndarray


# --------------------------------------------------------------------------- argument checks


def validate_client_id(client_id: str) -> str:
    """Return ``client_id`` if it is 1..128 characters of [A-Za-z0-9_.:@/-], else raise InvalidArgumentError."""
    if not isinstance(client_id, str) or not _CLIENT_ID_RE.fullmatch(client_id):
        raise InvalidArgumentError(f"client_id must be 1..128 characters of [A-Za-z0-9_.:@/-], got {client_id!r}")
    return client_id


def validate_seq(seq: int) -> int:
    """Return ``seq`` as an int if it is an integer in [0, MAX_SEQ], else raise InvalidArgumentError."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= int(seq) <= MAX_SEQ:
        raise InvalidArgumentError(f"seq must be an integer in [0, 2**53), got {seq!r}")
    return int(seq)


# --------------------------------------------------------------------------- error texts


def no_such_namespace(namespace: str) -> NamespaceNotFoundError:
    return NamespaceNotFoundError(f"no counts namespace {namespace!r}")


def namespace_changed(namespace: str, during: str) -> NamespaceNotFoundError:
    """The namespace was dropped or recreated while ``during`` (an operation) ran."""
    return NamespaceNotFoundError(f"namespace {namespace!r} was dropped or recreated during {during}; retry")


def batch_too_old(seq: int, hwm: int, window: int) -> BatchTooOldError:
    return BatchTooOldError(
        f"batch seq {seq} is older than the dedup window ({window}) behind seq {hwm}: "
        "whether it was applied is unknown, so it was not applied")


def check_version(namespace: str, since: int, floor: int, cur: int) -> None:
    """Raise ResyncRequiredError unless ``floor <= since <= cur`` (the history kept)."""
    if since < floor or since > cur:
        raise ResyncRequiredError(
            f"version {since} of namespace {namespace!r} is outside the history kept "
            f"[{floor}, {cur}]; resync from version() + export()")


def history_lost(namespace: str, since: int) -> ResyncRequiredError:
    """A shard trimmed the history ``since`` needs after the clock said it was kept."""
    return ResyncRequiredError(f"version {since} of namespace {namespace!r} fell out of the history kept; resync")


# --------------------------------------------------------------------------- shared rules


def now_ms() -> int:
    """Wall-clock time in milliseconds (the unit of versions)."""
    return time.time_ns() // 1_000_000


class DedupWindow:
    """The seqs one client applied within ``window`` of its highest: the exactly-once record of a namespace.

    The Redis backend's APPLY script applies the same rule to a sorted set. Not
    thread-safe: the caller holds its store's lock.
    """

    __slots__ = ("hwm", "seqs", "touched", "window")

    def __init__(self, window: int, seqs: Iterable[int] = ()) -> None:
        self.window = window
        self.seqs = set(seqs)
        self.hwm = max(self.seqs, default=-1)  # the highest seq applied
        self.touched = time.monotonic()  # last use, for dedup_ttl_seconds

    def seen(self, seq: int) -> bool:
        """Whether ``seq`` was applied already.

        Raises:
            BatchTooOldError: ``seq`` is ``window`` or more behind the highest seq applied.
        """
        self.touched = time.monotonic()
        if seq <= self.hwm - self.window:
            raise batch_too_old(seq, self.hwm, self.window)
        return seq in self.seqs

    def record(self, seq: int) -> None:
        """Mark ``seq`` applied and forget the seqs that fell out of the window."""
        self.seqs.add(seq)
        self.hwm = max(self.hwm, seq)
        if len(self.seqs) > self.window:
            self.seqs = {s for s in self.seqs if s > self.hwm - self.window}


class EpochClock:
    """The versions of one namespace: the current one and the epochs kept (newest first).

    The Redis backend's TICK script applies the same rule to the namespace's clock and
    epochs keys. Not thread-safe: the caller holds its store's lock.
    """

    __slots__ = ("cur", "epochs", "opened_ms")

    def __init__(self, start_ms: int) -> None:
        self.cur = start_ms  # the newest version
        self.opened_ms = start_ms  # when the current epoch opened
        self.epochs: collections.deque[int] = collections.deque([start_ms])

    @property
    def floor(self) -> int:
        """The oldest version `changes_since` still serves."""
        return self.epochs[-1]

    def tick(self, now: int, epoch_ms: int, history_epochs: int) -> bool:
        """Open a new epoch if the current one is at least ``epoch_ms`` old; return whether it did."""
        if not (now > self.opened_ms and now - self.opened_ms >= epoch_ms):
            return False
        self.cur, self.opened_ms = max(self.cur + 1, now), now
        self.epochs.appendleft(self.cur)
        while len(self.epochs) > history_epochs + 1:
            self.epochs.pop()
        return True


# --------------------------------------------------------------------------- interface


class CountsStore(abc.ABC):
    """Dynamic n-gram counts for many namespaces, each bound to one tokenizer.

    Every implementation is safe to share between threads. Use it as a context manager or
    call `close()`. A backend implements the abstract methods; argument checks and
    namespace creation are done here.
    """

    config: CountsStoreConfig

    def create_namespace(self, namespace: str, fingerprint: bytes | str, vocab_size: int, *,
                         buckets: int | None = None, shards: int | None = None) -> NamespaceInfo:
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
                         buckets: int | None = None, shards: int | None = None) -> tuple[NamespaceInfo, bool]:
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
            info = NamespaceInfo(namespace, fp, vocab, nbuckets, nshards, new_instance_id())
            existing = self._insert_namespace(info)
            if existing is None:
                return info, True
        check_tokenizer(existing, fp, vocab)
        return existing, False

    def list_namespaces(self, *, after: str = "", limit: int | None = None) -> list[NamespaceInfo]:
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
        page: list[NamespaceInfo] = []
        for name in sorted(name for name in set(self._namespace_names()) if name > after):
            if limit is not None and len(page) >= limit:
                break
            info = self._find_namespace(name)
            if info is not None:  # None: dropped since it was listed
                page.append(info)
        return page

    @abc.abstractmethod
    def namespace_info(self, namespace: str) -> NamespaceInfo:
        """The namespace's record. Raises NamespaceNotFoundError."""

    @abc.abstractmethod
    def drop_namespace(self, namespace: str) -> bool:
        """Delete a namespace and all its counts; return whether it existed."""

    def apply(self, namespace: str, client_id: str, seq: int, deltas: np.ndarray, *,
              fingerprint: bytes | str | None = None) -> ApplyResult:
        """Add a batch of deltas, exactly once per (client_id, seq).

        Repeated keys in the batch are summed. The batch is validated whole before anything
        is written: a bad batch raises and changes nothing. Each unit of the batch (the whole
        batch on standalone Redis and embedded, the part in one shard on a Cluster) is
        applied atomically together with its dedup record, so retrying a batch after a lost
        reply, a timeout, a reconnect or a server restart never counts a unit twice.

        A sender MUST use a client_id of its own (e.g. a UUID per process), increasing seqs,
        and keep at most ``config.dedup_window`` batches unacknowledged.

        Args:
            namespace: an existing namespace.
            client_id: the sender, 1..128 characters of [A-Za-z0-9_.:@/-].
            seq: the batch number of this sender, in [0, 2**53).
            deltas: int32 delta rows, see `ngramcache.client.rows.validate_deltas`.
            fingerprint: when given, must match the namespace's tokenizer.

        Raises:
            InvalidArgumentError: a bad batch (nothing applied).
            TokenizerMismatchError: ``fingerprint`` differs from the namespace's.
            NamespaceNotFoundError: no such namespace.
            BatchTooOldError: ``seq`` is older than the dedup window.
            BackendUnavailableError: retriable; retry the same (client_id, seq, deltas).
        """
        return self.apply_many(namespace, client_id, [(seq, deltas)], fingerprint=fingerprint)[0]

    def apply_many(self, namespace: str, client_id: str, batches: Iterable[tuple[int, np.ndarray]], *,
                   fingerprint: bytes | str | None = None) -> list[ApplyResult]:
        """Apply several (seq, deltas) batches; backends may pipeline them. Same guarantees as `apply`.

        Every batch is validated before any is written; on an error, batches already
        written may be applied, and retrying the whole call is safe.
        """
        validate_client_id(client_id)
        checked = [(validate_seq(seq), deltas) for seq, deltas in batches]
        return self._apply_batches(namespace, client_id, checked, fingerprint)

    def apply_group(self, namespace: str, items: Sequence[GroupItem]) -> list[ItemOutcome]:
        """Apply the batches of several senders together, exactly once per (client_id, seq) each.

        The batches are summed (an entry in ten batches costs one increment) and written as one
        unit per shard (one unit on standalone Redis and embedded): the unit first checks
        every batch's (client_id, seq) against its dedup record and, if none was applied
        before, writes the summed increments and every dedup record atomically. If some were
        applied before, the unit writes nothing and is redone without them. So, as with
        `apply`, a retry after a lost reply, a timeout or a restart never counts a batch (a
        unit of it, on a Cluster) twice, and a crash never leaves half a unit.

        Each item is checked on its own (client_id, seq, tokenizer, rows, dedup window): a bad
        item gets its error in its place in the answer and nothing of it is written, without
        failing the others. An item repeating an earlier item's (client_id, seq) is applied
        after it, as if sent later (so it is a duplicate unless the earlier one was refused).

        Args:
            namespace: an existing namespace.
            items: the batches; any senders, any number per sender.

        Returns:
            One outcome per item, in order: its `ApplyResult` (``duplicate`` when it had been
            applied before), or the error that refused it (InvalidArgumentError,
            TokenizerMismatchError: nothing of it written; BatchTooOldError: too old in a
            shard, so not applied there; on a Cluster, as with `apply`, its units in shards
            where it is within the window may be applied).

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
        pending = list(checked)
        while pending:  # a pair repeated in the group goes in a later round, like a retry
            first: list[int] = []
            later: list[int] = []
            seen: set[tuple[str, int]] = set()
            for i in pending:
                key = (checked[i].client_id, checked[i].seq)
                (later if key in seen else first).append(i)
                seen.add(key)
            for i, outcome in zip(first, self._apply_group(namespace, [checked[i] for i in first])):
                outcomes[i] = outcome
            pending = later
        return self._complete(outcomes)

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

    # ----------------------------------------------------------------- rebuild leases
    #
    # One rebuild per namespace at a time across every replica: a lease held by one holder
    # for ttl_ms, and a fencing token that grows with every acquisition. A new generation is
    # committed only by the current lease's holder and token, and only above the committed
    # one, in one atomic step: a paused or partitioned old leader (its lease expired) can
    # never commit, and no generation number is committed twice. These records do not
    # belong to one namespace incarnation: generation numbers keep growing across a drop.

    @abc.abstractmethod
    def acquire_lease(self, namespace: str, holder: str, ttl_ms: int) -> Lease:
        """Take the rebuild lease of ``namespace`` for ``ttl_ms`` ms (``holder``: who asks, for messages).

        Raises:
            LeaseHeldError: another holder has it; its holder and the ms it has left are in the message.
        """

    @abc.abstractmethod
    def renew_lease(self, lease: Lease, ttl_ms: int) -> bool:
        """Extend ``lease`` to ``ttl_ms`` ms from now; False when it was lost (expired, taken)."""

    @abc.abstractmethod
    def release_lease(self, lease: Lease) -> bool:
        """Give ``lease`` up; False when it was already lost."""

    @abc.abstractmethod
    def commit_generation(self, lease: Lease, generation: int, location: str, kind: str = "rebuild") -> None:
        """Record ``generation`` (made by ``kind`` at ``location``) as the namespace's newest, under ``lease``.

        Raises:
            LeaseLostError: ``lease`` is no longer the namespace's current lease.
            GenerationNotNewerError: ``generation`` is not above the committed one.
        """

    @abc.abstractmethod
    def committed_generation(self, namespace: str) -> CommittedGeneration:
        """The newest committed generation of ``namespace`` (generation 0: none)."""

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

    @abc.abstractmethod
    def _find_namespace(self, namespace: str) -> NamespaceInfo | None:
        """The stored record of a (validated) namespace name, or None."""

    @abc.abstractmethod
    def _namespace_names(self) -> Iterable[str]:
        """The names of every namespace, in any order (a name may repeat)."""

    @abc.abstractmethod
    def _insert_namespace(self, info: NamespaceInfo) -> NamespaceInfo | None:
        """Store a new namespace unless one of that name exists: return None, or the existing record."""

    @abc.abstractmethod
    def _apply_batches(self, namespace: str, client_id: str, batches: list[tuple[int, np.ndarray]],
                       fingerprint: bytes | str | None) -> list[ApplyResult]:
        """Apply batches whose client_id and seqs are valid; check them with `_check_batches` first."""

    @abc.abstractmethod
    def _apply_group(self, namespace: str, items: list[GroupItem]) -> list[ItemOutcome]:
        """`apply_group` for items with valid client_ids and seqs, no two with the same pair.

        Check the namespace (raise when it is missing) and each item with `_check_group`
        before writing anything.
        """

    def _check_group(self, info: NamespaceInfo, items: Sequence[GroupItem]) -> tuple[list[ItemOutcome | None],
                                                                                      list[list[int]]]:
        """Check every item of a group against a namespace.

        Returns:
            (outcomes, parts): per item its error, an empty result (no rows: nothing to
            apply, the seq is not consumed) or None (to apply); and the indexes of the items
            to apply, in parts whose counts sum to at most MAX_AGGREGATED_COUNT, so no entry
            of a part overflows what a unit can add exactly (an item over it alone is a part
            of its own, which `encode_group` refuses).
        """
        outcomes: list[ItemOutcome | None] = [None] * len(items)
        parts: list[list[int]] = [[]]
        total = 0
        for i, item in enumerate(items):
            try:
                check_tokenizer(info, item.fingerprint)
                validate_deltas(item.deltas, info.vocab_size, self.config.max_batch_rows)
            except NgramCacheError as exc:
                outcomes[i] = exc
                continue
            if len(item.deltas) == 0:
                outcomes[i] = ApplyResult(0, 0, 0, 0)
                continue
            weight = int(item.deltas[:, COUNT].sum(dtype=np.int64))
            if parts[-1] and total + weight > MAX_AGGREGATED_COUNT:
                parts.append([])
                total = 0
            parts[-1].append(i)
            total += weight
        return outcomes, [p for p in parts if p]

    @staticmethod
    def _complete(outcomes: Sequence[ItemOutcome | None]) -> list[ItemOutcome]:
        """The outcomes of a group once every item has one."""
        done = [o for o in outcomes if o is not None]
        assert len(done) == len(outcomes), "an item of the group got no outcome"
        return done

    def _check_batches(self, info: NamespaceInfo, fingerprint: bytes | str | None,
                       batches: Iterable[tuple[int, np.ndarray]]) -> None:
        """Check the tokenizer and every batch against a namespace before anything is written."""
        check_tokenizer(info, fingerprint)
        for _, deltas in batches:
            validate_deltas(deltas, info.vocab_size, self.config.max_batch_rows)
