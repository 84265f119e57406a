"""Fixtures of the integration tests: real redis-server processes (standalone, a 3-master Cluster, Sentinel) and counts stores over them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.redis_servers import RedisClusterProcesses, RedisSentinelGroup, RedisServer

from ngramcache.cache_service.counts.factory import open_counts_store
from ngramcache.cache_service.counts.store import CountsStore

BACKENDS = ("embedded", "standalone", "cluster")

# Fast, test-sized defaults: versions advance on every read (at most once a millisecond).
TEST_OPTIONS: dict[str, Any] = {"epoch_seconds": 0, "default_buckets": 256, "socket_timeout": 10}


@pytest.fixture(scope="session")
def redis_standalone() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcesses]:
    with RedisClusterProcesses(masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup() as group:
        yield group


def backend_url(request: pytest.FixtureRequest, backend: str) -> str | None:
    if backend == "embedded":
        return None
    if backend == "standalone":
        return request.getfixturevalue("redis_standalone").url
    if backend == "sentinel":
        return request.getfixturevalue("redis_sentinel").url
    return request.getfixturevalue("redis_cluster").url


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that uses `backend` (itself, or through `make_store` / `store`) runs on each of the
    module's ``BACKENDS``, else on this file's."""
    chosen = any("backend" in str(mark.args[0]) for mark in metafunc.definition.iter_markers("parametrize"))
    if "backend" in metafunc.fixturenames and not chosen:  # a test may name its own backends
        metafunc.parametrize("backend", getattr(metafunc.module, "BACKENDS", BACKENDS))


@pytest.fixture
def make_store(request: pytest.FixtureRequest, backend: str) -> Iterator[Callable[..., CountsStore]]:
    """``make_store(**options)`` opens a store on the parametrized backend; closed after the test."""
    opened: list[CountsStore] = []
    url = backend_url(request, backend)

    def make(**options: Any) -> CountsStore:
        store = open_counts_store(url, **{**TEST_OPTIONS, **options})
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., CountsStore]) -> CountsStore:
    return make_store()


@pytest.fixture
def namespace(store: CountsStore) -> Iterator[str]:
    """A fresh namespace name, dropped after the test."""
    name = "t-" + uuid.uuid4().hex[:12]
    yield name
    store.drop_namespace(name)
