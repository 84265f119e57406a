"""A counts namespace: its immutable record (`NamespaceRecord`), the checks of its name, tokenizer, vocabulary and layout, its not-found errors, and the one rule for a record gone stale (`rerun_if_stale`)."""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable
from typing import Final, TypeVar

import numpy as np

from ngramcache.client import _core
from ngramcache.client.kernel.errors import InvalidArgumentError, NamespaceNotFoundError, TokenizerMismatchError
from ngramcache.client.kernel.rows import MAX_VOCAB

__all__ = [
    "FINGERPRINT_SIZE",
    "MAX_BUCKETS",
    "MAX_SHARDS",
    "NamespaceRecord",
    "StaleNamespace",
    "check_tokenizer",
    "namespace_changed",
    "new_instance_id",
    "no_such_namespace",
    "normalize_fingerprint",
    "rerun_if_stale",
    "token_width",
    "validate_layout",
    "validate_namespace",
    "validate_vocab_size",
]

FINGERPRINT_SIZE: Final[int] = _core.FINGERPRINT_SIZE
"""Bytes of a tokenizer fingerprint (the core's kFingerprintSize)."""

MAX_BUCKETS: Final = 2**30
"""Most buckets a namespace may have."""

MAX_SHARDS: Final = 16384
"""Most shards a namespace may have: Redis Cluster's slot count, so each shard can own a slot."""

_R = TypeVar("_R")
_T = TypeVar("_T")

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FINGERPRINT_HEX_RE = re.compile(f"[0-9a-fA-F]{{{2 * FINGERPRINT_SIZE}}}")


@dataclasses.dataclass(frozen=True)
class NamespaceRecord:
    """The immutable record of a namespace, fixed at creation.

    Attributes:
        name: the namespace name.
        fingerprint: tokenizer fingerprint, 64 lowercase hex digits (32 bytes).
        vocab_size: tokens and followers lie in [0, vocab_size); vocab_size <= MAX_VOCAB.
        buckets: number of buckets, a power of two.
        shards: number of shards (units of atomicity); divides ``buckets``.
        instance: random id of this incarnation; a dropped and recreated namespace gets a new one.
        history_partitions: partitions of its fleet history (`history.partition_of`), 1..64;
            1 on standalone Redis and embedded, and for a namespace created before partitions.
    """

    name: str
    fingerprint: str
    vocab_size: int
    buckets: int
    shards: int
    instance: str
    history_partitions: int = 1

    @property
    def token_width(self) -> int:
        """Bytes per token in a stored field (see `token_width`)."""
        return token_width(self.vocab_size)


def validate_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is 1..64 characters of [A-Za-z0-9_.-], not only dots (``.`` and ``..`` name
    folders), else raise InvalidArgumentError."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace) or not namespace.strip("."):
        shown = repr(namespace[:64]) + (f"... ({len(namespace)} characters)" if len(namespace) > 64 else "") \
            if isinstance(namespace, str) else type(namespace).__name__
        raise InvalidArgumentError(f"namespace must be 1..64 characters of [A-Za-z0-9_.-], not only dots, got {shown}")
    return namespace


def normalize_fingerprint(fingerprint: bytes | str) -> str:
    """A tokenizer fingerprint (32 bytes or 64 hex digits) as 64 lowercase hex digits."""
    if isinstance(fingerprint, (bytes, bytearray, memoryview)):
        raw = bytes(fingerprint)
        if len(raw) != FINGERPRINT_SIZE:
            raise InvalidArgumentError(f"fingerprint must be {FINGERPRINT_SIZE} bytes, got {len(raw)}")
        return raw.hex()
    if isinstance(fingerprint, str) and _FINGERPRINT_HEX_RE.fullmatch(fingerprint):
        return fingerprint.lower()
    raise InvalidArgumentError(f"fingerprint must be {FINGERPRINT_SIZE} bytes or {2 * FINGERPRINT_SIZE} hex digits")


