"""Bearer tokens on the whole service (create_server on loopback): every auth case, every RPC kind, and where the
auth interceptor sits. TLS and mutual TLS are in test_service_tls.py.

One service with a tokens file serves the auth tests; two namespaces, ``alpha`` and
``beta``, hold counts and a static generation. Tokens are named for their grant:
``all_alpha`` has every role on alpha only, ``draft_ab`` only draft on alpha and beta,
``push_all`` only push on every namespace, and so on (`TOKENS`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.auth import ALPHA, BETA, TOKENS, bearer, token, write_tokens_file
from helpers.rpc_calls import (
    ADMIN_CALLS,
    CALLS,
    DRAFT_CALLS,
    FP,
    TIMEOUT,
    VOCAB,
    Metadata,
    Stubs,
    call_create,
    call_drop,
    call_get,
    call_list,
    call_publish,
    call_pull,
    call_push,
    call_session,
    publish_requests,
    refused,
    static_file,
)
from helpers.service import ServerThread, ServiceThread

from ngramcache.cache_service.interceptors.auth import AuthInterceptor
from ngramcache.cache_service.interceptors.errors import ErrorInterceptor
from ngramcache.cache_service.security import TokenTable, parse_grant, token_sha256
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, drafting_pb2
from ngramcache.client.wire.codec import bytes_to_count_rows

pytestmark = pytest.mark.integration


def refused_call(rpc: str, stubs: Stubs, ns: str, token_name: str | None) -> grpc.RpcError:
    """The error of a call of `rpc` with the token named `token_name` (None: no token)."""
    return refused(lambda: CALLS[rpc](stubs, ns, bearer(token_name) if token_name else None))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceThread]:
    folder = tmp_path_factory.mktemp("auth")
    with ServiceThread(folder / "data", tokens_file=str(write_tokens_file(folder / "tokens.toml"))) as svc:
        channel = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        s = Stubs(channel, folder)
        admin = bearer("admin_all")
        for ns in (ALPHA, BETA):
            call_create(s, ns, admin)
            call_push(s, ns, admin)
            s.files.Publish(publish_requests(ns, static_file(folder, 1), 1), metadata=admin, timeout=TIMEOUT)
        channel.close()
        yield svc


@pytest.fixture
def stubs(service: ServiceThread, tmp_path: Path) -> Iterator[Stubs]:
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield Stubs(channel, tmp_path)
    channel.close()


@pytest.mark.parametrize("rpc", CALLS)
def test_no_token_is_unauthenticated(stubs: Stubs, rpc: str) -> None:
    err = refused(lambda: CALLS[rpc](stubs, ALPHA, None))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert "authorization: Bearer" in err.details()


@pytest.mark.parametrize("rpc", CALLS)
def test_unknown_token_is_unauthenticated(stubs: Stubs, rpc: str) -> None:
    secret = "not-a-configured-token-0123456789"
    err = refused(lambda: CALLS[rpc](stubs, ALPHA, (("authorization", f"Bearer {secret}"),)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown bearer token" in err.details() and secret not in err.details()


@pytest.mark.parametrize("metadata", [
    (("authorization", token("admin_all")),),  # no scheme
    (("authorization", f"Basic {token('admin_all')}"),),
    (("authorization", "Bearer"),),
    (("authorization", "Bearer    "),),
    (("authorization", f"Bearer {token('admin_all')} extra"),),
    (("authorization", f"Bearer {token('admin_all')}"), ("authorization", f"Bearer {token('admin_all')}")),
], ids=["no-scheme", "basic", "no-token", "blank-token", "two-words", "two-entries"])
@pytest.mark.parametrize("rpc", ["Draft", "Pull", "Session", "Publish"])
def test_malformed_authorization_is_unauthenticated(stubs: Stubs, rpc: str, metadata: Metadata) -> None:
    err = refused(lambda: CALLS[rpc](stubs, ALPHA, metadata))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert token("admin_all") not in err.details()


def test_scheme_is_case_insensitive(stubs: Stubs) -> None:
    call_get(stubs, ALPHA, (("authorization", f"bearer {token('draft_all')}"),))
    call_get(stubs, ALPHA, (("authorization", f"BEARER {token('draft_all')}"),))


@pytest.mark.parametrize("rpc", CALLS)
def test_a_token_for_alpha_is_refused_on_beta(stubs: Stubs, rpc: str) -> None:
    # all_alpha holds every role, so only the namespace can refuse it.
    err = refused(lambda: CALLS[rpc](stubs, BETA, bearer("all_alpha")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert err.details() == "token 'all_alpha' may not use namespace 'beta'"


@pytest.mark.parametrize("rpc", [name for name in CALLS if name != "DropNamespace"])
def test_a_token_for_alpha_works_on_alpha(stubs: Stubs, rpc: str) -> None:
    CALLS[rpc](stubs, ALPHA, bearer("all_alpha"))


def test_a_token_for_alpha_creates_and_drops_its_namespaces_only(stubs: Stubs) -> None:
    md = bearer("all_alpha")
    assert call_create(stubs, "alpha-tmp", md).created
    assert call_drop(stubs, "alpha-tmp", md).existed
    assert refused(lambda: call_create(stubs, "alpha-other", md)).code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("rpc", ["Push", *ADMIN_CALLS])
def test_a_draft_token_may_not_push_or_administer(stubs: Stubs, rpc: str) -> None:
    for name in ("draft_ab", "draft_all"):
        err = refused_call(rpc, stubs, ALPHA, name)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        role = "push" if rpc == "Push" else "admin"
        assert err.details().startswith(f"token '{name}' lacks the {role} role that ") and "(it has: draft)" in err.details()


@pytest.mark.parametrize("rpc", [*DRAFT_CALLS, *ADMIN_CALLS])
def test_a_push_token_may_only_push(stubs: Stubs, rpc: str) -> None:
    err = refused(lambda: CALLS[rpc](stubs, ALPHA, bearer("push_alpha")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "(it has: push)" in err.details()


@pytest.mark.parametrize("name", ["push_alpha", "push_all", "draft_ab", "all_alpha"])
def test_any_role_reads_its_namespaces_and_the_server_info(stubs: Stubs, name: str) -> None:
    assert call_get(stubs, ALPHA, bearer(name)).namespace.name == ALPHA
    info = stubs.admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer(name), timeout=TIMEOUT)
    assert info.protocol == "ngramcache.v1"


def test_push_works_with_a_push_token(stubs: Stubs) -> None:
    assert not call_push(stubs, ALPHA, bearer("push_alpha")).duplicate
    assert not call_push(stubs, BETA, bearer("push_all")).duplicate
    assert refused(lambda: call_push(stubs, BETA, bearer("push_alpha"))).code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("rpc", DRAFT_CALLS)
def test_star_namespaces_reach_every_namespace(stubs: Stubs, rpc: str) -> None:
    for ns in (ALPHA, BETA):
        DRAFT_CALLS[rpc](stubs, ns, bearer("draft_all"))
    # Past auth, the servicer answers for an unknown namespace.
    assert refused(lambda: call_get(stubs, "nowhere", bearer("draft_all"))).code() == grpc.StatusCode.NOT_FOUND


def test_an_admin_token_for_every_namespace_may_do_everything(stubs: Stubs) -> None:
    md = bearer("admin_all")
    name = "any-" + uuid.uuid4().hex[:8]
    assert call_create(stubs, name, md).created
    call_push(stubs, name, md)
    call_publish(stubs, name, md)
    for call in DRAFT_CALLS.values():
        call(stubs, name, md)
    assert call_drop(stubs, name, md).existed


def test_list_namespaces_needs_a_token_for_every_namespace(stubs: Stubs) -> None:
    request = admin_pb2.ListNamespacesRequest()
    listed = stubs.admin.ListNamespaces(request, metadata=bearer("draft_all"), timeout=TIMEOUT).namespaces
    assert {ALPHA, BETA} <= {ns.name for ns in listed}
    err = refused(lambda: stubs.admin.ListNamespaces(request, metadata=bearer("draft_ab"), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "may not list them all" in err.details()
    err = refused(lambda: stubs.admin.ListNamespaces(request, timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_server_info_needs_a_token(stubs: Stubs) -> None:
    err = refused(lambda: stubs.admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_server_info_says_auth_is_required(stubs: Stubs) -> None:
    info = stubs.admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer("push_all"), timeout=TIMEOUT)
    assert info.auth_required


def test_health_and_reflection_need_no_token(stubs: Stubs) -> None:
    health = health_pb2_grpc.HealthStub(stubs.channel)
    for service in ("", "ngramcache.v1.Counts"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(stubs.channel)
    replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=TIMEOUT))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "ngramcache.v1.Counts" in names and "grpc.health.v1.Health" in names


def test_a_session_naming_another_namespace_gets_no_answer(stubs: Stubs) -> None:
    responses: list[drafting_pb2.SessionResponse] = []

    def session() -> None:
        requests = iter([drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace=BETA, tokenizer_fingerprint=FP, vocab_size=VOCAB, n_draft=4))])
        responses.extend(stubs.drafting.Session(requests, metadata=bearer("all_alpha"), timeout=TIMEOUT))

    assert refused(session).code() == grpc.StatusCode.PERMISSION_DENIED
    assert responses == []  # not even `opened`


def test_refused_calls_change_nothing(service: ServiceThread, stubs: Stubs) -> None:
    admin = bearer("admin_all")

    def state() -> tuple[object, ...]:
        beta = call_get(stubs, BETA, admin).namespace
        rows = np.concatenate([bytes_to_count_rows(c.rows) for c in call_pull(stubs, BETA, admin)])
        generations = [g.generation for g in call_list(stubs, BETA, admin).generations]
        static_dir = Path(service.config.data_dir) / "static" / BETA
        names = ("gamma", "alpha-tmp")
        exist = [refused_call("GetNamespace", stubs, n, "admin_all").code() for n in names]
        # Not counts_version: the store's version also advances with its clock's epochs (a loaded machine crosses one
        # between the two reads); the rows themselves are compared.
        return beta.instance, rows.tolist(), generations, sorted(static_dir.iterdir()), exist

    before = state()
    for name, rpc in [("all_alpha", "Push"), ("draft_ab", "Push"), ("push_alpha", "Push"), ("all_alpha", "Publish"),
                      ("draft_ab", "Publish"), ("all_alpha", "DropNamespace"), ("draft_all", "DropNamespace"),
                      ("push_all", "DropNamespace"), (None, "Push"), (None, "Publish"), (None, "DropNamespace")]:
        refused_call(rpc, stubs, BETA, name)
    for name in ("draft_all", "push_all", None):
        refused_call("CreateNamespace", stubs, "gamma", name)
    refused_call("CreateNamespace", stubs, "alpha-tmp", "draft_ab")
    assert state() == before


def test_tokens_never_reach_logs_or_replies(stubs: Stubs, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ngramcache")
    details = []
    # Each refused at every call below: by namespace, by role, unknown, malformed.
    for md in [bearer("all_alpha"), bearer("push_alpha"), (("authorization", "Bearer unknown-token-0123456789abcdef"),),
               (("authorization", f"Basic {token('admin_all')}"),)]:
        for call in (call_push, call_publish, call_session, call_create):
            details.append(refused(functools.partial(call, stubs, BETA, md)).details())
    text = caplog.text + "\n".join(details)
    assert "refused" in caplog.text and "'all_alpha'" in caplog.text and "sha256:" in caplog.text
    for secret in [*(token(n) for n in TOKENS), "unknown-token-0123456789abcdef"]:
        assert secret not in text


def test_auth_is_off_without_a_tokens_file(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        channel = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        s = Stubs(channel, tmp_path)
        call_create(s, ALPHA, None)
        call_push(s, ALPHA, None)
        call_publish(s, ALPHA, (("authorization", "Bearer anything-at-all"),))
        info = s.admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
        assert not info.auth_required
        channel.close()


def test_the_library_says_to_pass_a_token_when_the_service_wants_one(service: ServiceThread) -> None:
    """UNAUTHENTICATED reached a library caller as a bare NgramCacheError with no word on what to change."""
    from ngramcache import AdminClient, NgramCacheError

    with AdminClient(f"127.0.0.1:{service.port}") as admin, pytest.raises(NgramCacheError) as e:
        admin.get_namespace(ALPHA)
    assert str(e.value).startswith("UNAUTHENTICATED: ")
    assert str(e.value).endswith("(the service requires a bearer token it knows: pass token=... to the client)")
    with AdminClient(f"127.0.0.1:{service.port}", token=token("draft_ab")) as admin, pytest.raises(NgramCacheError) as e:
        admin.drop_namespace(ALPHA)
    assert str(e.value).startswith("PERMISSION_DENIED: ")
    assert str(e.value).endswith("(the token lacks that role on that namespace: pass token=... with it)")


# -- the interceptor order --------------------------------------------------------------


class _InfoOnly(admin_pb2_grpc.AdminServicer):
    async def GetServerInfo(self, request: Any, context: Any) -> admin_pb2.GetServerInfoResponse:
        return admin_pb2.GetServerInfoResponse(protocol="x")


def test_auth_inside_the_error_interceptor_answers_its_codes() -> None:
    tokens = TokenTable([parse_grant({"sha256": token_sha256(token("x")), "namespaces": ["*"], "roles": ["draft"]}, "t")])
    # start_server puts its interceptors inside the ErrorInterceptor, as create_server does.
    with ServerThread([(admin_pb2_grpc.add_AdminServicer_to_server, _InfoOnly())],
                      interceptors=[AuthInterceptor(tokens)]) as server:
        stub = admin_pb2_grpc.AdminStub(server.channel())
        assert stub.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer("x"), timeout=TIMEOUT).protocol == "x"
        err = refused(lambda: stub.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=TIMEOUT))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED

    async def outside_first() -> grpc.StatusCode:
        # The first interceptor of grpc.aio is the outermost: with auth first, no one maps its refusals.
        server = aio.server(interceptors=[AuthInterceptor(tokens), ErrorInterceptor()])
        admin_pb2_grpc.add_AdminServicer_to_server(_InfoOnly(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await admin_pb2_grpc.AdminStub(channel).GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
                except aio.AioRpcError as e:
                    return e.code()
                raise AssertionError("the call passed without a token")
        finally:
            await server.stop(None)

    assert asyncio.run(outside_first()) == grpc.StatusCode.UNKNOWN
