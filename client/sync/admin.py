"""AdminClient: namespaces, publishing a generation and rebuilds on a service, as a Python API (the CLI's `namespace`, `publish` and `rebuild` commands use it).

    with AdminClient("127.0.0.1:50051", token=TOKEN, tls_ca="ca.pem") as admin:
        admin.create_namespace("code", tokenizer)            # idempotent for the same tokenizer
        admin.publish("code", "code.ngc")                    # its generation number is the file's
        status = admin.wait_rebuild(admin.start_rebuild("code", min_count=2))

Errors are the library's (`error_from_rpc`): `NamespaceNotFoundError`, `TokenizerMismatchError`,
`GenerationNotNewerError`, `LeaseHeldError`, `BackendUnavailableError` (retriable), ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from ngramcache.client._core import StaticCache
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, static_files_pb2, static_files_pb2_grpc
from ngramcache.client.sync.config import HasTokenizer
from ngramcache.client.wire.address import check_address
from ngramcache.client.wire.transport import (
    auth_metadata,
    channel_credentials,
    error_from_rpc,
    open_channel,
    read_pem,
    wait_ready,
)

__all__ = ["AdminClient", "NamespaceInfo", "PublishedGeneration", "RebuildStatus"]

CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class NamespaceInfo:
    """A namespace as the service describes it."""

    name: str
    fingerprint: bytes  # the tokenizer's 32-byte fingerprint
    vocab_size: int
    latest_generation: int  # 0: none published yet
    counts_version: int
    created: bool = False  # create_namespace only: True when this call created it


@dataclasses.dataclass(frozen=True)
class PublishedGeneration:
    namespace: str
    generation: int
    size: int
    sha256: bytes
    already_published: bool = False  # this exact file had been published before (nothing changed)


@dataclasses.dataclass(frozen=True)
class RebuildStatus:
    """A rebuild's progress; ``state`` is running, done or failed (idle: none ran on that replica).

    ``base_generation`` is the corpus base it folds (0: none), ``previous_rows`` the base's rows folded.
    """

    namespace: str
    state: str
    phase: str
    generation: int
    holder: str
    lease_token: int
    started_unix_ms: int
    finished_unix_ms: int
    previous_rows: int
    dynamic_rows: int
    corpus_tokens: int
    n_keys: int
    n_followers: int
    file_bytes: int
    error: str
    history_tokens: int = 0
    base_generation: int = 0

    @property
    def seconds(self) -> float:
        """How long it ran (at least a millisecond once finished; so far while running)."""
        end = self.finished_unix_ms or int(time.time() * 1000)
        return max(end - self.started_unix_ms, 1) / 1000


def _namespace(ns: admin_pb2.Namespace, created: bool = False) -> NamespaceInfo:
    return NamespaceInfo(ns.name, bytes(ns.tokenizer_fingerprint), ns.vocab_size, ns.latest_generation,
                         ns.counts_version, created)


def _rebuild_status(s: admin_pb2.RebuildStatus) -> RebuildStatus:
    return RebuildStatus(
        namespace=s.namespace, state=s.state, phase=s.phase, generation=s.generation, holder=s.holder,
        lease_token=s.lease_token, started_unix_ms=s.started_unix_ms, finished_unix_ms=s.finished_unix_ms,
        previous_rows=s.previous_rows, dynamic_rows=s.dynamic_rows, corpus_tokens=s.corpus_tokens, n_keys=s.n_keys,
        n_followers=s.n_followers, file_bytes=s.file_bytes, error=s.error, history_tokens=s.history_tokens,
        base_generation=s.base_generation)


class AdminClient:
    """A synchronous client of a service's Admin and StaticFiles.Publish; a context manager.

    Thread-safety: one client may be used from several threads (gRPC channels are).

    Args:
        address: ``host:port`` of the service.
        token: a bearer token (the admin role for these calls), or None.
        tls_ca: PEM file (or bytes) of the CA to trust: TLS; None: plaintext.
        tls_cert, tls_key: a client certificate and key, for mutual TLS.
        timeout: seconds each call may take (a publish: per MiB on top).

    Raises:
        InvalidArgumentError: ``address`` is not ``HOST:PORT`` (a URL such as ``http://...``, no port).
    """

    def __init__(self, address: str, *, token: str | None = None, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 timeout: float = 10.0) -> None:
        self.address = check_address(address)
        self._timeout = timeout
        self._metadata = auth_metadata(token)
        self._tls = (read_pem(tls_ca, "tls_ca"), tls_cert, tls_key)
        self._channel = open_channel(address, channel_credentials(self._tls[0], tls_cert, tls_key),
                                     options=[("grpc.max_send_message_length", 64 << 20)])
        self._admin = admin_pb2_grpc.AdminStub(self._channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self._files = static_files_pb2_grpc.StaticFilesStub(self._channel)  # type: ignore[no-untyped-call]

    def _call(self, fn: Callable[..., Any], request: Any, timeout: float | None = None) -> Any:
        try:
            return fn(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def wait_ready(self) -> None:
        """Wait up to the timeout for the service to answer, failing at once when a connection attempt fails
        for a cause a probe can name (`ngramcache.client.wire.transport.wait_ready`).

        Raises:
            ServiceUnreachableError: refused, unknown host, TLS on one side only, an untrusted certificate,
                not a gRPC server, ... (``diagnosis`` says which, and the setting to change).
            BackendUnavailableError: nothing answered within the timeout, for no cause found.
        """
        wait_ready(self._channel, self.address, self._timeout, *self._tls)

    # namespaces

    def create_namespace(self, name: str, tokenizer: HasTokenizer | tuple[bytes, int]) -> NamespaceInfo:
        """Create ``name`` bound to the tokenizer (idempotent for the same one; TokenizerMismatchError for another)."""
        fingerprint, vocab_size = (tokenizer if isinstance(tokenizer, tuple)
                                   else (tokenizer.fingerprint, tokenizer.vocab_size))
        resp = self._call(self._admin.CreateNamespace, admin_pb2.CreateNamespaceRequest(
            name=name, tokenizer_fingerprint=bytes(fingerprint), vocab_size=int(vocab_size)))
        return _namespace(resp.namespace, resp.created)

    def get_namespace(self, name: str) -> NamespaceInfo:
        return _namespace(self._call(self._admin.GetNamespace, admin_pb2.GetNamespaceRequest(name=name)).namespace)

    def list_namespaces(self) -> list[NamespaceInfo]:
        """Every namespace, all pages."""
        out: list[NamespaceInfo] = []
        token = ""
        while True:
            resp = self._call(self._admin.ListNamespaces, admin_pb2.ListNamespacesRequest(page_size=500, page_token=token))
            out.extend(_namespace(ns) for ns in resp.namespaces)
            token = resp.next_page_token
            if not token:
                return out

    def drop_namespace(self, name: str) -> bool:
        """Drop ``name`` with its counts and files; True if it existed."""
        return bool(self._call(self._admin.DropNamespace, admin_pb2.DropNamespaceRequest(name=name)).existed)

    # publishing

    def publish(self, namespace: str, path: str | os.PathLike[str]) -> PublishedGeneration:
        """Upload the static file at ``path`` as the generation its header names (verified by the service).

        Raises:
            CacheFormatError: the file is not a valid static cache (checked here first).
            GenerationNotNewerError: its generation is not above the namespace's latest.
            TokenizerMismatchError: it is for another tokenizer.
        """
        path = os.fspath(path)
        cache = StaticCache.open(path)
        generation = cache.generation
        del cache
        size = os.path.getsize(path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                digest.update(block)
        sha256 = digest.digest()

        def requests() -> Iterator[static_files_pb2.PublishRequest]:
            yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace=namespace, generation=generation, size=size, sha256=sha256))
            with open(path, "rb") as f:
                offset = 0
                for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                    yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=offset, data=block))
                    offset += len(block)

        resp = self._call(self._files.Publish, requests(), timeout=self._timeout + size / (1 << 20))
        g = resp.generation
        return PublishedGeneration(g.namespace or namespace, g.generation or generation, g.size or size,
                                   bytes(g.sha256) or sha256, bool(resp.already_published))

    # rebuilds

    def start_rebuild(self, namespace: str, *, min_count: int = 1, ngram_size: int = 0, base: bool = True,
                      decay: float = 1.0, corpus: Sequence[str] = (), memory_budget: int = 0,
                      keep: int = 0, history: bool = True, include_previous: bool = False) -> RebuildStatus:
        """Start a rebuild of ``namespace`` on the replica this client talks to (docs/operations.md).

        It folds the namespace's corpus base (the latest published generation, times ``decay``),
        its dynamic counts, ``corpus`` and the fleet history. ``base=False`` leaves the base out and
        forgets it (the next rebuilds fold the counts alone until a generation is published);
        ``history=False`` leaves the fleet history out of the new corpus index.
        ``include_previous`` is deprecated and ignored: the base is folded by default.
        """
        if include_previous:
            warnings.warn("include_previous is ignored: every rebuild folds the corpus base now (base=False drops it)",
                          DeprecationWarning, stacklevel=2)
        return _rebuild_status(self._call(self._admin.StartRebuild, admin_pb2.StartRebuildRequest(
            namespace=namespace, min_count=min_count, ngram_size=ngram_size, skip_base=not base,
            decay=decay, corpus=list(corpus), memory_budget=memory_budget, keep=keep, skip_history=not history)))

    def rebuild_status(self, namespace: str) -> RebuildStatus:
        return _rebuild_status(self._call(self._admin.GetRebuildStatus, admin_pb2.GetRebuildStatusRequest(namespace=namespace)))

    def wait_rebuild(self, status: RebuildStatus, *, poll: float = 0.5,
                     progress: Callable[[RebuildStatus], None] | None = None) -> RebuildStatus:
        """Poll until the rebuild ``status`` describes ends; returns its final status (``state`` done or failed)."""
        while status.state == "running":
            if progress is not None:
                progress(status)
            time.sleep(poll)
            status = self.rebuild_status(status.namespace)
        return status

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