def validate_vocab_size(vocab_size: int) -> int:
    """Return ``vocab_size`` as an int if it is in [1, MAX_VOCAB] (the core's and the static format's limit)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) \
            or not 1 <= int(vocab_size) <= MAX_VOCAB:
        raise InvalidArgumentError(f"vocab_size must be in [1, {MAX_VOCAB}], got {vocab_size!r}")
    return int(vocab_size)


def validate_layout(buckets: int, shards: int) -> tuple[int, int]:
    """Return (buckets, shards) if both are powers of two with shards <= buckets, else raise InvalidArgumentError."""
    buckets, shards = int(buckets), int(shards)
    if buckets < 1 or buckets > MAX_BUCKETS or buckets & (buckets - 1):
        raise InvalidArgumentError(f"buckets must be a power of two in [1, 2**30], got {buckets}")
    if shards < 1 or shards > MAX_SHARDS or shards & (shards - 1) or shards > buckets:
        raise InvalidArgumentError(f"shards must be a power of two in [1, min(buckets, {MAX_SHARDS})], got {shards}")
    return buckets, shards


def check_tokenizer(info: NamespaceRecord, fingerprint: bytes | str | None, vocab_size: int | None = None) -> None:
    """Raise TokenizerMismatchError when ``fingerprint``/``vocab_size`` differ from the namespace's."""
    if fingerprint is not None and normalize_fingerprint(fingerprint) != info.fingerprint:
        raise TokenizerMismatchError(
            f"namespace {info.name!r} is bound to tokenizer {info.fingerprint[:16]}..., "
            f"not {normalize_fingerprint(fingerprint)[:16]}...")
    if vocab_size is not None and int(vocab_size) != info.vocab_size:
        raise TokenizerMismatchError(
            f"namespace {info.name!r} has vocab_size {info.vocab_size}, not {int(vocab_size)}")


def no_such_namespace(namespace: str) -> NamespaceNotFoundError:
    return NamespaceNotFoundError(f"no counts namespace {namespace!r}")


def namespace_changed(namespace: str, during: str) -> NamespaceNotFoundError:
    """The namespace was dropped or recreated while ``during`` (an operation) ran."""
    return NamespaceNotFoundError(f"namespace {namespace!r} was dropped or recreated during {during}; retry")


class StaleNamespace(Exception):
    """A backend's script or lock found another instance of the namespace than the record it was given.

    The namespace was dropped or recreated since the record was read; `rerun_if_stale` reads it
    again and runs the operation once more. Never leaves the counts store.
    """


def rerun_if_stale(namespace: str, record: Callable[[_R | None], _R], action: Callable[[_R], _T]) -> _T:
    """``action(record(None))``; when it raises `StaleNamespace`, ``action(record(stale))`` once more.

    Args:
        namespace: the namespace's name (for the error).
        record: the namespace's record (or a backend's handle of it): ``record(None)`` may come from a
            cache, ``record(stale)`` is read again, and raises NamespaceNotFoundError when the
            namespace is gone (or, on Redis, still the stale instance whose shard state is lost).
        action: the operation; it checks whatever it takes against the record it is given.

    Raises:
        NamespaceNotFoundError: the namespace changed again during the second run.
    """
    first = record(None)
    try:
        return action(first)
    except StaleNamespace:
        fresh = record(first)
        try:
            return action(fresh)
        except StaleNamespace:
            raise namespace_changed(namespace, "the call") from None


def token_width(vocab_size: int) -> int:
    """Bytes per token in a field: the fewest that hold ``vocab_size - 1`` (1..3, as vocab_size <= MAX_VOCAB).

    Raises:
        InvalidArgumentError: ``vocab_size`` outside [1, MAX_VOCAB].
    """
    vocab = validate_vocab_size(vocab_size)
    return max(1, ((vocab - 1).bit_length() + 7) // 8)


def new_instance_id() -> str:
    """A random id for a new incarnation of a namespace (8 hex digits)."""
    return secrets.token_hex(4)
