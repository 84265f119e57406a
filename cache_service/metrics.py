"""Metrics: the service's Prometheus metrics, in a registry of their own, served on a separate HTTP port.

Every metric lives in the `CollectorRegistry` of one `Metrics` object, never in
prometheus_client's global default registry, so several servers (and tests) in one process
do not collide. Labels are bounded: ``method`` takes the server's RPC names, ``code`` the
gRPC status codes, ``op`` the counts store's methods, ``namespace`` the live namespaces
(read at scrape time, so a dropped namespace's series disappear). No token, client id,
peer or metadata value is ever a label.

Metrics (docs for each in its HELP text):

    ngramcache_rpc_total{method,code}          counter    calls ended, by final status
    ngramcache_rpc_seconds{method}             histogram  call latency (a stream: the whole call)
    ngramcache_sessions_active                 gauge      drafting sessions open now
    ngramcache_drafts_total                    counter    drafts made (session steps and Draft calls)
    ngramcache_drafted_tokens_total            counter    tokens proposed by those drafts
    ngramcache_pushed_rows_total               counter    delta rows of pushes applied
    ngramcache_duplicate_pushes_total          counter    pushes acknowledged as duplicates
    ngramcache_pushes_shed_total{reason}       counter    pushes answered OVERLOADED, nothing applied
    ngramcache_shed_rows_total                 counter    delta rows of those pushes
    ngramcache_history_pushed_records_total    counter    fleet history records stored by PushHistory (and match sessions)
    ngramcache_history_pushed_bytes_total      counter    their token bytes (4 a token)
    ngramcache_history_skipped_records_total   counter    near-duplicate prompts taken (likewise) and not stored
    ngramcache_history_skipped_bytes_total     counter    their token bytes
    ngramcache_history_duplicate_pushes_total  counter    PushHistory batches acknowledged as duplicates
    ngramcache_history_served_records_total    counter    fleet history records answered by PullHistory
    ngramcache_history_served_bytes_total      counter    their token bytes
    ngramcache_history_tail_lag_seconds        histogram  from the store taking a record to this replica's tail reading it
    ngramcache_store_available                 gauge      1 while the periodic store probe succeeds
    ngramcache_store_seconds{op}               histogram  counts store call latency
    ngramcache_store_errors_total{op}          counter    counts store calls that failed
    ngramcache_namespaces_live                 gauge      namespaces with drafting state
    ngramcache_mirror_lag_seconds{namespace}   gauge      since the last successful mirror refresh
    ngramcache_mirror_rows{namespace}          gauge      (n-gram, follower) rows in the mirror
    ngramcache_mirror_errors_total{namespace}  counter    failed mirror refreshes
    ngramcache_generation{namespace}           gauge      static generation drafted from (0: none)
    ngramcache_rebuilds_completed_total        counter    rebuilds this replica published
    ngramcache_rebuilds_failed_total           counter    rebuilds this replica started that published nothing
    ngramcache_rebuild_running{namespace}      gauge      1 while this replica rebuilds the namespace
    ngramcache_rebuild_last_seconds{namespace} gauge      how long its last rebuild of the namespace took
    ngramcache_peer_fetches_total              counter    generations installed from the replica that built them
    ngramcache_peer_fetches_refused_total      counter    transfers from peers refused (corrupt, truncated, unreachable)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ngramcache.client.kernel.errors import BackendUnavailableError, NgramCacheError

from .counts.history import BYTES_PER_TOKEN, HistoryAppend

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

RPC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
               1.0, 2.5, 5.0, 10.0)
"""Latency buckets in seconds, 50 us to 10 s (a draft takes tens of microseconds, a Pull seconds)."""

STORE_BUCKETS = RPC_BUCKETS

# Store calls given by the function object rather than a store method: named for what they do.
_STORE_OPS = {"next": "export_next", "_close": "export_close"}


class MirrorReading(Protocol):
    """What the metrics read of a namespace's mirror state (`namespaces.MirrorState`)."""

    @property
    def last_refresh(self) -> float: ...  # time.monotonic() of the last successful refresh

    @property
    def errors(self) -> int: ...


class TableReading(Protocol):
    """What the metrics read of a count table (`CountTable`)."""

    @property
    def n_entries(self) -> int: ...


class NamespaceReading(Protocol):
    """What the metrics read of a live namespace (`namespaces.LiveNamespace`), at scrape time."""

    @property
    def mirror(self) -> MirrorReading: ...

    @property
    def dynamic(self) -> TableReading: ...

    @property
    def generation(self) -> int: ...


