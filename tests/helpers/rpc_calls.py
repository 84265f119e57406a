"""Stubs of the service's four gRPC services over one channel, one complete call of each RPC (`CALLS`, as a client
makes it: streams read to their end, Watch to its first message), and the static files they publish: what the auth
and TLS tests call the service with."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ngramcache import build_static_from_tokens
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    drafting_pb2,
    drafting_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.wire.codec import delta_rows_to_bytes, tokens_to_bytes

__all__ = ["ADMIN_CALLS", "CALLS", "DRAFT_CALLS", "FP", "TIMEOUT", "VOCAB", "Call", "Metadata", "Stubs", "call_create",
           "call_draft", "call_drop", "call_fetch", "call_get", "call_list", "call_publish", "call_pull", "call_push",
           "call_session", "call_watch", "publish_requests", "refused", "static_file"]

FP = b"\x11" * 32
"""The tokenizer fingerprint of the namespaces the calls name."""

VOCAB = 50
"""Their vocabulary."""

TIMEOUT = 20
"""Seconds a call may take."""


def static_file(folder: Path, generation: int) -> bytes:
    """The bytes of a real static file of `generation` (built in `folder`)."""
    rng = np.random.default_rng(generation)
    path = folder / f"gen{generation}.ngc"
    build_static_from_tokens([rng.integers(0, VOCAB, 2000).astype(np.int32)], str(path), vocab_size=VOCAB, ngram_size=2,
                             fingerprint=FP, generation=generation)
    return path.read_bytes()


_GENERATIONS = itertools.count(2)  # each successful Publish in this process takes the next


def publish_requests(namespace: str, data: bytes, generation: int) -> Iterator[static_files_pb2.PublishRequest]:
    """A Publish stream: the header, then `data` in 8 KiB chunks."""
    yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
        namespace=namespace, generation=generation, size=len(data), sha256=hashlib.sha256(data).digest()))
    for offset in range(0, len(data), 8192):
        yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=offset,
                                                                               data=data[offset:offset + 8192]))


@dataclasses.dataclass
class Stubs:
    """Stubs of the four services over one channel, and what the calls below need."""

    channel: grpc.Channel
    folder: Path  # where static files are built

    def __post_init__(self) -> None:
        self.drafting = drafting_pb2_grpc.DraftingStub(self.channel)
        self.counts = counts_pb2_grpc.CountsStub(self.channel)
        self.files = static_files_pb2_grpc.StaticFilesStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)


Metadata = tuple[tuple[str, str], ...] | None


# One complete call of each RPC (streams read to their end, Watch to its first message).
def call_draft(s: Stubs, ns: str, md: Metadata) -> Any:
    return s.drafting.Draft(drafting_pb2.DraftRequest(namespace=ns, tokenizer_fingerprint=FP, vocab_size=VOCAB,
                                                      tokens=tokens_to_bytes(np.array([1, 2, 3], np.int32)), n_draft=4),
                            metadata=md, timeout=TIMEOUT)


def call_session(s: Stubs, ns: str, md: Metadata) -> Any:
    requests = [drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace=ns, tokenizer_fingerprint=FP,
                                                                          vocab_size=VOCAB, n_draft=4)),
                drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes(np.array([1, 2], np.int32))))]
    responses = list(s.drafting.Session(iter(requests), metadata=md, timeout=TIMEOUT))
    assert [r.WhichOneof("kind") for r in responses] == ["opened", "draft"]
    return responses


def call_push(s: Stubs, ns: str, md: Metadata) -> Any:
    rows = np.array([[2, 5, 6, -1, -1, 7, 1]], dtype=np.int32)
    return s.counts.Push(counts_pb2.PushRequest(namespace=ns, tokenizer_fingerprint=FP, client_id=uuid.uuid4().hex, seq=1,
                                                rows=delta_rows_to_bytes(rows)), metadata=md, timeout=TIMEOUT)


def call_pull(s: Stubs, ns: str, md: Metadata) -> Any:
    return list(s.counts.Pull(counts_pb2.PullRequest(namespace=ns, tokenizer_fingerprint=FP), metadata=md, timeout=TIMEOUT))


def call_list(s: Stubs, ns: str, md: Metadata) -> Any:
    return s.files.List(static_files_pb2.ListGenerationsRequest(namespace=ns), metadata=md, timeout=TIMEOUT)


def call_fetch(s: Stubs, ns: str, md: Metadata) -> Any:
    return list(s.files.Fetch(static_files_pb2.FetchRequest(namespace=ns), metadata=md, timeout=TIMEOUT))


def call_watch(s: Stubs, ns: str, md: Metadata) -> Any:
    stream = s.files.Watch(static_files_pb2.WatchRequest(namespace=ns), metadata=md, timeout=TIMEOUT)
    try:
        return next(stream)
    finally:
        stream.cancel()


def call_publish(s: Stubs, ns: str, md: Metadata) -> Any:
    generation = next(_GENERATIONS)
    return s.files.Publish(publish_requests(ns, static_file(s.folder, generation), generation), metadata=md,
                           timeout=TIMEOUT)


def call_get(s: Stubs, ns: str, md: Metadata) -> Any:
    return s.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name=ns), metadata=md, timeout=TIMEOUT)


def call_create(s: Stubs, ns: str, md: Metadata) -> Any:
    return s.admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name=ns, tokenizer_fingerprint=FP, vocab_size=VOCAB),
                                   metadata=md, timeout=TIMEOUT)


def call_drop(s: Stubs, ns: str, md: Metadata) -> Any:
    return s.admin.DropNamespace(admin_pb2.DropNamespaceRequest(name=ns), metadata=md, timeout=TIMEOUT)


Call = Callable[[Stubs, str, Metadata], Any]
DRAFT_CALLS: dict[str, Call] = {"Draft": call_draft, "Session": call_session, "Pull": call_pull, "List": call_list,
                                "Fetch": call_fetch, "Watch": call_watch}
ADMIN_CALLS: dict[str, Call] = {"Publish": call_publish, "CreateNamespace": call_create, "DropNamespace": call_drop}
CALLS: dict[str, Call] = {**DRAFT_CALLS, "Push": call_push, "GetNamespace": call_get, **ADMIN_CALLS}


def refused(call: Callable[[], object]) -> grpc.RpcError:
    """The gRPC error `call` raises (it must raise one)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value
