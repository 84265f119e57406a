"""Watching a namespace: each watcher's wake-up flag, set by a publish or a drop, and the watch loop that reads generations after it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from ngramcache.client.kernel.errors import NamespaceNotFoundError

from .layout import GenerationInfo, check_namespace

__all__ = ["Subscriber", "Watchers", "watch_generations"]


class Subscriber:
    """A watcher's wake-up flag: set (from any thread) when its namespace changes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.dropped = False

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: the watcher is gone
            self.loop.call_soon_threadsafe(self.event.set)


class Watchers:
    """The subscribers of every namespace of one store, in this process.

    Thread-safety: every method may be called from any thread (one lock); a subscriber is
    woken on its own loop. ``len()`` is the number of namespaces watched.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_namespace: dict[str, set[Subscriber]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_namespace)

    @contextlib.contextmanager
    def subscribed(self, namespace: str, loop: asyncio.AbstractEventLoop) -> Iterator[Subscriber]:
        """A subscriber of ``namespace``, woken on ``loop``, registered for the block."""
        sub = Subscriber(loop)
        with self._lock:
            self._by_namespace.setdefault(namespace, set()).add(sub)
        try:
            yield sub
        finally:
            with self._lock:
                subs = self._by_namespace.get(namespace)
                if subs is not None:
                    subs.discard(sub)
                    if not subs:
                        del self._by_namespace[namespace]

    def wake(self, namespace: str) -> None:
        """Wake the namespace's watchers (a generation was published)."""
        for sub in self._of(namespace):
            sub.wake()

    def end(self, namespace: str) -> None:
        """End the namespace's watchers (it was dropped): each raises NamespaceNotFoundError when it wakes."""
        subs = self._of(namespace)
        for sub in subs:
            sub.dropped = True
        for sub in subs:
            sub.wake()

    def _of(self, namespace: str) -> list[Subscriber]:
        with self._lock:
            return list(self._by_namespace.get(namespace, ()))


async def watch_generations(watchers: Watchers, scan: Callable[[str], Awaitable[list[GenerationInfo]]],
                            namespace: str, after_generation: int) -> AsyncIterator[GenerationInfo]:
    """Every generation of ``namespace`` above ``after_generation``, oldest first, then each new one (`StaticStore.watch`).

    A watcher holds one wake-up flag, not a queue: a publish only sets it (never blocks,
    never grows memory), and the watcher reads the generations above the last one it
    yielded, so a slow watcher skips none that still exist and sees them in order.

    Args:
        watchers: the store's subscribers.
        scan: reads the namespace's generations, oldest first (off the loop).
        namespace: the namespace (checked when iteration starts).
        after_generation: the last generation the caller has.

    Raises:
        InvalidArgumentError: a malformed namespace name.
        NamespaceNotFoundError: the namespace was dropped while watching.
    """
    check_namespace(namespace)
    with watchers.subscribed(namespace, asyncio.get_running_loop()) as sub:
        last = after_generation
        while True:
            sub.event.clear()  # before reading: a publish from now on wakes the wait below
            if sub.dropped:
                raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped")
            for info in await scan(namespace):
                if info.generation > last:
                    yield info
                    last = info.generation
            await sub.event.wait()
