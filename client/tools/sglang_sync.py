"""SGLang servers kept in step with a namespace: each new generation's corpus added to every server, and the one it replaces removed once the new one is listed.

`SglangSync` follows the namespace's generations with the client's static sync (List, then
Watch; each generation fetched once into ``cache_dir`` and verified, as `NgramClient` does),
turns a new generation's corpus index into SGLang's external corpus (the documents
`export-sglang` writes, decoded with the namespace's tokenizer) and runs one task per SGLang
server: list its corpora; add ours if it is missing (a new generation, or a server that
restarted and lost it); once it is listed, remove our older ones. A server that does not
answer is retried with a growing delay, capped at ``interval``, so it catches up within one
interval after it returns, and it never delays the other servers. The routes and their errors
are `ngramcache.client.tools.sglang_http`'s (pinned from SGLang 0.5.23's source).

The budget: SGLang's --speculative-ngram-external-corpus-max-tokens bounds the tokens of all its
corpora together, and the new corpus is added before the old one is removed, so a corpus is cut
to half of ``max_tokens``: whole documents, in the corpus index's order, up to the first that does
not fit (SGLang cuts its own the same way); only a first document that alone is past the budget is
sent in part, its beginning (else nothing could be sent). The event ``generation`` says what was
cut. If a server has no room even so (other corpora on it), the old corpus is removed first, and
said.

A refused add (a 4xx answer: a server whose own limit is below ``max_tokens``, say) is said once,
with the server's message and what it means, and that generation is not sent to that server again
until a newer one lands or `REFUSED_RETRY_SECONDS` pass (the server keeps the corpus it had):
sending the whole corpus every interval would change nothing.

Corpus ids are ``ngramcache-<namespace>-g<generation>``; the feeder removes only ids of that
form for its namespace, never another corpus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ngramcache.client._core import UNTAGGED, CountTable, Drafter, StaticCache
from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError, TokenizerMismatchError
from ngramcache.client.kernel.retry import Backoff, retry
from ngramcache.client.kernel.sglang_corpus import SGLANG_DEFAULT_MAX_TOKENS, corpus_documents
from ngramcache.client.kernel.static_files import default_cache_dir, prepare_cache_dir
from ngramcache.client.kernel.tasks import cancel_until_done
from ngramcache.client.sync.client import SyncLoop
from ngramcache.client.sync.config import ClientConfig
from ngramcache.client.sync.state import SyncState
from ngramcache.client.sync.static_sync import StaticSync
from ngramcache.client.tools.sglang_http import (
    ALREADY_EXISTS,
    EMPTY,
    TRUNCATED,
    SglangError,
    SglangHttp,
    SglangTarget,
    in_daemon_thread,
)
from ngramcache.client.wire.address import check_address

if TYPE_CHECKING:
    from ngramcache.client._proto.v1 import static_files_pb2
    from ngramcache.client.kernel.static_files import GenerationFiles
    from ngramcache.client.kernel.tokenizer import Tokenizer

__all__ = ["REFUSED_RETRY_SECONDS", "SglangCorpus", "SglangSync", "corpus_id", "prepare_corpus"]

log = logging.getLogger("ngramcache.client.sglang")

Event = Callable[[str, dict[str, Any]], None]

# A generation whose add a server refused (4xx) is sent to it again only for a newer generation, or after this long
# (the server may have been restarted with a larger limit meanwhile, which the feeder cannot see).
REFUSED_RETRY_SECONDS = 600.0


def corpus_id(namespace: str, generation: int) -> str:
    """The id a generation's corpus has on every SGLang server."""
    return f"ngramcache-{namespace}-g{generation}"


