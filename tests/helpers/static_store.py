"""What the StaticStore unit tests share: real static files to publish, the store's calls made synchronous, what a
namespace's folder holds, and the `src` and `store` fixtures (which a test module imports by name)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from ngramcache import NgramCacheError, build_static_from_tokens
from ngramcache.cache_service.static_store import StaticStore
from ngramcache.cache_service.status import status_of

__all__ = ["FP", "NS", "OTHER_FP", "VOCAB", "assert_status", "build", "gens", "ns_files", "publish", "src", "store"]

FP = b"\x11" * 32
OTHER_FP = b"\x22" * 32
VOCAB = 50
NS = "docs"


def build(path: Path, generation: int, *, seed: int | None = None, fingerprint: bytes = FP, vocab: int = VOCAB) -> Path:
    """A real static file of `generation` (its content depends on the seed, by default the generation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(generation if seed is None else seed)
    streams = [rng.integers(0, vocab, 2000).astype(np.int32) for _ in range(2)]
    build_static_from_tokens(streams, str(path), vocab_size=vocab, ngram_size=2, fingerprint=fingerprint,
                             generation=generation)
    return path


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Where test files are built (the same filesystem as the data directory)."""
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def store(tmp_path: Path) -> StaticStore:
    return StaticStore(tmp_path / "data")


def publish(store: StaticStore, path: Path, ns: str = NS, **kw: object):
    kw.setdefault("fingerprint", FP)
    kw.setdefault("vocab_size", VOCAB)
    return asyncio.run(store.publish(ns, path, **kw))  # type: ignore[arg-type]


def gens(store: StaticStore, ns: str = NS) -> list[int]:
    return [i.generation for i in store.generations(ns)]


def ns_files(store: StaticStore, ns: str = NS) -> list[str]:
    d = store.data_dir / ns
    return sorted(os.listdir(d)) if d.exists() else []


def assert_status(exc: BaseException, code: grpc.StatusCode, reason: str | None) -> None:
    """The store raised a library error that goes on the wire as ``code`` and ``reason``."""
    assert isinstance(exc, NgramCacheError)
    st = status_of(exc)
    assert (st.code, st.reason) == (code, reason)
