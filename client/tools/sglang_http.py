"""SGLang's external-corpus HTTP API (`/add_external_corpus`, `/remove_external_corpus`, `/list_external_corpora`), as its source defines it.

Pinned from the wheel of SGLang 0.5.23 (the newest on the package index on 2026-12-04), and
checked to be the same in 0.5.11, 0.5.12, 0.5.13, 0.5.16 and 0.5.19; 0.5.10 and 0.5.10.post1
have none of these routes (so: SGLang 0.5.11 .. 0.5.23). What was read, by path in the wheel:

- ``sglang/srt/entrypoints/http_server.py``: ``add_external_corpus`` (``POST /add_external_corpus``)
  builds ``AddExternalCorpusReqInput(**json)``: an unknown field is a TypeError, answered 400
  ``{"success": false, "message"}``; otherwise 200 if the load succeeded, else 400, both with
  ``{"success", "corpus_id", "message", "loaded_token_count"}``. ``remove_external_corpus``
  (``POST /remove_external_corpus``) takes ``{"corpus_id"}`` (400 "corpus_id is required." when
  missing) and answers ``{"success", "message"}``. ``list_external_corpora`` (``GET
  /list_external_corpora``) answers ``{"success", "corpus_token_counts": {id: tokens}, "message"}``
  (0.5.11 already returns the counts). A body that is not JSON raises in ``request.json()``: 500.
  All three are ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``.
- ``sglang/srt/utils/auth.py``: ``decide_request_auth``: for ADMIN_OPTIONAL routes the admin key
  (``--admin-api-key``) if set, else the API key (``--api-key``), as ``Authorization: Bearer KEY``;
  no key configured: open. Refused: 401 ``{"error": "Unauthorized"}`` (403 "Forbidden" only for
  ADMIN_FORCE routes).
- ``sglang/srt/managers/io_struct.py``: ``AddExternalCorpusReqInput`` has ``corpus_id``,
  ``file_path`` (a JSONL file on the server's disk), ``documents`` (a list of strings) and
  ``token_chunks`` (internal, filled by the server).
- ``sglang/srt/managers/tokenizer_control_mixin.py``: ``add_external_corpus``: 400 "Ngram
  speculative decoding is not enabled." unless ``--speculative-algorithm NGRAM`` (the same for
  remove and list); a missing ``corpus_id`` becomes a uuid; ``documents`` are encoded one by one
  without special tokens, empty ones skipped, one separator token between two documents, and the
  documents past ``--speculative-ngram-external-corpus-max-tokens`` (default 10,000,000, counting
  the separators) are dropped with a 200 whose message ends "(truncated: exceeded N token
  limit)"; a ``file_path`` past it fails (400). Requests go one by one (``communicator.py``
  ``queueing_call``: a FIFO lock), and the answer comes after the corpus is loaded.
- ``sglang/srt/speculative/cpp_ngram/ngram_corpus.py``: ``load_external_corpus_named``: an id
  already loaded is refused ("already exists. Remove it before adding ..."); the load may use only
  ``remaining_token_budget`` = max tokens minus the tokens of every loaded corpus: past it, 400
  "External ngram corpus exceeds the remaining token budget (R) after loading N tokens." So the
  limit is a total over all corpora: replacing a corpus by adding the new one before removing the
  old one needs room for both.
- ``sglang/kernels/jit/csrc/ngram_corpus/ngram.cpp``: ``removeExternalCorpus`` erases the id
  whether or not it exists (so removing an unknown id is a 200); ``listExternalCorpora`` gives
  each corpus's token count (separators included); a load that kept no token fails 400 "External
  corpus is empty — no tokens were loaded." (so a corpus whose first document is past the token
  limit: SGLang drops whole documents, and the message does not give the limit).
- ``sglang/srt/speculative/external_corpus_manager.py``: a second add while a load runs in the
  scheduler is refused "Another corpus load is already in progress." (400).
- ``sglang/srt/arg_groups/fields/spec.py``: ``--speculative-ngram-external-sam-budget`` (default
  0) is the draft nodes given to the external corpora; at 0 a corpus loads and is listed but never
  drafted from.

SGLang itself was not run here: tests/integration/test_sglang_sync.py drives `SglangHttp` against
a small server that answers as the source above does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError

__all__ = ["SglangError", "SglangHttp", "SglangTarget", "in_daemon_thread"]

T = TypeVar("T")

NOT_ENABLED = "Ngram speculative decoding is not enabled."
BUDGET_REFUSED = "exceeds the remaining token budget"
LOAD_BUSY = "Another corpus load is already in progress."
ALREADY_EXISTS = "already exists"
EMPTY = "External corpus is empty"
TRUNCATED = re.compile(r"\(truncated: exceeded (\d+) token limit\)")  # group 1: the server's limit


class SglangError(NgramCacheError):
    """A call to an SGLang server failed: ``status`` is the HTTP status (0: no answer), ``message`` SGLang's."""

    def __init__(self, url: str, status: int, message: str, *, retriable: bool) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.message = message
        self.retriable = retriable

    @property
    def budget(self) -> bool:
        """The load did not fit the server's remaining token budget."""
        return self.status == 400 and BUDGET_REFUSED in self.message


