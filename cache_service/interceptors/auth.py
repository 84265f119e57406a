"""Auth interceptor: every call but health and reflection needs a bearer token whose grant allows it.

A call carries the metadata ``authorization: Bearer <token>``. The token is hashed and
looked up in the `TokenTable` (`security.py`); `RULES` gives the role each RPC needs and
where its request names a namespace. Refusals raise `status.ServiceError` from inside the
call's handler, so this interceptor MUST sit inside the ErrorInterceptor, which maps them
(``aio.server(interceptors=[ErrorInterceptor(), AuthInterceptor(...)])``: grpc.aio runs
the first interceptor outermost). UNAUTHENTICATED: no token, a malformed header, an unknown
token. PERMISSION_DENIED: the token lacks the role, or the namespace.

The namespace lives in the request message: unary requests are checked before the
servicer runs; streamed requests (Publish's header, Session's ``open``) as the servicer
reads them, so it never receives a message naming a namespace the token may not use.
Tokens for every namespace (``"*"``) skip the per-message check. Logs name the grant
(or, for an unknown token, a prefix of its hash), never the token.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from ngramcache.client._proto.v1 import admin_pb2, counts_pb2, drafting_pb2, static_files_pb2

from ..security import Role, TokenGrant, TokenTable, load_tokens, token_sha256
from ..status import ServiceError

if TYPE_CHECKING:
    from ..config import ServiceConfig

log = logging.getLogger("ngramcache.service")

AUTHORIZATION = "authorization"
"""The metadata key of the bearer token (gRPC metadata keys are lowercase)."""

PUBLIC_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                             "grpc.reflection.v1.ServerReflection"})
"""Services any caller may use without a token."""


@dataclasses.dataclass(frozen=True)
class MethodRule:
    """What a call of one RPC needs.

    Attributes:
        role: the role needed; None for any valid token.
        namespace_of: the namespace a request message names (None for a message naming
            none, such as a Session step); None when the RPC names no namespace.
        every_namespace: only a token for every namespace may call it (ListNamespaces:
            a limited token would learn the other names; it knows its own).
    """

    role: Role | None
    namespace_of: Callable[[Any], str | None] | None
    every_namespace: bool = False


def _method(module: Any, service: str, rpc: str) -> str:
    # From the descriptors, so a renamed RPC fails at import instead of going unprotected.
    desc = module.DESCRIPTOR.services_by_name[service]
    return f"/{desc.full_name}/{desc.methods_by_name[rpc].name}"


def _field(name: str) -> Callable[[Any], str | None]:
    def namespace_of(request: Any) -> str | None:
        value: str = getattr(request, name)
        return value

    return namespace_of


def _first_of(kind: str) -> Callable[[Any], str | None]:
    def namespace_of(request: Any) -> str | None:
        if request.WhichOneof("kind") != kind:
            return None
        value: str = getattr(request, kind).namespace
        return value

    return namespace_of


RULES: dict[str, MethodRule] = {
    _method(drafting_pb2, "Drafting", "Session"): MethodRule(Role.DRAFT, _first_of("open")),
    _method(drafting_pb2, "Drafting", "Draft"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(counts_pb2, "Counts", "Push"): MethodRule(Role.PUSH, _field("namespace")),
    _method(counts_pb2, "Counts", "Pull"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(counts_pb2, "Counts", "PushHistory"): MethodRule(Role.PUSH, _field("namespace")),
    _method(counts_pb2, "Counts", "PullHistory"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(counts_pb2, "Counts", "SubscribeHistory"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(static_files_pb2, "StaticFiles", "List"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(static_files_pb2, "StaticFiles", "Fetch"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(static_files_pb2, "StaticFiles", "Watch"): MethodRule(Role.DRAFT, _field("namespace")),
    _method(static_files_pb2, "StaticFiles", "Publish"): MethodRule(Role.ADMIN, _first_of("header")),
    _method(admin_pb2, "Admin", "CreateNamespace"): MethodRule(Role.ADMIN, _field("name")),
    _method(admin_pb2, "Admin", "DropNamespace"): MethodRule(Role.ADMIN, _field("name")),
    _method(admin_pb2, "Admin", "StartRebuild"): MethodRule(Role.ADMIN, _field("namespace")),
    _method(admin_pb2, "Admin", "GetRebuildStatus"): MethodRule(None, _field("namespace")),
    # Any role: a pusher also needs the namespace's tokenizer and the server's limits.
    _method(admin_pb2, "Admin", "GetNamespace"): MethodRule(None, _field("name")),
    _method(admin_pb2, "Admin", "ListNamespaces"): MethodRule(None, None, every_namespace=True),
    _method(admin_pb2, "Admin", "GetServerInfo"): MethodRule(None, None),
}
"""The access rule of every RPC of ngramcache.v1; an RPC missing here is refused to every token."""


def _rpc_name(method: str) -> str:
    """'/ngramcache.v1.Counts/Push' -> 'Counts.Push'."""
    service, _, rpc = method.lstrip("/").partition("/")
    return f"{service.rsplit('.', 1)[-1]}.{rpc}"


def _unauthenticated(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, message)


def _denied(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message)


def bearer_token(metadata: Any) -> str:
    """The token of the call's ``authorization: Bearer <token>`` metadata; UNAUTHENTICATED if absent or malformed.

    Messages never include the metadata's value.
    """
    values = [value for key, value in (metadata or ()) if key == AUTHORIZATION]
    if not values:
        raise _unauthenticated("no bearer token: send the metadata `authorization: Bearer <token>`")
    if len(values) > 1:
        raise _unauthenticated("more than one `authorization` metadata entry")
    value = values[0]
    scheme, _, token = value.partition(" ") if isinstance(value, str) else ("", "", "")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        raise _unauthenticated("malformed `authorization` metadata: expected `Bearer <token>`")
    return token


class AuthInterceptor(aio.ServerInterceptor):
    """Lets a call through when its bearer token's grant allows it (module docstring).

    Thread-safety: stateless after construction; runs on the server's event loop.

    Args:
        tokens: the grants, keyed by token hash.
    """

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    @classmethod
    def from_config(cls, config: ServiceConfig) -> AuthInterceptor | None:
        """The interceptor for ``config.tokens_file``; None when it is unset (authentication off)."""
        if not config.tokens_file:
            return None
        tokens = load_tokens(config.tokens_file)
        log.info("bearer tokens required: %d token(s) from %s", len(tokens), config.tokens_file)
        return cls(tokens)

    def authorize(self, method: str, metadata: Any) -> tuple[TokenGrant, MethodRule]:
        """The grant and rule of a call, or ServiceError (UNAUTHENTICATED, PERMISSION_DENIED)."""
        token = bearer_token(metadata)
        grant = self._tokens.authenticate(token)
        if grant is None:
            raise _unauthenticated(f"unknown bearer token (sha256:{token_sha256(token)[:12]})")
        rule = RULES.get(method)
        if rule is None:
            raise _denied(f"{method} has no access rule on this server; refused to every token")
        if rule.role is not None and not grant.has_role(rule.role):
            held = ", ".join(sorted(r.value for r in grant.roles))
            raise _denied(f"token {grant.name!r} lacks the {rule.role.value} role that {_rpc_name(method)} needs "
                          f"(it has: {held})")
        if rule.every_namespace and grant.namespaces is not None:
            raise _denied(f"token {grant.name!r} is limited to some namespaces, so it may not list them all "
                          "(GetNamespace each of its own)")
        return grant, rule

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.lstrip("/").partition("/")[0] in PUBLIC_SERVICES:
            return handler
        try:
            grant, rule = self.authorize(method, handler_call_details.invocation_metadata)
        except ServiceError as refusal:
            return _replace(handler, _refusing(refusal, method), _refusing_stream(refusal, method))
        if rule.namespace_of is None or grant.namespaces is None:
            return handler  # nothing in the messages to check
        return _checking(handler, _NamespaceCheck(grant, rule.namespace_of, method))


def _log_refusal(refusal: ServiceError, method: str, context: aio.ServicerContext) -> None:
    log.warning("%s from %s refused: %s", _rpc_name(method), context.peer(), refusal)


def _refusing(refusal: ServiceError, method: str) -> Callable[..., Awaitable[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        _log_refusal(refusal, method, context)
        raise refusal

    return handler


def _refusing_stream(refusal: ServiceError, method: str) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        _log_refusal(refusal, method, context)
        raise refusal
        yield  # unreachable: makes this an async generator, as gRPC expects of a streaming handler

    return handler


@dataclasses.dataclass(frozen=True)
class _NamespaceCheck:
    grant: TokenGrant
    namespace_of: Callable[[Any], str | None]
    method: str

    def __call__(self, request: Any, context: aio.ServicerContext) -> None:
        namespace = self.namespace_of(request)
        if namespace is not None and not self.grant.may_use(namespace):
            refusal = _denied(f"token {self.grant.name!r} may not use namespace {namespace!r}")
            _log_refusal(refusal, self.method, context)
            raise refusal

    async def checked(self, requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
        """`requests`, each checked before the servicer gets it."""
        async for request in requests:
            self(request, context)
            yield request


def _checking(handler: grpc.RpcMethodHandler, check: _NamespaceCheck) -> grpc.RpcMethodHandler:
    """`handler` with every request message checked against the grant's namespaces."""
    if handler.request_streaming:
        fn = handler.stream_stream if handler.response_streaming else handler.stream_unary

        async def from_stream(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            return await fn(check.checked(requests, context), context)

        async def from_stream_streaming(requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in fn(check.checked(requests, context), context):
                yield response

        return _replace(handler, from_stream, from_stream_streaming)
    fn = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def from_unary(request: Any, context: aio.ServicerContext) -> Any:
        check(request, context)
        return await fn(request, context)

    async def from_unary_streaming(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        check(request, context)
        async for response in fn(request, context):
            yield response

    return _replace(handler, from_unary, from_unary_streaming)


def _replace(handler: grpc.RpcMethodHandler, unary_response: Callable[..., Awaitable[Any]],
             streaming_response: Callable[..., AsyncIterator[Any]]) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as `handler`, calling the function that fits its kind."""
    args = (handler.request_deserializer, handler.response_serializer)
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming_response, *args)
        return grpc.stream_unary_rpc_method_handler(unary_response, *args)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming_response, *args)
    return grpc.unary_unary_rpc_method_handler(unary_response, *args)


__all__ = ["AUTHORIZATION", "PUBLIC_SERVICES", "RULES", "AuthInterceptor", "MethodRule", "bearer_token"]