@dataclass(frozen=True)
class SglangCorpus:
    """A generation's corpus, ready to send: the body of /add_external_corpus and what it holds.

    Attributes:
        generation, corpus_id: the generation and its corpus id.
        body: the JSON request body (``{"corpus_id", "documents"}``), sent as is to every server.
        documents, tokens: documents kept and their tokens, a separator between two documents
            included (as SGLang counts them, with the namespace's tokenizer).
        total_documents: the generation's non-empty documents: ``documents + cut_documents``.
        cut_documents: documents left out whole to fit the budget.
        cut_tokens: tokens not sent: those of the documents left out, and ``shortened_tokens``.
        shortened_tokens: tokens cut from the end of the first document, when it alone is past the budget
            (its beginning is then the only document sent); 0 otherwise.
        first_document_tokens: tokens of the first document sent.
    """

    generation: int
    corpus_id: str
    body: bytes
    documents: int
    tokens: int
    total_documents: int
    cut_documents: int
    cut_tokens: int
    shortened_tokens: int
    first_document_tokens: int


def prepare_corpus(cache: StaticCache, tokenizer: Tokenizer, namespace: str, max_tokens: int) -> SglangCorpus:
    """The corpus of generation ``cache``, cut to ``max_tokens`` (separators counted), as one request body.

    Whole documents are kept in the corpus index's order up to the first that does not fit; it
    and every one after it are left out (``cut_documents``, ``cut_tokens``), as SGLang cuts a
    corpus past its own limit. Only when the first document alone is past the budget is its
    beginning kept (``shortened_tokens`` cut from its end), else nothing could be sent.

    Raises:
        InvalidArgumentError: the generation has no corpus index (or an empty one), or a token outside the
            vocabulary.
        TokenizerMismatchError: ``tokenizer`` is not the generation's.
        CacheFormatError: the file is corrupt.
    """
    if cache.fingerprint != UNTAGGED and bytes(tokenizer.fingerprint) != cache.fingerprint:
        raise TokenizerMismatchError(f"generation {cache.generation} was built with another tokenizer (fingerprint "
                                     f"{cache.fingerprint.hex()[:16]}...): give the namespace's tokenizer")
    docs: list[str] = []
    tokens = cut_docs = cut_tokens = shortened = first = 0
    for doc in corpus_documents(cache):
        if len(doc) == 0:
            continue
        sep = 1 if docs else 0
        if cut_docs or tokens + sep + len(doc) > max_tokens:
            if docs or cut_docs:  # past the budget: this document and every later one are left out whole
                cut_docs += 1
                cut_tokens += len(doc)
                continue
            shortened = len(doc) - max_tokens  # the first document alone is past it: its beginning is sent
            cut_tokens += shortened
            doc = doc[:max_tokens]
        docs.append(tokenizer.decode(doc))
        tokens += sep + len(doc)
        first = first or len(doc)
    if not docs:
        raise InvalidArgumentError(f"generation {cache.generation}'s corpus index holds no tokens")
    cid = corpus_id(namespace, cache.generation)
    body = json.dumps({"corpus_id": cid, "documents": docs}, ensure_ascii=False).encode()
    return SglangCorpus(cache.generation, cid, body, len(docs), tokens, len(docs) + cut_docs, cut_docs, cut_tokens,
                        shortened, first)


@dataclass
class _Server:
    """What the feeder knows of one server; written by its task, read by `SglangSync.status` under the lock."""

    http: SglangHttp
    wake: asyncio.Event
    corpus_id: str = ""  # ours, last seen listed ("" none)
    generation: int = 0
    listed_at: float = 0.0  # time.time() when corpus_id was first seen listed
    adds: int = 0
    re_adds: int = 0  # adds of a corpus the server had listed before (it restarted)
    removes: int = 0
    error: str = ""  # the last failure, "" once a round succeeds
    refused: _Refusal | None = None  # the last add this server refused (4xx), until a newer generation is added


@dataclass(frozen=True)
class _Refusal:
    """An add a server refused (its status and message, the generation named): not sent again for the same
    generation before ``until`` (time.monotonic())."""

    generation: int
    until: float
    status: int
    message: str


