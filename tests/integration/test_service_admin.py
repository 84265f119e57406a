"""The Admin service over a real gRPC server on loopback, in front of every counts store backend (embedded, a real redis-server, a real Redis Cluster)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from helpers.counts import FP, OTHER_FP, VOCAB, batch, row
from helpers.service import ServerThread

import ngramcache
from ngramcache.cache_service.counts.store import CountsStore
from ngramcache.cache_service.servicers.admin import V1_CAPABILITIES, AdminServicer, ServerInfo, ServerLimits
from ngramcache.cache_service.servicers.counts import CountsServicer
from ngramcache.cache_service.store_runner import StoreRunner
from ngramcache.client import MAX_DRAFT, MAX_VOCAB, NGRAM_MAX
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import delta_rows_to_bytes

pytestmark = pytest.mark.integration

REASON = "ngc-error-reason"
LIMITS = ServerLimits(max_message_bytes=4 << 20, max_draft_tokens=4096, max_step_tokens=1024, max_session_tokens=0,
                      max_sessions=10, max_batch_rows=10**9, max_chunk_rows=500, max_static_file_bytes=1 << 30)


@dataclasses.dataclass
class AdminService:
    """An AdminServicer and a CountsServicer on a real server in front of one store, and stubs to them."""

    store: CountsStore
    admin: admin_pb2_grpc.AdminStub
    counts: counts_pb2_grpc.CountsStub
    dropped: list[str]
    names: list[str] = dataclasses.field(default_factory=list)

    def name(self) -> str:
        """A fresh namespace name, dropped after the test."""
        name = "a-" + uuid.uuid4().hex[:12]
        self.names.append(name)
        return name

    def create(self, name: str, fingerprint: bytes = FP, vocab_size: int = VOCAB,
               **fields: Any) -> admin_pb2.CreateNamespaceResponse:
        reply: admin_pb2.CreateNamespaceResponse = self.admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(
            name=name, tokenizer_fingerprint=fingerprint, vocab_size=vocab_size, **fields), timeout=30)
        return reply


@pytest.fixture
def service(make_store: Callable[..., CountsStore]) -> Iterator[AdminService]:
    store = make_store()
    runner = StoreRunner(store, max_workers=2)
    dropped: list[str] = []
    admin = AdminServicer(runner, server_info=ServerInfo(limits=LIMITS), on_drop=dropped.append)
    counts = CountsServicer(runner, max_push_rows=LIMITS.max_batch_rows, max_chunk_rows=LIMITS.max_chunk_rows)
    server = ServerThread([(admin_pb2_grpc.add_AdminServicer_to_server, admin),
                           (counts_pb2_grpc.add_CountsServicer_to_server, counts)]).start()
    channel = server.channel()
    svc = AdminService(store, admin_pb2_grpc.AdminStub(channel), counts_pb2_grpc.CountsStub(channel), dropped)
    yield svc
    for name in svc.names:
        store.drop_namespace(name)
    server.stop()
    runner.close()


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def reason(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(REASON)  # type: ignore[attr-defined]


def test_create_is_idempotent_for_the_same_tokenizer(service: AdminService) -> None:
    name = service.name()
    first = service.create(name, buckets=512)
    ns = first.namespace
    assert first.created
    assert (ns.name, ns.tokenizer_fingerprint, ns.vocab_size, ns.buckets) == (name, FP, VOCAB, 512)
    assert ns.shards >= 1 and ns.instance and ns.counts_version > 0 and ns.latest_generation == 0
    again = service.create(name, buckets=1024)  # buckets are ignored when it exists
    assert not again.created
    assert again.namespace.instance == ns.instance and again.namespace.buckets == 512
    info = service.store.namespace_info(name)
    assert (info.instance, info.fingerprint) == (ns.instance, FP.hex())


@pytest.mark.parametrize("other", [{"fingerprint": OTHER_FP}, {"vocab_size": VOCAB + 1}], ids=["fingerprint", "vocab"])
def test_create_with_another_tokenizer_is_failed_precondition(service: AdminService, other: dict[str, Any]) -> None:
    name = service.name()
    instance = service.create(name).namespace.instance
    err = rpc_error(lambda: service.create(name, **other))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and reason(err) == "TOKENIZER_MISMATCH"
    assert service.store.namespace_info(name).instance == instance


@pytest.mark.parametrize("bad", [
    {"name": "a b"}, {"name": ""}, {"name": "n" * 65}, {"fingerprint": b"short"}, {"fingerprint": b""},
    {"vocab_size": 0}, {"vocab_size": MAX_VOCAB + 1}, {"buckets": 3}, {"shards": 3}, {"buckets": 4, "shards": 8},
], ids=lambda bad: "-".join(f"{k}={v!r}"[:20] for k, v in bad.items()))
def test_create_refuses_malformed_fields(service: AdminService, bad: dict[str, Any]) -> None:
    fields = dict(bad)  # the parameter is shared by every backend's run
    name = fields.pop("name", None)
    name = service.name() if name is None else name
    err = rpc_error(lambda: service.create(name, **fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    if name and len(name) <= 64 and " " not in name:
        assert rpc_error(lambda: service.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name=name))).code() \
            == grpc.StatusCode.NOT_FOUND


def test_get_describes_the_namespace_and_its_counts_version(service: AdminService) -> None:
    name = service.name()
    created = service.create(name).namespace
    got = service.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name=name)).namespace
    assert (got.name, got.tokenizer_fingerprint, got.vocab_size, got.buckets, got.shards, got.instance) == \
        (created.name, created.tokenizer_fingerprint, created.vocab_size, created.buckets, created.shards,
         created.instance)
    assert got.counts_version >= created.counts_version


def test_get_of_an_unknown_namespace_is_not_found(service: AdminService) -> None:
    err = rpc_error(lambda: service.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name=service.name())))
    assert err.code() == grpc.StatusCode.NOT_FOUND and reason(err) == "NAMESPACE_NOT_FOUND"
    err = rpc_error(lambda: service.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name="a/b")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_list_pages_by_name(service: AdminService) -> None:
    tag = "a-" + uuid.uuid4().hex[:8]
    names = [f"{tag}-{i:02d}" for i in (7, 3, 11, 0, 5)]
    for name in names:
        service.names.append(name)
        service.create(name)
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = service.admin.ListNamespaces(admin_pb2.ListNamespacesRequest(page_size=2, page_token=token))
        assert len(page.namespaces) <= 2
        seen += [ns.name for ns in page.namespaces]
        pages += 1
        if not page.next_page_token:
            break
        assert page.next_page_token == page.namespaces[-1].name
        token = page.next_page_token
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    assert [n for n in seen if n.startswith(tag)] == sorted(names)
    assert pages >= 3
    everything = service.admin.ListNamespaces(admin_pb2.ListNamespacesRequest())  # page_size 0: up to 100
    mine = [ns for ns in everything.namespaces if ns.name.startswith(tag)]
    assert [ns.name for ns in mine] == sorted(names)
    assert all(ns.tokenizer_fingerprint == FP and ns.counts_version > 0 and ns.instance for ns in mine)
    big = service.admin.ListNamespaces(admin_pb2.ListNamespacesRequest(page_size=10**6))  # capped at 1000
    assert [ns.name for ns in big.namespaces] == [ns.name for ns in everything.namespaces]


def test_list_refuses_a_page_token_it_did_not_give(service: AdminService) -> None:
    err = rpc_error(lambda: service.admin.ListNamespaces(admin_pb2.ListNamespacesRequest(page_token="not a token!")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_drop_is_idempotent_and_ends_the_namespace(service: AdminService) -> None:
    name = service.name()
    service.create(name)
    service.counts.Push(counts_pb2.PushRequest(namespace=name, tokenizer_fingerprint=FP, client_id="c", seq=1,
                                               rows=delta_rows_to_bytes(batch([row([1], 2)]))))
    assert service.admin.DropNamespace(admin_pb2.DropNamespaceRequest(name=name)).existed
    assert not service.admin.DropNamespace(admin_pb2.DropNamespaceRequest(name=name)).existed
    assert service.dropped == [name, name]
    for call in (lambda: service.admin.GetNamespace(admin_pb2.GetNamespaceRequest(name=name)),
                 lambda: list(service.counts.Pull(counts_pb2.PullRequest(namespace=name, tokenizer_fingerprint=FP))),
                 lambda: service.counts.Push(counts_pb2.PushRequest(namespace=name, tokenizer_fingerprint=FP,
                                                                    client_id="c", seq=2))):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND and reason(err) == "NAMESPACE_NOT_FOUND"
    assert name not in {ns.name for ns in service.admin.ListNamespaces(admin_pb2.ListNamespacesRequest()).namespaces}
    recreated = service.create(name)
    assert recreated.created
    chunks = list(service.counts.Pull(counts_pb2.PullRequest(namespace=name, tokenizer_fingerprint=FP)))
    assert [c.rows for c in chunks] == [b""]
    err = rpc_error(lambda: service.admin.DropNamespace(admin_pb2.DropNamespaceRequest(name="*")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_server_info(service: AdminService, backend: str) -> None:
    info = service.admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
    assert info.version == ngramcache.__version__ and info.protocol == "ngramcache.v1"
    assert tuple(info.capabilities) == V1_CAPABILITIES
    assert info.counts_backend == {"embedded": "embedded", "standalone": "redis", "cluster": "redis-cluster"}[backend]
    assert not info.auth_required
    limits = info.limits
    config = service.store.config
    assert (limits.max_draft, limits.ngram_max, limits.max_vocab) == (MAX_DRAFT, NGRAM_MAX, MAX_VOCAB)
    assert limits.max_batch_rows == config.max_batch_rows  # LIMITS asked for more than the store takes
    assert limits.dedup_window == config.dedup_window
    assert (limits.max_message_bytes, limits.max_chunk_rows, limits.max_sessions, limits.max_static_file_bytes) == \
        (LIMITS.max_message_bytes, LIMITS.max_chunk_rows, LIMITS.max_sessions, LIMITS.max_static_file_bytes)
