"""StaticStore.watch: the published generations, then each new one as it is published, until the namespace is dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.static_store import FP, NS, VOCAB, build, publish
from helpers.static_store import src as src  # fixtures, imported by name so that pytest finds them here
from helpers.static_store import store as store

from ngramcache import NamespaceNotFoundError
from ngramcache.cache_service.static_store import StaticStore


def test_watch_sends_existing_then_new_generations(store: StaticStore, src: Path) -> None:
    for g in (1, 2, 3):
        publish(store, build(src / f"g{g}.ngc", g))

    async def go() -> list[int]:
        seen: list[int] = []
        watcher = store.watch(NS, after_generation=1)
        seen.append((await anext(watcher)).generation)
        seen.append((await anext(watcher)).generation)
        pending = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        assert not pending.done()
        await store.publish(NS, build(src / "g4.ngc", 4), fingerprint=FP, vocab_size=VOCAB)
        seen.append((await asyncio.wait_for(pending, 10)).generation)
        await watcher.aclose()
        assert not store._subscribers  # the watcher unregistered
        return seen

    assert asyncio.run(go()) == [2, 3, 4]


def test_a_slow_watcher_misses_nothing_and_blocks_no_publish(store: StaticStore, src: Path) -> None:
    async def go() -> list[int]:
        watcher = store.watch(NS)
        first = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        for g in range(1, 8):  # the watcher reads nothing meanwhile; publishing does not wait for it
            await asyncio.wait_for(store.publish(NS, build(src / f"g{g}.ngc", g), fingerprint=FP, vocab_size=VOCAB), 30)
        seen = [(await asyncio.wait_for(first, 10)).generation]
        while seen[-1] < 7:
            seen.append((await asyncio.wait_for(anext(watcher), 10)).generation)
        await watcher.aclose()
        return seen

    assert asyncio.run(go()) == list(range(1, 8))


def test_watch_ends_when_the_namespace_is_dropped(store: StaticStore, src: Path) -> None:
    publish(store, build(src / "g.ngc", 1))

    async def go() -> None:
        watcher = store.watch(NS)
        assert (await anext(watcher)).generation == 1
        pending = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0.05)
        await store.drop(NS)
        with pytest.raises(NamespaceNotFoundError):
            await asyncio.wait_for(pending, 10)

    asyncio.run(go())
