"""Logging interceptor: one log line per finished call, never a metadata value or a payload.

Each line says the method, the final status code, the duration, the peer, the namespace the
request names (when it has one) and the ``ngc-error-reason`` of a failed call, in the text
and as `LOG_FIELDS` attributes of the record (``extra``), which a JSON formatter copies::

    rpc /ngramcache.v1.Drafting/Draft INVALID_ARGUMENT 0.412 ms peer=ipv4:127.0.0.1:50312 namespace=chat

Failed calls log at INFO, successful ones at DEBUG (both configurable), on the
``ngramcache.service.rpc`` logger. Place it before the ErrorInterceptor (`observing`
module docstring) so it logs the status the client receives. Values a client controls
(method, peer, namespace) are logged only when printable and short; a namespace only when
it is a valid name. Metadata (authorization), messages of errors and payloads never are.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import grpc
from google.protobuf.message import Message

from .observing import FinishedCall, ObservingInterceptor

LOG_FIELDS = ("grpc_method", "grpc_code", "duration_ms", "peer", "namespace", "reason")
"""Attributes the interceptor adds to each record (``extra``); None when unknown."""

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_REASON_RE = re.compile(r"[A-Z_]{1,64}")
_MAX_TEXT = 200


def _printable(text: str) -> str:
    text = text[:_MAX_TEXT]
    return text if text.isprintable() else repr(text)


def _namespace_field(message: Message) -> str | None:
    fields = message.DESCRIPTOR.fields_by_name
    name = "namespace" if "namespace" in fields else "name" if message.DESCRIPTOR.name.endswith("NamespaceRequest") else None
    if name is None or name not in fields or fields[name].type != fields[name].TYPE_STRING:
        return None
    value = getattr(message, name)
    return value if isinstance(value, str) and value else None


def namespace_of(request: object) -> str | None:
    """The namespace a request names (its ``namespace`` field, or that of its oneof's message:
    a Session's ``open``, a Publish's ``header``; an Admin request's ``name``), if a valid name."""
    if not isinstance(request, Message):
        return None
    value = _namespace_field(request)
    if value is None:
        for oneof in request.DESCRIPTOR.oneofs:
            which = request.WhichOneof(oneof.name)
            sub = getattr(request, which) if which else None
            if isinstance(sub, Message):
                value = _namespace_field(sub)
                break
    return value if value is not None and _NAMESPACE_RE.fullmatch(value) else None


class LoggingInterceptor(ObservingInterceptor):
    """Logs one line per finished call (see module docstring).

    Args:
        ok_level: the level of calls that end OK (DEBUG: only with the logger at DEBUG).
        error_level: the level of calls that end with any other code.
        logger: where to log; ``ngramcache.service.rpc`` by default.
    """

    observe_requests = True

    def __init__(self, *, ok_level: int = logging.DEBUG, error_level: int = logging.INFO,
                 logger: logging.Logger | None = None) -> None:
        self._ok_level = ok_level
        self._error_level = error_level
        self._log = logger if logger is not None else logging.getLogger("ngramcache.service.rpc")

    def finished(self, call: FinishedCall) -> None:
        level = self._ok_level if call.code == grpc.StatusCode.OK else self._error_level
        if not self._log.isEnabledFor(level):
            return
        method = _printable(call.method)
        peer = _printable(call.peer) if call.peer is not None else None
        namespace = namespace_of(call.request)
        reason = call.reason if call.reason is not None and _REASON_RE.fullmatch(call.reason) else None
        duration_ms = round(call.seconds * 1000, 3)
        fmt = "rpc %s %s %.3f ms peer=%s"
        args: list[Any] = [method, call.code.name, duration_ms, peer or "-"]
        if namespace is not None:
            fmt += " namespace=%s"
            args.append(namespace)
        if reason is not None:
            fmt += " reason=%s"
            args.append(reason)
        self._log.log(level, fmt, *args, extra={
            "grpc_method": method, "grpc_code": call.code.name, "duration_ms": duration_ms, "peer": peer,
            "namespace": namespace, "reason": reason})


__all__ = ["LOG_FIELDS", "LoggingInterceptor", "namespace_of"]