@dataclass(frozen=True)
class SglangTarget:
    """One SGLang server and how to reach it.

    Attributes:
        url: its base URL, ``http://host:port`` or ``https://host:port`` (a path prefix is kept).
        api_key: sent as ``Authorization: Bearer KEY`` (the server's --admin-api-key, else its --api-key).
        headers: more request headers (a gateway's, say).
        ca_file: PEM CA certificates to trust for an https URL (default: the system's).
    """

    url: str
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    ca_file: str | None = None

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgumentError(f"--sglang {self.url}: not an http:// or https:// URL with a host "
                                       "(e.g. http://127.0.0.1:30000)")
        if parts.query or parts.fragment:
            raise InvalidArgumentError(f"--sglang {self.url}: give the server's base URL, without ?query or #fragment")
        object.__setattr__(self, "url", self.url.rstrip("/"))


class SglangHttp:
    """The three routes of one SGLang server over urllib (blocking: call from a thread; `in_daemon_thread` does).

    Proxies from the environment are not used: the feeder talks to its servers directly.
    Thread-safety: safe to use from several threads (each call opens its own connection).

    Args:
        target: the server.
        timeout: seconds for list and remove.
        load_timeout: seconds for an add (SGLang answers after tokenizing and loading the corpus).
    """

    def __init__(self, target: SglangTarget, *, timeout: float = 10.0, load_timeout: float = 600.0) -> None:
        self.target = target
        self.timeout = timeout
        self.load_timeout = load_timeout
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if target.url.startswith("https:"):
            try:
                context = ssl.create_default_context(cafile=target.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgumentError(f"--sglang-ca {target.ca_file}: {getattr(e, 'strerror', None) or e}") from None
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)
        self.bytes_sent = 0  # request bodies, summed

    def list(self) -> dict[str, int]:
        """The server's corpora: id -> tokens loaded."""
        body = self._call("GET", "/list_external_corpora", None, self.timeout)
        counts = body.get("corpus_token_counts")
        if not isinstance(counts, dict):
            raise SglangError(self.target.url, 200, "list_external_corpora answered without corpus_token_counts "
                              "(SGLang older than 0.5.11?)", retriable=False)
        return {str(k): int(v) for k, v in counts.items()}

    def add(self, body: bytes) -> dict[str, Any]:
        """POST a prepared ``{"corpus_id", "documents"}`` body; returns SGLang's answer (its ``message`` says
        whether SGLang truncated the corpus)."""
        return self._call("POST", "/add_external_corpus", body, self.load_timeout)

    def remove(self, corpus_id: str) -> None:
        self._call("POST", "/remove_external_corpus", json.dumps({"corpus_id": corpus_id}).encode(), self.timeout)

    def _call(self, method: str, route: str, data: bytes | None, timeout: float) -> dict[str, Any]:
        url = self.target.url
        headers = {"Accept": "application/json", **self.target.headers}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.target.api_key:
            headers["Authorization"] = f"Bearer {self.target.api_key}"
        request = urllib.request.Request(url + route, data=data, method=method, headers=headers)
        if data is not None:
            self.bytes_sent += len(data)
        try:
            with self._opener.open(request, timeout=timeout) as resp:
                raw = resp.read()
            status = 200
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise SglangError(url, 0, f"its TLS certificate is not trusted ({reason.verify_message}): give "
                                  "--sglang-ca with the CA that signed it", retriable=False) from None
            raise SglangError(url, 0, f"unreachable ({reason})", retriable=True) from None
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"message": raw[:200].decode("utf-8", "replace")}
        if not isinstance(body, dict):
            body = {"message": str(body)[:200]}
        message = str(body.get("message") or body.get("error") or body.get("detail") or "")
        if status == 200 and body.get("success", True):
            return body
        if status in (401, 403):
            key = "the key was refused" if self.target.api_key else "it needs a key"
            raise SglangError(url, status, f"{route} answered {status} {message or 'Unauthorized'}: {key}; give "
                              "--sglang-api-key (the server's --admin-api-key, else its --api-key)", retriable=False)
        if status == 404:
            raise SglangError(url, status, f"{route} not found (404): the external-corpus routes need SGLang "
                              "0.5.11 or newer", retriable=False)
        if status == 400 and NOT_ENABLED in message:
            raise SglangError(url, status, f"{message} Run SGLang with --speculative-algorithm NGRAM",
                              retriable=False)
        retriable = status >= 500 or status in (408, 429) or (status == 400 and LOAD_BUSY in message)
        raise SglangError(url, status, f"{route} answered {status}: {message or 'no message'}", retriable=retriable)


def in_daemon_thread(fn: Callable[[], T]) -> Any:
    """An awaitable of ``fn()`` run in a new daemon thread: an HTTP call stuck until its timeout never holds up
    the process's exit (asyncio.to_thread's executor threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting task
            outcome: tuple[bool, Any] = (False, e)
        else:
            outcome = (True, result)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the process is ending)
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="ngramcache-sglang-http", daemon=True).start()
    return future
