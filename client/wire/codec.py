"""Token arrays and count rows <-> the little-endian `bytes` fields of ngramcache.v1 messages.

Every token array of the wire contract is a `bytes` field of int32 little-endian values,
and every count row batch one of (m, 7) row-major rows: int32 for pushed deltas (28 bytes
a row), int64 for pulled absolute counts (56 bytes a row); see docs/protocol.md for why
not `repeated int32`. Decoding never copies on a little-endian machine: the arrays
returned are read-only views of the message's bytes (the native core accepts them as they
are). Lengths are checked here; the values (token ranges, row contents) are checked by
the receiver (`ngramcache.client.kernel.rows.validate_deltas`, the drafter).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.rows import COUNTS_DTYPE, DELTA_DTYPE, ROW_WIDTH

__all__ = [
    "COUNT_ROW_BYTES",
    "COUNT_WIRE_DTYPE",
    "DELTA_ROW_BYTES",
    "DELTA_WIRE_DTYPE",
    "TOKEN_BYTES",
    "TOKEN_WIRE_DTYPE",
    "bytes_to_count_rows",
    "bytes_to_delta_rows",
    "bytes_to_tokens",
    "count_rows_to_bytes",
    "delta_rows_to_bytes",
    "tokens_to_bytes",
]

TOKEN_WIRE_DTYPE: Final = np.dtype("<i4")
"""A token on the wire: int32 little-endian."""

DELTA_WIRE_DTYPE: Final = np.dtype("<i4")
"""An integer of a pushed delta row on the wire: int32 little-endian."""

COUNT_WIRE_DTYPE: Final = np.dtype("<i8")
"""An integer of a pulled count row on the wire: int64 little-endian (counts can pass 2^31)."""

TOKEN_BYTES: Final = TOKEN_WIRE_DTYPE.itemsize
"""Bytes a token: 4."""

DELTA_ROW_BYTES: Final = ROW_WIDTH * DELTA_WIRE_DTYPE.itemsize
"""Bytes a delta row: 7 x 4 = 28."""

COUNT_ROW_BYTES: Final = ROW_WIDTH * COUNT_WIRE_DTYPE.itemsize
"""Bytes a count row: 7 x 8 = 56."""

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1
_LITTLE: Final = sys.byteorder == "little"


def tokens_to_bytes(tokens: NDArray[np.integer] | Sequence[int]) -> bytes:
    """The wire form of a token array: int32 little-endian, 4 bytes a token.

    Args:
        tokens: a 1-D integer numpy array (int32 is converted without a check, other
            integer dtypes after a range check) or a sequence of ints.

    Returns:
        ``len(tokens) * 4`` bytes.

    Raises:
        InvalidArgumentError: not 1-D, not integers, or a value outside the int32 range.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize > 4 or (arr.dtype.kind == "u" and arr.dtype.itemsize == 4):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise InvalidArgumentError(f"tokens must fit in int32, got values in [{lo}, {hi}]")
    return arr.astype(TOKEN_WIRE_DTYPE, copy=False).tobytes()


def bytes_to_tokens(data: bytes) -> NDArray[np.int32]:
    """A token array from its wire form (a read-only view of ``data`` on little-endian machines).

    Raises:
        InvalidArgumentError: ``len(data)`` is not a multiple of 4.
    """
    if len(data) % TOKEN_BYTES:
        raise InvalidArgumentError(f"a token array must be a multiple of {TOKEN_BYTES} bytes, got {len(data)}")
    out = np.frombuffer(data, dtype=TOKEN_WIRE_DTYPE)
    return out if _LITTLE else out.astype(np.int32)


def delta_rows_to_bytes(rows: NDArray[np.int32]) -> bytes:
    """The wire form of delta rows (what Push carries): (m, 7) int32, row-major, little-endian.

    Raises:
        InvalidArgumentError: not a numpy int32 array of shape (m, 7).
    """
    _check_rows(rows, DELTA_DTYPE, "delta")
    return rows.astype(DELTA_WIRE_DTYPE, order="C", copy=False).tobytes()


def bytes_to_delta_rows(data: bytes) -> NDArray[np.int32]:
    """Delta rows (m, 7) int32 from their wire form (a read-only view on little-endian machines).

    Raises:
        InvalidArgumentError: ``len(data)`` is not a multiple of 28.
    """
    return _decode_rows(data, DELTA_WIRE_DTYPE, DELTA_DTYPE, DELTA_ROW_BYTES, "delta")


def count_rows_to_bytes(rows: NDArray[np.int64]) -> bytes:
    """The wire form of absolute count rows (what Pull carries): (k, 7) int64, row-major, little-endian.

    Raises:
        InvalidArgumentError: not a numpy int64 array of shape (k, 7).
    """
    _check_rows(rows, COUNTS_DTYPE, "count")
    return rows.astype(COUNT_WIRE_DTYPE, order="C", copy=False).tobytes()


def bytes_to_count_rows(data: bytes) -> NDArray[np.int64]:
    """Count rows (k, 7) int64 from their wire form (a read-only view on little-endian machines).

    Raises:
        InvalidArgumentError: ``len(data)`` is not a multiple of 56.
    """
    return _decode_rows(data, COUNT_WIRE_DTYPE, COUNTS_DTYPE, COUNT_ROW_BYTES, "count")


def _check_rows(rows: object, dtype: np.dtype[np.signedinteger], kind: str) -> None:
    if not isinstance(rows, np.ndarray):
        raise InvalidArgumentError(f"{kind} rows must be a numpy array, got {type(rows).__name__}")
    if rows.dtype != dtype:
        raise InvalidArgumentError(f"{kind} rows must have dtype {dtype}, got {rows.dtype}")
    if rows.ndim != 2 or rows.shape[1] != ROW_WIDTH:
        raise InvalidArgumentError(f"{kind} rows must have shape (m, {ROW_WIDTH}), got {rows.shape}")


def _decode_rows(data: bytes, wire: np.dtype[np.signedinteger], native: np.dtype[np.signedinteger],
                 row_bytes: int, kind: str) -> NDArray[np.signedinteger]:
    if len(data) % row_bytes:
        raise InvalidArgumentError(
            f"{kind} rows must be a multiple of {row_bytes} bytes ({ROW_WIDTH} x {wire.itemsize}), got {len(data)}")
    out = np.frombuffer(data, dtype=wire).reshape(-1, ROW_WIDTH)
    return out if _LITTLE else out.astype(native)
