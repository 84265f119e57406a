"""Central rebuilds: fold a namespace's corpus base, its dynamic counts (and a corpus, and the fleet history) into its next static generation.

One rebuild per namespace at a time across every replica: the rebuilding replica holds the
namespace's lease in the counts store (renewed while it builds) and commits the new
generation number under it before it publishes the file; a replica whose lease expired
(paused, partitioned) is fenced off by the store and publishes nothing (`LeaseLostError`).
The build streams through `StaticBuilder` within its memory budget: every dynamic row of
the static file's n-gram size with a count >= ``min_count`` (the store's export, chunk by
chunk), the token files of ``corpus``, the sequences the fleet history keeps (into the corpus
index only: their counts are already in the dynamic counts), and the namespace's **corpus
base** times ``decay``: the latest generation published as it is (`CommittedGeneration.base`,
recorded in the counts store, so every replica agrees), with its corpus index. The base holds
no dynamic counts (it came from a corpus), so folding it into every rebuild counts nothing
twice; a generation a rebuild made is never folded (the store's counts are totals since the
namespace began: it holds them already). The base carries into every rebuilt generation until
a newer corpus is published, or the operator drops it (``base=False``, `--no-base`: this
generation folds the counts alone and the record forgets the base). A base recorded but whose
file is on no replica refuses the rebuild: it would publish less than the namespace drafts
from. The file is written under a temporary name in the namespace's folder, verified
and published by the `StaticStore` (atomic rename, directory fsync, Watch subscribers
woken: every session and client swaps to it), then older generations beyond ``keep`` are
deleted, the base excepted (a file still mapped stays readable to its process).

What the options do to drafts (see docs/operations.md): ``min_count`` drops rare pairs (a
smaller file; pairs seen once rarely pass the static step's 50% test anyway); ``decay``
below 1 weighs the corpus base down against what the fleet writes now;
``ngram_size`` picks the static step's key length. The dynamic counts stay in the store
(the drafter also consults them in their own step). tests/bench/bench_rebuild.py measures
each option on a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from ngramcache.client._core import StaticBuilder, StaticCache
from ngramcache.client.kernel.corpus import collect_inputs, is_token_file, token_streams
from ngramcache.client.kernel.errors import (
    CacheFormatError,
    GenerationNotFoundError,
    InvalidArgumentError,
    LeaseHeldError,
    LeaseLostError,
)
from ngramcache.client.kernel.rows import COUNT, N
from ngramcache.client.kernel.sglang_corpus import corpus_documents

from .confinement import check_under_roots, confine_corpus
from .counts import CountsStore, NamespaceRecord
from .counts.store import CommittedGeneration, Lease
from .peer_sync import PeerSync
from .static_store import PublishResult, StaticStore, publish_refused
from .store_runner import StoreRunner

log = logging.getLogger("ngramcache.service")

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class RebuildOptions:
    """What a rebuild folds in (every field has a default).

    Attributes:
        min_count: dynamic (n-gram, follower) counts below this are left out (>= 1).
        ngram_size: tokens per key of the new file (1..4); 0: the previous generation's, else 2.
        base: fold the namespace's corpus base (the latest generation published as it is, with
            its corpus index) in; False drops it, from this generation and from the record.
        decay: the base's counts are multiplied by this (0 < decay <= 1), rounded down (a count
            that reaches 0 is dropped).
        corpus: token files or folders of them (.bin/.tokens/.npy) on the server to add.
        memory_budget: the builder's budget in bytes (it spills sorted runs beyond).
        keep: published generations kept after this one (older ones are deleted), >= 1.
        history: add the sequences the namespace's fleet history keeps to the new file's corpus
            index (index only: their counts are in the dynamic counts already).
    """

    min_count: int = 1
    ngram_size: int = 0
    base: bool = True
    decay: float = 1.0
    corpus: tuple[str, ...] = ()
    memory_budget: int = 1 << 30
    keep: int = 3
    history: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.min_count, bool) or not isinstance(self.min_count, int) or self.min_count < 1:
            raise InvalidArgumentError(f"min_count must be an integer >= 1, got {self.min_count!r}")
        if self.ngram_size not in (0, 1, 2, 3, 4):
            raise InvalidArgumentError(f"ngram_size must be 1..4 (0: the previous generation's), got {self.ngram_size!r}")
        if not (isinstance(self.decay, (int, float)) and math.isfinite(self.decay) and 0 < self.decay <= 1):
            raise InvalidArgumentError(f"decay must be in (0, 1], got {self.decay!r}")
        if self.memory_budget < 16 << 20:
            raise InvalidArgumentError(f"memory_budget must be at least 16 MiB, got {self.memory_budget}")
        if self.keep < 1:
            raise InvalidArgumentError(f"keep must be >= 1, got {self.keep}")
        # The corpus paths are checked by the Rebuilder against its corpus roots (confinement.py), after the
        # namespace: an error here would tell a caller which paths exist.


@dataclasses.dataclass
class RebuildJob:
    """A rebuild of a namespace on this replica, the running or the last one: its state, phase and counters
    (what GetRebuildStatus answers, as `admin_pb2.RebuildStatus`)."""

    namespace: str
    state: str = "idle"  # idle, running, done, failed
    phase: str = ""  # base, dynamic, corpus, history, writing, committing, publishing
    generation: int = 0
    lease_token: int = 0
    started_unix_ms: int = 0
    finished_unix_ms: int = 0
    base_generation: int = 0  # the corpus base folded in (0: none)
    previous_rows: int = 0  # (key, follower) rows of the base folded in
    dynamic_rows: int = 0
    corpus_tokens: int = 0
    history_tokens: int = 0
    n_keys: int = 0
    n_followers: int = 0
    file_bytes: int = 0
    error: str = ""


class Rebuilder:
    """Runs rebuilds for one service replica (see the module docstring).

    Args:
        runner: the executor that owns the counts store (leases, exports).
        static_store: where generations are published.
        holder: this replica's name in leases (unique per replica).
        location: where other replicas can fetch what this one builds (host:port).
        lease_ttl: seconds a lease lasts without renewal; renewed every third of it.
        peer_sync: fetches a newer generation another replica committed before building on it.
        corpus_roots: the folders a rebuild's corpus paths must lie under (resolved; none: no
            corpus paths are taken).
    """

    def __init__(self, runner: StoreRunner, static_store: StaticStore, *, holder: str, location: str,
                 lease_ttl: float = 30.0, peer_sync: PeerSync | None = None, default_keep: int = 3,
                 corpus_roots: tuple[str, ...] = ()) -> None:
        self.peer_sync = peer_sync
        self.corpus_roots = corpus_roots
        self.default_keep = default_keep
        self._runner = runner
        self._store: CountsStore = runner.store
        self._static = static_store
        self.holder = holder
        self.location = location
        self._ttl_ms = max(1000, int(lease_ttl * 1000))
        self._jobs: dict[str, RebuildJob] = {}
        self._tasks: dict[str, asyncio.Task[RebuildJob]] = {}
        self.completed = 0  # rebuilds published by this replica (metrics)
        self.failed = 0

    async def committed_publish(self, namespace: str, generation: int,
                                publish: Callable[[], Awaitable[PublishResult]]) -> PublishResult:
        """Run ``publish`` (a Publish of ``generation``) under the namespace's lease and commit its number.

        The commit makes ``generation`` the namespace's corpus base (a published file holds no
        dynamic counts): every later rebuild folds it in.

        Raises:
            LeaseHeldError: a rebuild of the namespace is running.
            GenerationNotNewerError: ``generation`` is below the committed one.
        """
        lease = await self._runner.call(self._store.acquire_lease, namespace, self.holder, self._ttl_ms)
        try:
            committed = await self._runner.call(self._store.committed_generation, namespace)
            if generation < committed.generation:
                raise publish_refused(namespace, generation, committed.generation)
            result = await publish()
            if generation > committed.generation and not result.already_published:
                await self._runner.call(self._store.commit_generation, lease, generation, self.location, "publish")
            return result
        finally:
            with contextlib.suppress(Exception):
                await self._runner.call(self._store.release_lease, lease)

    def jobs(self) -> list[RebuildJob]:
        """A copy of the last (or running) job of every namespace this replica rebuilt (for metrics)."""
        return [dataclasses.replace(job) for job in list(self._jobs.values())]

    def job(self, namespace: str) -> RebuildJob:
        """A copy of the namespace's running or last job on this replica (state idle: none ran here)."""
        return dataclasses.replace(self._jobs.get(namespace) or RebuildJob(namespace))

    async def start(self, namespace: str, options: RebuildOptions) -> asyncio.Task[RebuildJob]:
        """Take the lease and start the rebuild; the task's result is the finished job (a copy).

        Raises:
            LeaseHeldError: another replica (or this one) is rebuilding the namespace.
            NamespaceNotFoundError: no such namespace.
        """
        running = self._tasks.get(namespace)
        if running is not None and not running.done():
            raise LeaseHeldError(f"a rebuild of {namespace!r} is running on this replica ({self.holder}), "
                                 f"phase {self._jobs[namespace].phase}")
        info = await self._runner.call(self._store.namespace_info, namespace)
        options = dataclasses.replace(options, corpus=confine_corpus(options.corpus, self.corpus_roots))
        lease = await self._runner.call(self._store.acquire_lease, namespace, self.holder, self._ttl_ms)
        job = RebuildJob(namespace, state="running", phase="starting", lease_token=lease.token,
                         started_unix_ms=int(time.time() * 1000))
        self._jobs[namespace] = job
        task = asyncio.create_task(self._run(info, lease, options, job), name=f"rebuild:{namespace}")
        self._tasks[namespace] = task
        return task

    async def _run(self, info: Any, lease: Lease, options: RebuildOptions, job: RebuildJob) -> RebuildJob:
        renewer = asyncio.create_task(self._renew(lease))
        tmp: Path | None = None
        # The state a poll sees stays "running" until the lease is released and the finish time set.
        final_state, final_error = "failed", "ended unexpectedly"
        try:
            if self.peer_sync is not None:  # fold in the newest generation, even one another replica built
                await self.peer_sync.sync(info)
            latest = self._static.latest(info.name)
            committed = await self._runner.call(self._store.committed_generation, info.name)
            job.generation = max(latest.generation if latest else 0, committed.generation) + 1
            ns_dir = self._static.namespace_dir(info.name)
            ns_dir.mkdir(parents=True, exist_ok=True)
            tmp = ns_dir / f"rebuild-{job.generation}-{secrets.token_hex(6)}.tmp"
            base = await self._open_base(info, committed) if options.base and committed.base else None
            job.base_generation = base.generation if base is not None else 0
            ngram_size = options.ngram_size or (latest.ngram_size if latest else 2)
            if base is not None and base.ngram_size != ngram_size:
                raise InvalidArgumentError(
                    f"the corpus base of {info.name!r}, generation {base.generation}, has {base.ngram_size}-gram keys, "
                    f"not {ngram_size}: pass --ngram-size {base.ngram_size}, or --no-base to rebuild from the counts "
                    "alone (and drop the base)")
            history = options.history and (await self._runner.call(self._store.history_stats, info.name))["records"] > 0
            base_index = base is not None and base.index_depth > 0 and base.n_indexed > 0
            builder = StaticBuilder(tmp, info.vocab_size, ngram_size, fingerprint=bytes.fromhex(info.fingerprint),
                                    generation=job.generation, memory_budget=options.memory_budget,
                                    scratch_dir=ns_dir, corpus_index=history or base_index,
                                    index_depth=base.index_depth if base_index and base is not None else 32)
            if base is not None:
                job.phase = "base"
                await asyncio.to_thread(self._add_base, builder, base, options.decay, job)
            job.phase = "dynamic"
            await self._add_dynamic(builder, info.name, ngram_size, options.min_count, job, renewer)
            if options.corpus:
                job.phase = "corpus"
                await asyncio.to_thread(self._add_corpus, builder, options.corpus, job, self.corpus_roots)
            if history:
                job.phase = "history"
                await self._add_history(builder, info.name, job, renewer)
            if not (job.dynamic_rows or job.previous_rows or job.corpus_tokens):
                raise InvalidArgumentError(
                    f"nothing to fold into a generation of {info.name!r}: no dynamic counts of {ngram_size}-grams "
                    f"with a count >= {options.min_count}, no corpus, no corpus base (the latest stays)")
            job.phase = "writing"
            await asyncio.to_thread(builder.finish)
            cache = StaticCache.open(tmp)
            job.n_keys, job.n_followers, job.file_bytes = cache.n_keys, cache.n_followers, cache.file_size
            del cache
            if renewer.done():
                renewer.result()  # raises LeaseLostError
            job.phase = "committing"
            await self._runner.call(self._store.commit_generation, lease, job.generation, self.location,
                                    keep_base=options.base)
            job.phase = "publishing"
            await self._static.publish(info.name, tmp, fingerprint=info.fingerprint, vocab_size=info.vocab_size,
                                       generation=job.generation)
            tmp = None  # the store owns it now
            await self._static.retain(info.name, options.keep, protect=committed.base if options.base else 0)
            job.phase = ""
            final_state, final_error = "done", ""
            self.completed += 1
            log.info("namespace %s: rebuilt generation %d (%d keys, %d followers, %d bytes; base generation %d: %d rows, "
                     "%d dynamic rows, %d corpus tokens, %d history tokens indexed)", info.name, job.generation,
                     job.n_keys, job.n_followers, job.file_bytes, job.base_generation,
                     job.previous_rows, job.dynamic_rows, job.corpus_tokens, job.history_tokens)
        except asyncio.CancelledError:
            final_error = "cancelled (the service is stopping)"
            self.failed += 1
            raise
        except Exception as e:
            final_error = f"{type(e).__name__}: {e}"
            self.failed += 1
            log.error("namespace %s: rebuild of generation %d failed: %s", info.name, job.generation, final_error)
        finally:
            renewer.cancel()
            with contextlib.suppress(BaseException):
                await renewer
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                await self._runner.call(self._store.release_lease, lease)
            job.finished_unix_ms = max(int(time.time() * 1000), job.started_unix_ms)
            job.error = final_error
            job.state = final_state  # last: a poll that sees it done or failed sees the rest too
        return dataclasses.replace(job)

    async def _renew(self, lease: Lease) -> None:
        """Renew the lease every third of its ttl; raise LeaseLostError when it is gone."""
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            if not await self._runner.call(self._store.renew_lease, lease, self._ttl_ms):
                raise LeaseLostError(f"the rebuild lease of {lease.namespace!r} was lost while building")

    async def _open_base(self, info: NamespaceRecord, committed: CommittedGeneration) -> StaticCache:
        """The corpus base's file, verified: this replica's, else fetched from a replica that holds it.

        Raises:
            InvalidArgumentError: the file is on no replica this one can fetch it from, or is
                unreadable: folding nothing in its place would publish less than the namespace
                drafts from.
        """
        generation = committed.base

        def open_verified() -> StaticCache:
            cache = self._static.open(info.name, generation)
            cache.verify()  # the rebuild reads it whole anyway
            return cache

        why = f"generation {generation} is not on this replica"
        try:
            return await asyncio.to_thread(open_verified)
        except GenerationNotFoundError:
            if self.peer_sync is not None:
                failed = await self.peer_sync.fetch_base(info, generation, [committed.base_location,
                                                                            committed.location])
                if not failed:
                    return await asyncio.to_thread(open_verified)
                why += f" and could not be fetched ({failed})"
        except CacheFormatError as e:
            why = f"its file on this replica is unreadable ({e})"
        raise InvalidArgumentError(
            f"the corpus base of {info.name!r} (generation {generation}, the latest published one) cannot be folded: "
            f"{why}; pass --no-base to rebuild from the counts alone (and drop the base), or publish a corpus "
            "generation again")

    @staticmethod
    def _add_base(builder: StaticBuilder, base: StaticCache, decay: float, job: RebuildJob) -> None:
        """The base's counts (times ``decay``) and its corpus index (the match mode drafts from it)."""
        if decay >= 1.0:
            builder.add_static(base)
            job.previous_rows = base.n_followers
        else:
            rows = base.to_rows()
            counts = np.floor(rows[:, COUNT].astype(np.float64) * decay).astype(np.int64)
            keep = counts > 0
            rows = np.ascontiguousarray(rows[keep])
            rows[:, COUNT] = counts[keep].astype(np.int32)
            builder.add_rows(rows)
            job.previous_rows = len(rows)
        if base.index_depth > 0 and base.n_indexed > 0:
            for document in corpus_documents(base):  # verifies the base's checksums first
                builder.add_index_tokens(np.ascontiguousarray(document, dtype=np.int32))

    async def _add_dynamic(self, builder: StaticBuilder, namespace: str, ngram_size: int, min_count: int,
                           job: RebuildJob, renewer: asyncio.Task[None]) -> None:
        parts = await self._runner.call(self._store.export, namespace)
        try:
            while (part := await self._runner.call(next, parts, None)) is not None:
                if renewer.done():
                    renewer.result()
                rows = part[(part[:, N] == ngram_size) & (part[:, COUNT] >= min_count)]
                if len(rows):
                    out = rows.astype(np.int32)
                    out[:, COUNT] = np.minimum(rows[:, COUNT], _INT32_MAX).astype(np.int32)
                    await asyncio.to_thread(builder.add_rows, np.ascontiguousarray(out))
                    job.dynamic_rows += len(rows)
        finally:
            close = getattr(parts, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await self._runner.call(close)

    async def _add_history(self, builder: StaticBuilder, namespace: str, job: RebuildJob,
                           renewer: asyncio.Task[None]) -> None:
        """Every sequence the history keeps as one index text: its records in offset order, a gap
        (a record trimmed or never published) starting a new text."""
        texts: dict[tuple[str, int], list[tuple[int, np.ndarray]]] = {}
        after = ""
        while True:
            if renewer.done():
                renewer.result()
            page = await self._runner.call(self._store.read_history, namespace, after, 4096)
            for r in page.records:
                texts.setdefault((r.client_id, r.seq), []).append((r.offset, r.tokens))
            if not page.records:
                break
            after = page.cursor

        def add() -> None:
            for parts in texts.values():
                parts.sort(key=lambda part: part[0])
                run: list[np.ndarray] = []
                end = -1
                for offset, tokens in [*parts, (-1, np.empty(0, np.int32))]:  # a sentinel flushes the last run
                    if run and offset != end:
                        builder.add_index_tokens(np.ascontiguousarray(np.concatenate(run), dtype=np.int32))
                        job.history_tokens += sum(len(t) for t in run)
                        run = []
                    if len(tokens):
                        run.append(tokens)
                        end = offset + len(tokens)

        await asyncio.to_thread(add)

    @staticmethod
    def _add_corpus(builder: StaticBuilder, corpus: tuple[str, ...], job: RebuildJob,
                    roots: tuple[str, ...]) -> None:
        for item in collect_inputs(list(corpus)):
            check_under_roots(str(item.path), roots)  # a file in a named folder may link out of the roots
            if not is_token_file(item.path):
                raise InvalidArgumentError(f"{item.path}: a rebuild reads token files (.bin, .tokens, .npy), "
                                           "not text (tokenize it with `ngramcache build` or pre-tokenize it)")
            for stream in token_streams(item):
                builder.begin_stream()
                for chunk in stream:
                    builder.add_tokens(np.ascontiguousarray(chunk, dtype=np.int32))
                    job.corpus_tokens += len(chunk)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(BaseException):
                await task
