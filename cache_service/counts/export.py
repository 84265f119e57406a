"""The consistent export a mirror starts from: every count of a namespace as of a version, then its changes since that version.

What a Pull of the store's counts reads, through the service's store runner (one executor
call per store step, so the event loop never blocks on the store).

**The invariant.** A mirror that loads every chunk of `CountsExporter.export` and then
applies `changes_since(version)` (with the version the chunks carry) holds exactly the
counts of the store at that later call, because:

1. the version is read *before* the export starts, and every write after a version is
   handed out lands in the history `changes_since(version)` reads (the store's rule);
2. the export reads each bucket atomically and counts never decrease, so a bucket read
   before or after a concurrent write is corrected by the change set, which carries the
   absolute counts of every bucket changed since the version (an upsert, not an addition);
3. the rows belong to the namespace's incarnation the version belongs to: its instance
   id is the same after the export as before it. A namespace dropped or recreated meanwhile
   ends the export with NamespaceNotFoundError and no chunk saying ``complete``, since
   its rows may mix two incarnations;
4. only the last chunk says ``complete`` (the mirror swaps its table then), so rows are
   held back until the export is known to be over: at most ``chunk_rows`` plus one store
   chunk are held in memory, never the whole namespace.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

from ngramcache.client.kernel.rows import empty_counts

from .namespace import NamespaceRecord, check_tokenizer, namespace_changed
from .store import CountsStore

__all__ = ["CountsExporter", "PullChunk", "StoreCaller", "split_rows"]

_T = TypeVar("_T")


class StoreCaller(Protocol):
    """What runs store calls off the event loop: the service's `StoreRunner`."""

    @property
    def store(self) -> CountsStore: ...

    async def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T: ...


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise comparison of the arrays
class PullChunk:
    """One chunk of a pull: int64 count rows, the version they bring a mirror to, and whether it is the last."""

    rows: np.ndarray
    version: int
    complete: bool


class CountsExporter:
    """Reads what a mirror pulls from the counts store, one store step per runner call.

    Thread-safety: not thread-safe; use it from the server's event loop. The store calls run
    on the runner's pool (the store is thread-safe).

    Args:
        runner: the executor that owns the counts store.
    """

    def __init__(self, runner: StoreCaller) -> None:
        self._runner = runner

    async def namespace(self, namespace: str, fingerprint: bytes | str | None) -> NamespaceRecord:
        """The namespace's record, once its tokenizer is checked against ``fingerprint``.

        Raises:
            NamespaceNotFoundError, TokenizerMismatchError, InvalidArgumentError.
        """
        info = await self._runner.call(self._runner.store.namespace_info, namespace)
        check_tokenizer(info, fingerprint)
        return info

    async def changes(self, namespace: str, since: int, chunk_rows: int) -> AsyncGenerator[PullChunk, None]:
        """The counts changed since version ``since``, in chunks of at most ``chunk_rows`` rows.

        Raises:
            ResyncRequiredError: ``since`` is outside the history kept; pull `export` instead.
        """
        store = self._runner.store
        change = await self._runner.call(store.changes_since, namespace, since)
        for rows, complete in split_rows(change.rows, chunk_rows):
            yield PullChunk(rows, change.version, complete)

    async def export(self, info: NamespaceRecord, chunk_rows: int) -> AsyncGenerator[PullChunk, None]:
        """Every count of the namespace ``info`` describes, as of the version the chunks carry (see the module docstring).

        Close it (``contextlib.aclosing``) when not reading it to the end: that lets the
        store's export release what it holds.

        Raises:
            NamespaceNotFoundError: the namespace was dropped or recreated during the export.
        """
        namespace = info.name
        store = self._runner.store
        # Version first, then the export: changes_since(version) covers what changes during it.
        version = await self._runner.call(store.version, namespace)
        # The export is read one store chunk per executor call, never whole in memory.
        parts = await self._runner.call(store.export, namespace, chunk_rows=chunk_rows)
        try:
            held: list[np.ndarray] = []  # rows read but not sent: fewer than chunk_rows + one store chunk
            held_rows = 0
            while (part := await self._runner.call(next, parts, None)) is not None:
                held.append(part)
                held_rows += len(part)
                if held_rows > chunk_rows:  # keep the rest back: the last chunk must say complete
                    pending = np.concatenate(held)
                    sendable = (len(pending) - 1) // chunk_rows * chunk_rows
                    for rows, _ in split_rows(pending[:sendable], chunk_rows):
                        yield PullChunk(rows, version, False)
                    held, held_rows = [pending[sendable:]], len(pending) - sendable
        finally:
            with contextlib.suppress(ValueError, RuntimeError):  # still running in a worker (a cancelled call)
                await self._runner.call(_close, parts)
        # The export read the incarnation the version belongs to only if it was not dropped meanwhile.
        now = await self._runner.call(store.namespace_info, namespace)
        if now.instance != info.instance:
            raise namespace_changed(namespace, "the export")
        yield PullChunk(np.concatenate(held) if held else empty_counts(), version, True)


def split_rows(rows: np.ndarray, chunk_rows: int) -> Iterator[tuple[np.ndarray, bool]]:
    """(rows of at most chunk_rows, last?) pieces of ``rows``; one empty last piece for no rows."""
    if len(rows) == 0:
        yield rows, True
        return
    for start in range(0, len(rows), chunk_rows):
        yield rows[start:start + chunk_rows], start + chunk_rows >= len(rows)


def _close(it: Iterator[np.ndarray]) -> None:
    """Let an export the call no longer reads release what it holds (a generator's finally blocks)."""
    if isinstance(it, Generator):
        it.close()
