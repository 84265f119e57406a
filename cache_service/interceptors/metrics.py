"""Metrics interceptor: counts every call with its final status code and observes its latency.

One ``ngramcache_rpc_total{method,code}`` increment and one ``ngramcache_rpc_seconds{method}``
observation per call, at its end, for all four kinds of RPC (a stream's latency is the
whole call's). Place it first, before the ErrorInterceptor (`observing` module docstring),
so it counts the status the client receives, refusals of later interceptors included.

The ``method`` label is bounded: with ``methods`` given (`rpc_methods` of the services the
server registers) any other name is counted as ``other``; without, at most `MAX_METHODS`
distinct names are labelled, the rest ``other``. A method no handler serves is ``other``.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import descriptor_pool

from ..metrics import Metrics
from .observing import FinishedCall, ObservingInterceptor

OTHER = "other"
MAX_METHODS = 256


def rpc_methods(*service_names: str) -> frozenset[str]:
    """Full method names ("/pkg.Service/Method") of services whose descriptors are loaded (their _pb2 imported).

    Raises:
        KeyError: a service not in the default descriptor pool.
    """
    pool = descriptor_pool.Default()
    return frozenset(f"/{service}/{m.name}" for service in service_names
                     for m in pool.FindServiceByName(service).methods)


class MetricsInterceptor(ObservingInterceptor):
    """Updates `Metrics` at the end of every call (see module docstring).

    Args:
        metrics: the metrics to update.
        methods: the method names to label (`rpc_methods`); None: the first `MAX_METHODS`
            names seen with a handler.
    """

    def __init__(self, metrics: Metrics, methods: Iterable[str] | None = None) -> None:
        self._metrics = metrics
        self._methods = frozenset(methods) if methods is not None else None
        self._seen: set[str] = set()

    def _label(self, call: FinishedCall) -> str:
        if not call.handled:  # no handler: whatever the client sent
            return OTHER
        if self._methods is not None:
            return call.method if call.method in self._methods else OTHER
        if call.method in self._seen:
            return call.method
        if len(self._seen) < MAX_METHODS:
            self._seen.add(call.method)
            return call.method
        return OTHER

    def finished(self, call: FinishedCall) -> None:
        self._metrics.observe_rpc(self._label(call), call.code.name, call.seconds)


__all__ = ["MAX_METHODS", "OTHER", "MetricsInterceptor", "rpc_methods"]