class RebuildJobReading(Protocol):
    """What the metrics read of one namespace's rebuild (`rebuild.RebuildJob`)."""

    @property
    def namespace(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def started_unix_ms(self) -> int: ...

    @property
    def finished_unix_ms(self) -> int: ...


class RebuildReading(Protocol):
    """What the metrics read of the rebuilder (`rebuild.Rebuilder`), at scrape time."""

    @property
    def completed(self) -> int: ...

    @property
    def failed(self) -> int: ...

    def jobs(self) -> Iterable[RebuildJobReading]: ...


class PeerFetchReading(Protocol):
    """What the metrics read of the peer sync (`peer_sync.PeerSync`), at scrape time."""

    @property
    def fetched(self) -> int: ...

    @property
    def refused(self) -> int: ...


def store_op(fn: Callable[..., object]) -> str:
    """The ``op`` label of a `StoreRunner.call` of `fn`: the store method's name (a bounded set)."""
    name = getattr(fn, "__name__", "other")
    return _STORE_OPS.get(name, name) if name.isidentifier() else "other"


def is_store_failure(exc: BaseException) -> bool:
    """True when a store call's exception means the store failed (unreachable, refused us, a bug),
    not that it answered (no such namespace, a bad argument, a tokenizer mismatch, too old a version)."""
    return isinstance(exc, BackendUnavailableError) or not isinstance(exc, NgramCacheError)


class Metrics:
    """The service's metrics (see module docstring) and the methods the service's parts update them with.

    Thread-safety: every method may be called from any thread (prometheus_client metrics
    are thread-safe); callbacks given to `watch_sessions` / `watch_namespaces` run on the
    HTTP server's threads at scrape time, so they must only read.

    Args:
        registry: the registry to create the metrics in; a new one by default (never the
            process-wide default registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.rpc_total = Counter("ngramcache_rpc_total", "RPCs ended, by full method name and final gRPC status code.",
                                 ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("ngramcache_rpc_seconds", "RPC latency in seconds (a stream: the whole call).",
                                     ["method"], buckets=RPC_BUCKETS, registry=r)
        self.sessions_active = Gauge("ngramcache_sessions_active", "Drafting sessions open now.", registry=r)
        self.drafts = Counter("ngramcache_drafts", "Drafts made (Session steps and Draft calls).", registry=r)
        self.drafted_tokens = Counter("ngramcache_drafted_tokens", "Tokens proposed by drafts.", registry=r)
        self.pushed_rows = Counter("ngramcache_pushed_rows", "Delta rows of Push batches applied (duplicates excluded).",
                                   registry=r)
        self.duplicate_pushes = Counter("ngramcache_duplicate_pushes",
                                        "Push batches acknowledged as duplicates (a retry of an applied batch).",
                                        registry=r)
        self.pushes_shed = Counter("ngramcache_pushes_shed",
                                   "Push batches answered RESOURCE_EXHAUSTED/OVERLOADED, nothing of them applied, "
                                   "by reason: queue_full (the namespace's push queue was full) or deadline (the "
                                   "batch could not reach the store before its caller's deadline).", ["reason"],
                                   registry=r)
        self.shed_rows = Counter("ngramcache_shed_rows", "Delta rows of the Push batches shed (their senders retry them).",
                                 registry=r)
        self.history_pushed_records = Counter("ngramcache_history_pushed_records",
                                              "Fleet history records PushHistory stored (duplicates and near-duplicate "
                                              "prompts excluded).", registry=r)
        self.history_pushed_bytes = Counter("ngramcache_history_pushed_bytes",
                                            "Token bytes (4 a token) of the fleet history records PushHistory stored.",
                                            registry=r)
        self.history_skipped_records = Counter("ngramcache_history_skipped_records",
                                               "Fleet history records PushHistory took but did not store: near-"
                                               "duplicate prompts (a sibling's equal prompt was stored in the last "
                                               "10 s). Records taken = pushed + skipped.", registry=r)
        self.history_skipped_bytes = Counter("ngramcache_history_skipped_bytes",
                                             "Token bytes (4 a token) of the near-duplicate prompts PushHistory did "
                                             "not store.", registry=r)
        self.history_duplicate_pushes = Counter("ngramcache_history_duplicate_pushes",
                                                "PushHistory batches acknowledged as duplicates (a retry of a stored "
                                                "batch).", registry=r)
        self.history_served_records = Counter("ngramcache_history_served_records",
                                              "Fleet history records PullHistory answered.", registry=r)
        self.history_served_bytes = Counter("ngramcache_history_served_bytes",
                                            "Token bytes (4 a token) of the fleet history records PullHistory answered.",
                                            registry=r)
        self.history_tail_lag = Histogram("ngramcache_history_tail_lag_seconds",
                                          "Seconds from the counts store taking a fleet history record to this "
                                          "replica's tail reading it (clocks of the store and the replica).",
                                          buckets=RPC_BUCKETS, registry=r)
        self.store_available = Gauge("ngramcache_store_available",
                                     "1 while the periodic counts store probe succeeds, 0 during an outage (health "
                                     "is NOT_SERVING then).", registry=r)
        self.store_seconds = Histogram("ngramcache_store_seconds",
                                       "Counts store call latency in seconds, queueing for a store thread included.",
                                       ["op"], buckets=STORE_BUCKETS, registry=r)
        self.store_errors = Counter("ngramcache_store_errors",
                                    "Counts store calls that failed (unreachable, refused, unexpected error); "
                                    "answers such as an unknown namespace are not errors.", ["op"], registry=r)
        # Children by label values: labels() costs a lock and a lookup per call.
        self._rpc_children: dict[tuple[str, str], Counter] = {}
        self._rpc_seconds_children: dict[str, Histogram] = {}
        self._watching_namespaces = False

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """One RPC ended with status `code` (a grpc.StatusCode name) after `seconds`."""
        key = (method, code)
        counter = self._rpc_children.get(key)
        if counter is None:
            counter = self._rpc_children[key] = self.rpc_total.labels(method, code)
        counter.inc()
        histogram = self._rpc_seconds_children.get(method)
        if histogram is None:
            histogram = self._rpc_seconds_children[method] = self.rpc_seconds.labels(method)
        histogram.observe(seconds)

    def drafted(self, tokens: int) -> None:
        """One draft proposed `tokens` tokens (0 counts: a draft with nothing to propose)."""
        self.drafts.inc()
        if tokens:
            self.drafted_tokens.inc(tokens)

    def pushed(self, rows: int, *, duplicate: bool) -> None:
        """A Push of `rows` delta rows was acknowledged (applied, or a duplicate of an applied one)."""
        if duplicate:
            self.duplicate_pushes.inc()
        else:
            self.pushed_rows.inc(rows)

    def history_pushed(self, done: HistoryAppend) -> None:
        """A PushHistory batch was stored (its records stored and near-duplicates skipped) or was a duplicate."""
        if not done.stored:
            self.history_duplicate_pushes.inc()
            return
        self.history_pushed_records.inc(done.records)
        self.history_pushed_bytes.inc(done.tokens * BYTES_PER_TOKEN)
        self.history_skipped_records.inc(done.skipped_records)
        self.history_skipped_bytes.inc(done.skipped_tokens * BYTES_PER_TOKEN)

    def history_served(self, records: int, nbytes: int) -> None:
        """A PullHistory answered `records` records of `nbytes` token bytes."""
        if records:
            self.history_served_records.inc(records)
            self.history_served_bytes.inc(nbytes)

    def push_shed(self, reason: str, rows: int) -> None:
        """A Push of `rows` rows was shed for `reason` (one of push_admission.SHED_REASONS)."""
        self.pushes_shed.labels(reason).inc()
        self.shed_rows.inc(rows)

    def observe_store(self, op: str, seconds: float, error: BaseException | None = None) -> None:
        """One counts store call `op` ended after `seconds`, raising `error` (None: it returned)."""
        self.store_seconds.labels(op).observe(seconds)
        if error is not None and is_store_failure(error):
            self.store_errors.labels(op).inc()

    def time_store(self, fn: Callable[..., object]) -> StoreTimer:
        """A context manager timing one store call of `fn` (`StoreRunner.call` uses it)."""
        return StoreTimer(self, store_op(fn))

    def watch_sessions(self, active: Callable[[], int]) -> None:
        """Report ``active()`` as ngramcache_sessions_active at every scrape."""
        self.sessions_active.set_function(lambda: float(active()))

    def watch_namespaces(self, live: Callable[[], Mapping[str, NamespaceReading]]) -> None:
        """Report the mirror lag, rows, errors and generation of the namespaces ``live()`` returns
        (`NamespaceRegistry.live`) at every scrape. Call once."""
        if self._watching_namespaces:
            raise RuntimeError("watch_namespaces was already called on this Metrics")
        self._watching_namespaces = True
        self.registry.register(_NamespaceCollector(live))


    def watch_rebuilds(self, rebuilder: RebuildReading, peers: PeerFetchReading | None = None) -> None:
        """Report rebuilds (completed, failed, running, last duration) and peer fetches at every scrape. Call once."""
        self.registry.register(_RebuildCollector(rebuilder, peers))


class StoreTimer:
    """Times one counts store call; a cancelled call is not observed (it has no latency)."""

    __slots__ = ("_metrics", "_op", "_start")

    def __init__(self, metrics: Metrics, op: str) -> None:
        self._metrics = metrics
        self._op = op
        self._start = 0.0

    def __enter__(self) -> StoreTimer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None or isinstance(exc, Exception):
            self._metrics.observe_store(self._op, time.perf_counter() - self._start, exc)


class _NamespaceCollector(Collector):
    """Reads the live namespaces at scrape time (from the HTTP server's thread: reads only)."""

    def __init__(self, live: Callable[[], Mapping[str, NamespaceReading]]) -> None:
        self._live = live

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        count, lag, rows, errors, generation = families = self._families()
        now = time.monotonic()
        live = self._live()  # a copy (NamespaceRegistry.live): the loop may change the registry meanwhile
        count.add_metric([], len(live))
        for name, ns in sorted(live.items()):
            lag.add_metric([name], max(0.0, now - ns.mirror.last_refresh))
            rows.add_metric([name], ns.dynamic.n_entries)
            errors.add_metric([name], ns.mirror.errors)
            generation.add_metric([name], ns.generation)
        return families

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                             GaugeMetricFamily]:
        return (
            GaugeMetricFamily("ngramcache_namespaces_live", "Namespaces with drafting state in this process."),
            GaugeMetricFamily("ngramcache_mirror_lag_seconds",
                              "Seconds since the namespace's dynamic mirror was last refreshed successfully.",
                              labels=["namespace"]),
            GaugeMetricFamily("ngramcache_mirror_rows", "(n-gram, follower) rows in the namespace's dynamic mirror.",
                              labels=["namespace"]),
            CounterMetricFamily("ngramcache_mirror_errors", "Failed refreshes of the namespace's dynamic mirror.",
                                labels=["namespace"]),
            GaugeMetricFamily("ngramcache_generation", "The static generation the namespace drafts from (0: none).",
                              labels=["namespace"]),
        )


class _RebuildCollector(Collector):
    """Reads the rebuilder's counters at scrape time."""

    def __init__(self, rebuilder: RebuildReading, peers: PeerFetchReading | None) -> None:
        self._rebuilder = rebuilder
        self._peers = peers

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        done, failed, running, seconds, fetched, refused = families = self._families()
        done.add_metric([], self._rebuilder.completed)
        failed.add_metric([], self._rebuilder.failed)
        for job in self._rebuilder.jobs():
            running.add_metric([job.namespace], 1.0 if job.state == "running" else 0.0)
            if job.finished_unix_ms:
                seconds.add_metric([job.namespace], (job.finished_unix_ms - job.started_unix_ms) / 1000)
        if self._peers is not None:
            fetched.add_metric([], self._peers.fetched)
            refused.add_metric([], self._peers.refused)
        return families

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily,
                             CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily("ngramcache_rebuilds_completed", "Rebuilds this replica published."),
            CounterMetricFamily("ngramcache_rebuilds_failed", "Rebuilds this replica started that published nothing."),
            GaugeMetricFamily("ngramcache_rebuild_running", "1 while this replica rebuilds the namespace.",
                              labels=["namespace"]),
            GaugeMetricFamily("ngramcache_rebuild_last_seconds", "How long this replica's last rebuild of the "
                              "namespace took.", labels=["namespace"]),
            CounterMetricFamily("ngramcache_peer_fetches", "Generations installed from the replica that built them."),
            CounterMetricFamily("ngramcache_peer_fetches_refused", "Transfers from peers refused (corrupt, truncated, "
                                "unreachable)."),
        )


class MetricsHttpServer:
    """The HTTP server of `start_metrics_http_server`: serves ``/metrics`` from a daemon thread.

    Thread-safety: `close` may be called from any thread, once or more.
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        """Stops serving and releases the port."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()


def start_metrics_http_server(metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> tuple[MetricsHttpServer, int]:
    """Serves `metrics` in the Prometheus text format on ``http://host:port/metrics``, in a daemon thread.

    The endpoint has no authentication: keep it on loopback (the default) or a private network.

    Args:
        metrics: the metrics to serve (their registry only).
        host: the address to listen on.
        port: the TCP port; 0 picks a free one.

    Returns:
        (the server, the port it listens on). Stop it with ``server.close()``.

    Raises:
        OSError: the address cannot be bound (in use, or not this machine's).
    """
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    http = MetricsHttpServer(server, thread)
    return http, http.port


__all__ = ["RPC_BUCKETS", "Metrics", "MetricsHttpServer", "MirrorReading", "NamespaceReading", "PeerFetchReading",
           "RebuildJobReading", "RebuildReading", "StoreTimer", "TableReading", "is_store_failure",
           "start_metrics_http_server", "store_op"]
