"""A stand-in for SGLang's external-corpus routes on 127.0.0.1: the answers, errors and token budget of SGLang 0.5.23's source.

    with FakeSglang(tokenizer, max_tokens=10_000) as server:   # server.url: http://127.0.0.1:PORT
        server.corpora                                          # {corpus_id: tokens loaded}
        server.restart()                                        # same port, corpora lost (a pod restart)

What it copies, and from where (paths in the sglang 0.5.23 wheel; ngramcache/client/tools/sglang_http.py
lists them): the three routes of ``srt/entrypoints/http_server.py`` with their bodies and statuses;
bearer-key checks of ``srt/utils/auth.py`` (401 ``{"error": "Unauthorized"}``); the documents path of
``srt/managers/tokenizer_control_mixin.py`` (encode without special tokens, skip empty documents, a
separator token between two, drop the documents past ``max_tokens`` with "(truncated: exceeded N token
limit)"); the load of ``srt/speculative/cpp_ngram/ngram_corpus.py`` (an existing id refused, the
remaining budget over all corpora); ``ngram.cpp`` (remove of an unknown id succeeds, an empty corpus
fails); requests served one at a time (``communicator.py``). It tokenizes with the tokenizer given,
as SGLang does with the model's.
"""

from __future__ import annotations

import json
import ssl
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["FakeSglang"]

ADD_FIELDS = {"corpus_id", "file_path", "documents", "token_chunks", "rid", "http_worker_ipc"}


class FakeSglang:
    """The fake server; a context manager. Thread-safety: its state is guarded by one lock (requests go one by one).

    Args:
        tokenizer: anything with ``encode(text) -> token ids``.
        max_tokens: --speculative-ngram-external-corpus-max-tokens.
        api_key: --api-key (None: open).
        ngram: False for a server not run with --speculative-algorithm NGRAM.
        port: 0 for a free one.
        tls: (cert, key) PEM paths to serve https.
    """

    def __init__(self, tokenizer: Any, *, max_tokens: int = 10_000_000, api_key: str | None = None,
                 ngram: bool = True, port: int = 0, tls: tuple[Path, Path] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.api_key = api_key
        self.ngram = ngram
        self.tls = tls
        self.corpora: dict[str, int] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, body bytes)
        self.lock = threading.Lock()
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._port}"

    def start(self) -> FakeSglang:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        if self.tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(self.tls[0]), str(self.tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def restart(self) -> None:
        """Stop, lose every corpus (a new process), start again on the same port."""
        self.stop()
        with self.lock:
            self.corpora = {}
        self.start()

    def __enter__(self) -> FakeSglang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # the routes

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        path = h.path.split("?", 1)[0]
        with self.lock:
            self.requests.append((method, path, len(raw)))
            status, body = self._route(method, path, raw, h.headers.get("Authorization"))
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _route(self, method: str, path: str, raw: bytes, authorization: str | None) -> tuple[int, dict[str, Any]]:
        routes = {("POST", "/add_external_corpus"): self._add, ("POST", "/remove_external_corpus"): self._remove,
                  ("GET", "/list_external_corpora"): self._list}
        route = routes.get((method, path))
        if route is None:
            return 404, {"detail": "Not Found"}
        if self.api_key and authorization != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}
        if method == "POST":
            try:
                payload = json.loads(raw)
            except ValueError:
                return 500, {"detail": "Internal Server Error"}  # request.json() raises: FastAPI's 500
        else:
            payload = {}
        return route(payload)

    def _add(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        unknown = sorted(set(payload) - ADD_FIELDS)
        if unknown:
            return 400, {"success": False,
                         "message": f"AddExternalCorpusReqInput.__init__() got an unexpected keyword argument "
                                    f"'{unknown[0]}'"}

        def answer(success: bool, message: str, cid: str = "", loaded: int = 0) -> tuple[int, dict[str, Any]]:
            return (200 if success else 400), {"success": success, "corpus_id": cid, "message": message,
                                               "loaded_token_count": loaded}

        if not self.ngram:
            return answer(False, "Ngram speculative decoding is not enabled.")
        cid = payload.get("corpus_id") or uuid.uuid4().hex
        documents = payload.get("documents")
        if payload.get("file_path") is not None:
            return answer(False, f"External ngram corpus path does not exist: {payload['file_path']}")
        if documents is None:
            return answer(False, "Either file_path or documents must be provided.")
        chunks: list[int] = []  # tokens of each document kept, its separator included
        truncated = False
        for doc in documents:
            if not doc:
                continue
            n = len(self.tokenizer.encode(doc))
            if not n:
                continue
            n += 1 if chunks else 0
            if sum(chunks) + n > self.max_tokens:
                truncated = True
                break
            chunks.append(n)
        if cid in self.corpora:
            return answer(False, f"External corpus '{cid}' already exists. Remove it before adding a new corpus "
                                 "with the same id.")
        remaining = self.max_tokens - sum(self.corpora.values())
        loaded = 0
        for n in chunks:  # the load checks the remaining budget chunk by chunk
            if loaded + n > remaining:
                return answer(False, f"External ngram corpus exceeds the remaining token budget ({remaining}) after "
                                     f"loading {loaded} tokens.")
            loaded += n
        if not loaded:
            return answer(False, "External corpus is empty — no tokens were loaded.")
        self.corpora[cid] = loaded
        message = f"Loaded corpus '{cid}' with {loaded} tokens."
        if truncated:
            message += f" (truncated: exceeded {self.max_tokens} token limit)"
        return answer(True, message, cid, loaded)

    def _remove(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        cid = payload.get("corpus_id")
        if not cid:
            return 400, {"success": False, "message": "corpus_id is required."}
        if not self.ngram:
            return 400, {"success": False, "message": "Ngram speculative decoding is not enabled."}
        self.corpora.pop(cid, None)
        return 200, {"success": True, "message": f"Removed corpus '{cid}'."}

    def _list(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not self.ngram:
            return 400, {"success": False, "corpus_token_counts": {}, "message": "Ngram speculative decoding is not "
                         "enabled."}
        return 200, {"success": True, "corpus_token_counts": dict(self.corpora), "message": ""}