class _Following(StaticSync):
    """The client's static sync, telling the feeder each generation it attaches."""

    def __init__(self, state: SyncState, files: GenerationFiles, landed: Callable[[StaticCache], None]) -> None:
        super().__init__(state, files)
        self.landed = landed

    async def adopt(self, gen: static_files_pb2.Generation) -> None:
        before = self.static
        await super().adopt(gen)
        if self.static is not None and self.static is not before:
            self.landed(self.static)


class SglangSync:
    """Keeps SGLang servers' external corpora in step with a namespace's generations (see the module docstring).

    One async core (`run`) with a thread facade (`start`, `close`) for embedding.
    Thread-safety: `status` may be called from any thread; the rest belongs to the loop.

    Args:
        addresses: the ngramcache service, ``host:port`` or a list of replicas.
        namespace: the namespace followed.
        tokenizer: the namespace's tokenizer (it decodes the corpus into SGLang's documents).
        targets: the SGLang servers.
        cache_dir: where generation files are fetched (default: the client's default cache folder).
        token, tls_ca, tls_cert, tls_key: how to reach the service (as `NgramClient`).
        interval: seconds between two rounds on a server (list, add, remove); also the longest
            wait before a failing server is tried again.
        max_tokens: the servers' --speculative-ngram-external-corpus-max-tokens; a corpus is cut to half.
        timeout, load_timeout: seconds for list/remove, and for an add (SGLang loads before answering).
        connect_timeout: seconds to wait for the service at the start.
        on_event: called on the loop with (kind, fields) for each event: ``connected`` (the service
            answered), ``generation`` (a corpus is ready), ``listed``, ``removed``, ``note``, ``error``
            (once per message; a refused add has ``refused``, its ``generation``, and ``retry_seconds``
            before it is sent again), ``recovered``. Default: logged.

    Raises:
        InvalidArgumentError: a bad address, interval or budget.
    """

    def __init__(self, addresses: str | Sequence[str], namespace: str, tokenizer: Tokenizer,
                 targets: Sequence[SglangTarget], *, cache_dir: str | os.PathLike[str] | None = None,
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, interval: float = 10.0, max_tokens: int = SGLANG_DEFAULT_MAX_TOKENS,
                 timeout: float = 10.0, load_timeout: float = 600.0, connect_timeout: float = 10.0,
                 on_event: Event | None = None) -> None:
        addrs = (addresses,) if isinstance(addresses, str) else tuple(addresses)
        if not addrs:
            raise InvalidArgumentError("give the ngramcache service's address (--server)")
        for a in addrs:
            check_address(a, "--server", "--tls-ca")
        if not targets:
            raise InvalidArgumentError("give at least one SGLang server (--sglang URL)")
        if not 0.05 <= interval <= 3600:
            raise InvalidArgumentError(f"interval must be in 0.05..3600 seconds, got {interval}")
        if max_tokens < 2:
            raise InvalidArgumentError(f"max_tokens must be at least 2, got {max_tokens}")
        cache = prepare_cache_dir(default_cache_dir() if cache_dir is None else cache_dir,
                                  create_parents=cache_dir is None)
        self.namespace = namespace
        self.tokenizer = tokenizer
        self.interval = interval
        self.max_tokens = max_tokens
        self.config = ClientConfig(addresses=addrs, namespace=namespace, fingerprint=bytes(tokenizer.fingerprint),
                                   vocab_size=int(tokenizer.vocab_size), cache_dir=cache, token=token, tls_ca=tls_ca,
                                   tls_cert=tls_cert, tls_key=tls_key, connect_timeout=connect_timeout,
                                   ready_timeout=max(connect_timeout, 1.0))
        self._targets = list(targets)
        self._timeouts = (timeout, load_timeout)
        self._on_event = on_event or _log_event
        self._ours = re.compile(re.escape(f"ngramcache-{namespace}-g") + r"(\d+)")
        self._lock = threading.Lock()
        self._servers: list[_Server] = []
        self.current: SglangCorpus | None = None
        self._landed: StaticCache | None = None
        self._landed_at = 0.0
        self._wake_prepare: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._start_error: BaseException | None = None
        self._started = threading.Event()  # set once the service answered (or run ended)

    # the async core

    async def run(self) -> None:
        """Connect to the service, then feed the servers until cancelled.

        Raises:
            NgramCacheError: the service cannot be reached within connect_timeout, the namespace does
                not exist, or it is bound to another tokenizer.
        """
        drafter = Drafter(dynamic=CountTable(), fingerprint=self.config.fingerprint, vocab_size=self.config.vocab_size)
        core = SyncLoop(self.config, drafter, CountTable())
        core.state.closing = asyncio.Event()
        self._wake_prepare = asyncio.Event()
        self._servers = [_Server(SglangHttp(t, timeout=self._timeouts[0], load_timeout=self._timeouts[1]),
                                 asyncio.Event()) for t in self._targets]
        tasks: list[asyncio.Task[None]] = []
        try:
            await core.connect()
            following = _Following(core.state, core.files, self._land)
            tasks = [asyncio.create_task(following.run(), name="ngc-sglang-generations"),
                     asyncio.create_task(core.health.run(), name="ngc-sglang-health"),
                     asyncio.create_task(self._prepare(), name="ngc-sglang-prepare")]
            tasks += [asyncio.create_task(self._serve(s), name=f"ngc-sglang-{s.http.target.url}")
                      for s in self._servers]
            self._on_event("connected", {"namespace": self.namespace, "service": core.state.stats.address,
                                         "servers": [t.url for t in self._targets], "interval": self.interval})
            self._started.set()
            await asyncio.gather(*tasks)
        finally:
            await cancel_until_done(tasks)
            await core.shutdown()

    def _land(self, cache: StaticCache) -> None:
        self._landed, self._landed_at = cache, time.time()
        assert self._wake_prepare is not None
        self._wake_prepare.set()

    async def _prepare(self) -> None:
        """Turns the newest attached generation into a corpus (the newest wins when several land meanwhile)."""
        assert self._wake_prepare is not None
        while True:
            await self._wake_prepare.wait()
            self._wake_prepare.clear()
            cache, landed_at = self._landed, self._landed_at
            if cache is None:
                continue
            t0 = time.perf_counter()
            try:
                corpus = await in_daemon_thread(functools.partial(prepare_corpus, cache, self.tokenizer, self.namespace,
                                                                 self.max_tokens // 2))
            except NgramCacheError as e:
                kept = f"the servers keep generation {self.current.generation}'s corpus" if self.current else \
                    "nothing is added"
                self._on_event("error", {"generation": cache.generation, "message": f"generation {cache.generation} "
                                         f"cannot be fed to SGLang: {e}; {kept}"})
                continue
            self.current = corpus
            self._on_event("generation", {
                "generation": corpus.generation, "corpus_id": corpus.corpus_id, "documents": corpus.documents,
                "tokens": corpus.tokens, "bytes": len(corpus.body), "total_documents": corpus.total_documents,
                "cut_documents": corpus.cut_documents, "cut_tokens": corpus.cut_tokens,
                "shortened_tokens": corpus.shortened_tokens, "budget_tokens": self.max_tokens // 2,
                "prepare_seconds": round(time.perf_counter() - t0, 3), "fetched_at": landed_at})
            for s in self._servers:
                s.wake.set()

    async def _serve(self, server: _Server) -> None:
        """One server's rounds, forever: never waits on another server."""
        backoff = Backoff(base=0.5, cap=self.interval, jitter=0.5)  # 0.5 s, 1 s, 2 s, ... up to the interval

        async def one_round() -> None:
            server.wake.clear()
            await self._round(server, self.current)

        def failed(e: SglangError, attempt: int) -> float:
            delay = backoff.delay(attempt) if e.retriable else self.interval
            if e.message != server.error:  # said once (a refused generation's message names it)
                fields = {"server": server.http.target.url, "message": e.message, "status": e.status,
                          "retry_seconds": round(delay, 2)}
                refused = server.refused
                if refused is not None and refused.message == e.message:  # the add waits longer than the list
                    fields.update(generation=refused.generation, refused=True, retry_seconds=self._refused_retry)
                self._on_event("error", fields)
            with self._lock:
                server.error = e.message
            return delay

        async def wait(seconds: float) -> None:  # a new corpus wakes the server's rounds early
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wake.wait(), seconds)

        while True:
            await retry(one_round, failed, errors=SglangError, sleep=wait)
            if server.error:
                self._on_event("recovered", {"server": server.http.target.url})
            with self._lock:
                server.error = ""
            await wait(self.interval)

    async def _round(self, server: _Server, corpus: SglangCorpus | None) -> None:
        http, url = server.http, server.http.target.url
        listed = await in_daemon_thread(http.list)
        if corpus is None:
            return
        cid = corpus.corpus_id
        if cid not in listed:
            refused = server.refused
            if refused is not None and refused.generation == corpus.generation and time.monotonic() < refused.until:
                # Not sent again: the server keeps what it has, and the same message is not said again.
                raise SglangError(url, refused.status, refused.message, retriable=False)
            lost = server.corpus_id == cid  # it was listed: the server restarted (or someone removed it)
            try:
                answer = await self._add(server, corpus, listed)
            except SglangError as e:
                if e.retriable or not 400 <= e.status < 500:
                    raise
                message = f"generation {corpus.generation}'s corpus was refused: {e.message}"
                with self._lock:
                    server.refused = _Refusal(corpus.generation, time.monotonic() + self._refused_retry, e.status,
                                              message)
                raise SglangError(url, e.status, message, retriable=False) from None
            listed = await in_daemon_thread(http.list)
            if cid not in listed:
                raise SglangError(url, 200, f"added {cid} but the server does not list it", retriable=True)
            with self._lock:
                server.adds += 1
                server.re_adds += int(lost)
                server.refused = None
                server.corpus_id, server.generation, server.listed_at = cid, corpus.generation, time.time()
            self._on_event("listed", {"server": url, "generation": corpus.generation, "corpus_id": cid,
                                      "tokens": listed[cid], "re_added": lost, "bytes": len(corpus.body),
                                      "message": str(answer.get("message", "")),
                                      "seconds_since_fetched": round(time.time() - self._landed_at, 3)})
        elif server.corpus_id != cid:
            with self._lock:
                server.corpus_id, server.generation, server.listed_at = cid, corpus.generation, time.time()
            self._on_event("listed", {"server": url, "generation": corpus.generation, "corpus_id": cid,
                                      "tokens": listed[cid], "re_added": False, "bytes": 0,
                                      "message": "listed already", "seconds_since_fetched": None})
        for old in self._older(listed, cid):
            await in_daemon_thread(functools.partial(http.remove, old))
            with self._lock:
                server.removes += 1
            self._on_event("removed", {"server": url, "corpus_id": old})

    def _older(self, listed: dict[str, int], current: str) -> list[str]:
        return [c for c in listed if c != current and self._ours.fullmatch(c)]

    async def _add(self, server: _Server, corpus: SglangCorpus, listed: dict[str, int]) -> dict[str, Any]:
        http, url = server.http, server.http.target.url
        try:
            answer: dict[str, Any] = await in_daemon_thread(lambda: http.add(corpus.body))
        except SglangError as e:
            if e.status == 400 and ALREADY_EXISTS in e.message:
                return {"message": e.message}  # another feeder added it meanwhile
            if e.status == 400 and EMPTY in e.message:  # we never send an empty corpus: SGLang dropped every document
                raise SglangError(url, e.status, f"{e.message} SGLang loaded none of it: its first document "
                                  f"({corpus.first_document_tokens:,} tokens) is past the server's "
                                  "--speculative-ngram-external-corpus-max-tokens (so is every document: SGLang "
                                  f"keeps whole documents), which is below --max-tokens ({self.max_tokens:,}): give "
                                  "--max-tokens the server's value", retriable=False) from None
            if not e.budget:
                raise
            older = self._older(listed, corpus.corpus_id)
            others = sum(n for c, n in listed.items() if c not in older)
            if not older:
                raise SglangError(url, e.status, f"{e.message} The corpus of generation {corpus.generation} "
                                  f"({corpus.tokens:,} tokens) does not fit beside the server's other corpora "
                                  f"({others:,} tokens): raise its --speculative-ngram-external-corpus-max-tokens, "
                                  "or give a smaller --max-tokens", retriable=False) from None
            self._on_event("note", {"server": url, "message": f"no room for generation {corpus.generation}'s corpus "
                                    f"beside {', '.join(older)}: removing {'it' if len(older) == 1 else 'them'} first "
                                    "(the server drafts from its other corpora meanwhile)"})
            for old in older:
                await in_daemon_thread(functools.partial(http.remove, old))
                with self._lock:
                    server.removes += 1
            answer = await in_daemon_thread(lambda: http.add(corpus.body))
        message = str(answer.get("message", ""))
        truncated = TRUNCATED.search(message)
        if truncated:
            limit = int(truncated.group(1))
            if limit < self.max_tokens:  # the server's own limit is the cause: name it
                why = (f": the server's --speculative-ngram-external-corpus-max-tokens is {limit:,}, below --max-tokens "
                       f"{self.max_tokens:,}; give --max-tokens {limit} (each corpus is cut to half of it)")
            else:  # we sent at most half of its limit by our count: SGLang's tokenizer counted more
                why = (f" (the corpus was cut to {corpus.tokens:,} tokens with the namespace's tokenizer: the model's "
                       "counts more)")
            self._on_event("note", {"server": url, "message": f"SGLang cut generation {corpus.generation}'s corpus: "
                                    f"{message}{why}"})
        return answer

    @property
    def _refused_retry(self) -> float:
        return max(REFUSED_RETRY_SECONDS, self.interval)

    # status and the thread facade

    def status(self) -> list[dict[str, Any]]:
        """One dict per server: url, corpus_id and generation listed, listed_at, adds, re_adds, removes,
        bytes_sent, error (empty when the last round succeeded), refused_generation (the generation whose add
        it refused and that is not sent to it again for now; 0 none)."""
        with self._lock:
            return [{"url": s.http.target.url, "corpus_id": s.corpus_id, "generation": s.generation,
                     "listed_at": s.listed_at, "adds": s.adds, "re_adds": s.re_adds, "removes": s.removes,
                     "bytes_sent": s.http.bytes_sent, "error": s.error,
                     "refused_generation": s.refused.generation if s.refused else 0} for s in self._servers]

    def start(self) -> SglangSync:
        """Run `run` on a daemon thread's loop; returns once the service answered (or raises its error)."""
        def body() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._main = loop.create_task(self.run())
            try:
                loop.run_until_complete(self._main)
            except asyncio.CancelledError:
                pass
            except BaseException as e:  # the constructor's caller gets it
                self._start_error = e
            finally:
                self._started.set()
                loop.close()

        self._thread = threading.Thread(target=body, name=f"ngramcache-sglang-{self.namespace}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        return self

    def close(self) -> None:
        """Stop the thread `start` began (the servers keep their corpora)."""
        if self._thread is None or self._loop is None or self._main is None:
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join(10)
        self._thread = None

    def __enter__(self) -> SglangSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_event(kind: str, fields: dict[str, Any]) -> None:
    level = logging.WARNING if kind in ("error", "note") else logging.INFO
    log.log(level, "ngramcache sglang-sync: %s %s", kind, fields)
