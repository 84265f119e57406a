"""Rebuild leases: the lease and committed-generation records, their checks and errors, and the in-process `LeaseTable`.

One rebuild per namespace at a time across every replica: a lease held by one holder for
ttl_ms, and a fencing token that grows with every acquisition. A new generation is
committed only by the current lease's holder and token, and only above the committed one,
in one atomic step: a paused or partitioned old leader (its lease expired) can never
commit, and no generation number is committed twice. These records do not belong to one
namespace incarnation: generation numbers keep growing across a drop. The embedded store
keeps them in a `LeaseTable`; the Redis backend in Lua scripts with the same rules
(`redis_leases`). Both are `Leases`, which `CountsStore` calls for its lease methods.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Protocol

from ngramcache.client.kernel.errors import GenerationNotNewerError, InvalidArgumentError, LeaseHeldError, LeaseLostError

from .namespace import validate_namespace

__all__ = [
    "CommittedGeneration",
    "Lease",
    "LeaseTable",
    "Leases",
    "check_lease_args",
    "check_ttl",
    "lease_held",
    "lease_lost",
    "next_committed",
    "not_newer",
]


@dataclasses.dataclass(frozen=True)
class Lease:
    """A rebuild lease: the namespace, who holds it, and its fencing token (grows with each acquisition)."""

    namespace: str
    holder: str
    token: int


@dataclasses.dataclass(frozen=True)
class CommittedGeneration:
    """The newest generation committed under a lease: its number (0: none), where it was built, the
    token, how it was made ("rebuild", or "publish" for a file published as it is), and the
    namespace's corpus base.

    The base is the latest generation published as it is (a corpus: it holds no dynamic counts),
    which every rebuild folds in; 0 when none was published, or the operator dropped it
    (``keep_base=False``), or the namespace was dropped. A publish sets it to its own generation
    and location; a rebuild carries it unchanged. (A Redis record stored before bases existed
    reads a "publish" as its own base, and a rebuild's as none.)
    """

    generation: int
    location: str
    token: int
    kind: str = "rebuild"
    base: int = 0  # the corpus base's generation (0: none)
    base_location: str = ""  # the replica that received the base's Publish (it can serve the file)


def next_committed(previous: CommittedGeneration | None, lease: Lease, generation: int, location: str, kind: str,
                   keep_base: bool) -> CommittedGeneration:
    """The record a commit of ``generation`` writes over ``previous`` (the rules of `CommittedGeneration`)."""
    if kind == "publish":
        return CommittedGeneration(generation, location, lease.token, kind, generation, location)
    if keep_base and previous is not None:
        return CommittedGeneration(generation, location, lease.token, kind, previous.base, previous.base_location)
    return CommittedGeneration(generation, location, lease.token, kind)


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


class Leases(Protocol):
    """A backend's rebuild leases and committed generations (the rules above); `CountsStore`'s lease methods call it."""

    def acquire(self, namespace: str, holder: str, ttl_ms: int) -> Lease: ...

    def renew(self, lease: Lease, ttl_ms: int) -> bool: ...

    def release(self, lease: Lease) -> bool: ...

    def commit(self, lease: Lease, generation: int, location: str, kind: str = "rebuild", *,
               keep_base: bool = True) -> None: ...

    def committed(self, namespace: str) -> CommittedGeneration: ...

    def forget_base(self, namespace: str) -> None: ...


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

    def commit(self, lease: Lease, generation: int, location: str, kind: str = "rebuild", *,
               keep_base: bool = True) -> None:
        with self._lock:
            if not self._holds(lease):
                raise lease_lost(lease)
            committed = self._committed.get(lease.namespace)
            if committed is not None and generation <= committed.generation:
                raise not_newer(lease.namespace, generation, committed.generation)
            self._committed[lease.namespace] = next_committed(committed, lease, generation, location, kind, keep_base)

    def committed(self, namespace: str) -> CommittedGeneration:
        validate_namespace(namespace)
        with self._lock:
            return self._committed.get(namespace, CommittedGeneration(0, "", 0))

    def forget_base(self, namespace: str) -> None:
        """The namespace was dropped: its base file is gone (its numbers keep growing)."""
        with self._lock:
            committed = self._committed.get(namespace)
            if committed is not None:
                self._committed[namespace] = dataclasses.replace(committed, base=0, base_location="")

    def to_json(self) -> dict[str, dict[str, object]]:
        """The committed records, for a snapshot (leases and fences are not kept: a restart ends them)."""
        with self._lock:
            return {ns: dataclasses.asdict(c) for ns, c in self._committed.items()}

    def load_json(self, records: dict[str, dict[str, object]]) -> None:
        """Restore what `to_json` gave (a snapshot's; raises KeyError/TypeError/ValueError on a bad one)."""
        with self._lock:
            for ns, r in records.items():
                self._committed[validate_namespace(ns)] = CommittedGeneration(
                    int(r["generation"]), str(r["location"]), int(r["token"]), str(r["kind"]),  # type: ignore[call-overload]
                    int(r["base"]), str(r["base_location"]))  # type: ignore[call-overload]
