"""The gRPC service: `create_server(config)` builds and starts it, `Service.stop` drains it.

One process serves the four ngramcache.v1 services (Drafting, Counts, StaticFiles, Admin),
standard health checking and reflection, on one grpc.aio server. It owns the counts store
(through one executor, `StoreRunner`), the static generations of its data dir
(`StaticStore`) and the per-namespace drafting state (`NamespaceRegistry`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import functools
import logging
import os
import secrets
import socket
import time
import urllib.parse
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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
from ngramcache.client.kernel.errors import BackendUnavailableError, LeaseHeldError, NamespaceNotFoundError, NgramCacheError
from ngramcache.client.kernel.retry import Backoff, retry

from .config import ServiceConfig
from .confinement import parse_roots
from .counts import CountsStore, open_counts_store, redact_url
from .counts.history import MAX_BATCH_RECORDS, MAX_RECORD_TOKENS
from .history_feed import ReplicaHistory
from .history_tail import HistoryTails, TailOptions
from .interceptors.auth import AuthInterceptor
from .interceptors.errors import ErrorInterceptor
from .interceptors.logging import LoggingInterceptor
from .interceptors.metrics import MetricsInterceptor, rpc_methods
from .metrics import Metrics, MetricsHttpServer, start_metrics_http_server
from .namespaces import NamespaceRegistry
from .peer_sync import PeerSync
from .rebuild import Rebuilder, RebuildOptions
from .security import read_tls_files
from .servicers.admin import AdminServicer, ServerInfo, ServerLimits
from .servicers.counts import CountsServicer
from .servicers.drafting import DraftingServicer
from .servicers.static_files import StaticFilesServicer
from .static_store import StaticStore
from .status import store_outage_message
from .store_runner import StoreRunner

log = logging.getLogger("ngramcache.service")

SERVICE_NAMES = tuple(
    pb.DESCRIPTOR.services_by_name[name].full_name
    for pb, name in ((drafting_pb2, "Drafting"), (counts_pb2, "Counts"), (static_files_pb2, "StaticFiles"),
                     (admin_pb2, "Admin"))
)

# A namespace name no one can create (names are [A-Za-z0-9_.-]{1,64}; this one is reserved
# only by convention): asking for it tells whether the store answers at all.
_PROBE_NAMESPACE = "ngramcache.health-probe"


class Service:
    """A running service: the grpc.aio server and everything it owns."""

    def __init__(self, config: ServiceConfig, server: aio.Server, runner: StoreRunner, static_store: StaticStore,
                 registry: NamespaceRegistry, health_servicer: health.aio.HealthServicer,
                 drafting: DraftingServicer) -> None:
        self.config = config
        self.server = server
        self.runner = runner
        self.static_store = static_store
        self.registry = registry
        self.health = health_servicer
        self.drafting = drafting
        self.port = 0
        self.metrics: Metrics | None = None
        self.counts: CountsServicer | None = None
        self.replica_history: ReplicaHistory | None = None
        self.rebuilder: Rebuilder | None = None
        self._schedule: asyncio.Task[None] | None = None
        self.metrics_http: MetricsHttpServer | None = None
        self.metrics_port = 0
        self._stopped = False
        self.store_ok: bool | None = None  # the last probe's verdict (None: not probed yet)
        self._probe: asyncio.Future[object] | None = None
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngc-store-probe")
        self._store_watch: asyncio.Task[None] | None = None
        self._mapping: asyncio.Task[None] | None = None  # `_map_generations`, in the background after SERVING

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def check_store(self, timeout: float = 5.0) -> bool:
        """True when the counts store answers within ``timeout`` seconds (an unknown namespace is an answer).

        The probe runs on a thread of its own, not the store runner's pool: pushes stuck in a
        store that stopped answering must not delay the verdict. A probe still running from
        before (a store that hangs) is waited for rather than doubled.
        """
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().run_in_executor(
                self._probe_pool, self.runner.store.namespace_info, _PROBE_NAMESPACE)
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
        except NamespaceNotFoundError:
            ok, why = True, ""
        except asyncio.TimeoutError:
            ok, why = False, f"no answer within {timeout:g} s"
        except NgramCacheError as e:
            ok, why = False, store_outage_message(str(e))
        else:
            ok, why = True, ""
        if ok != self.store_ok:
            if ok:
                if self.store_ok is False:  # not at the first probe: nothing was down
                    log.info("counts store %s answers again", redact_url(self.config.counts_url))
            else:
                log.warning("counts store %s unreachable: %s; health NOT_SERVING until it answers",
                            redact_url(self.config.counts_url), why)
        self.store_ok = ok
        if self.metrics is not None:
            self.metrics.store_available.set(1.0 if ok else 0.0)
        return ok

    async def stop(self, grace: float | None = None, *, quiet: bool = False) -> None:
        """Graceful stop: NOT_SERVING, refuse new calls, let in-flight ones finish within `grace`
        seconds, then close the namespaces and the store (the embedded one writes its snapshot).
        ``quiet``: no "stopped" line (a start that failed says why itself)."""
        if self._stopped:
            return
        self._stopped = True
        if self._store_watch is not None:
            self._store_watch.cancel()
        if self._mapping is not None:
            self._mapping.cancel()
        await self.set_serving(False)
        await self.server.stop(self.config.grace_period if grace is None else grace)
        if self.metrics_http is not None:
            self.metrics_http.close()
        if self._schedule is not None:
            self._schedule.cancel()
        if self.rebuilder is not None:
            await self.rebuilder.close()
        if self.counts is not None:
            await self.counts.batcher.close()  # pushes still grouping get their answer or UNAVAILABLE
            if self.replica_history is not None:
                await self.replica_history.close()
            if self.counts.history is not None:
                await self.counts.history.close()
        if self._mapping is not None:
            await asyncio.gather(self._mapping, return_exceptions=True)
        await self.registry.close()
        self._probe_pool.shutdown(wait=False)
        await asyncio.to_thread(self.runner.close)
        if not quiet:
            log.info("stopped")

    def start_mapping(self) -> None:
        """Opens the namespaces that have a published generation in the background (`_map_generations`), once."""
        if self._mapping is None and not self._stopped:
            self._mapping = asyncio.get_running_loop().create_task(_map_generations(self), name="map-generations")

    def start_schedule(self) -> None:
        """Rebuild every namespace every ``rebuild_every`` seconds (replicas race for each lease; one wins)."""
        if self.config.rebuild_every > 0 and self.rebuilder is not None and self._schedule is None:
            self._schedule = asyncio.create_task(self._rebuild_loop(self.rebuilder), name="rebuild-schedule")

    async def _rebuild_loop(self, rebuilder: Rebuilder) -> None:
        store = self.runner.store
        while True:
            await asyncio.sleep(self.config.rebuild_every)
            try:
                namespaces = await self.runner.call(store.list_namespaces)
            except NgramCacheError as e:
                log.warning("scheduled rebuilds: cannot list namespaces: %s", e)
                continue
            for info in namespaces:
                latest = self.static_store.latest(info.name)
                if latest is not None and time.time() - latest.created_unix_ms / 1000 < 0.9 * self.config.rebuild_every:
                    continue  # another replica rebuilt it this period (or a generation was just published)
                try:
                    task = await rebuilder.start(info.name, RebuildOptions(keep=self.config.keep_generations))
                    await task
                except (LeaseHeldError, NamespaceNotFoundError):
                    continue  # another replica rebuilds it, or it was dropped
                except NgramCacheError as e:
                    log.warning("scheduled rebuild of %s not started: %s", info.name, e)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def bind_failure(host: str, port: int, host_flag: str, port_flag: str, error: OSError | None = None) -> str:
    """One line saying why ``host:port`` cannot be listened on, naming the flags to change.

    gRPC says only "Failed to bind", so the cause is found by binding a plain socket to the same address:
    taken by another process, or not an address of this machine.
    """
    code = error.errno if error is not None else None
    if code is None:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host.strip("[]"), port))
        except OSError as e:
            code = e.errno
    where = f"{host}:{port}" if ":" not in host.strip("[]") else f"[{host.strip('[]')}]:{port}"
    if code == errno.EADDRINUSE:
        return (f"cannot listen on {where}: port {port} is in use by another process; choose another {port_flag} "
                f"({port_flag} 0 picks a free one)")
    if code == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {host} is not an address of this machine; change {host_flag}"
    if code in (errno.EACCES, errno.EPERM):
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges); change {port_flag}"
    reason = os.strerror(code).lower() if code else "the address is in use or not this machine's"
    return f"cannot listen on {where}: {reason}; change {host_flag} or {port_flag}"


async def create_server(config: ServiceConfig) -> tuple[Service, int]:
    """Builds, binds and starts the service; returns it and the port it listens on.

    Port 0 binds a free port (tests). Health is NOT_SERVING until the counts store answers, and
    again whenever a periodic probe finds it unreachable (``store_probe_interval``). The namespaces
    that have a published generation are opened after that, in the background (`_map_generations`).
    """
    data_dir = Path(config.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    store, config = await _open_store(config)
    metrics = Metrics()
    runner = StoreRunner(store, max_workers=config.store_threads, metrics=metrics)
    static_store = StaticStore(str(data_dir / "static"))
    peer_sync = PeerSync(runner, static_store, location=config.advertise_address or config.address(),
                         token=config.peer_token or None, tls_ca=_read_optional(config.peer_tls_ca),
                         keep=config.keep_generations)
    history = HistoryTails(runner, TailOptions(poll_interval=config.history_poll_interval,
                                               ring_bytes=config.history_tail_bytes,
                                               max_wait=config.history_max_wait_ms / 1000,
                                               max_answer_bytes=max(1 << 16, config.max_message_bytes // 2)),
                           metrics=metrics)
    replica_history = ReplicaHistory(history, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
                                     interval=config.history_poll_interval)
    registry = NamespaceRegistry(runner, static_store, mirror_interval=config.mirror_interval,
                                 max_sessions=config.max_sessions, session_memory=config.session_memory,
                                 view_policy=config.view_policy(), peer_sync=peer_sync,
                                 peer_interval=config.peer_sync_interval, on_match_drafter=replica_history.attach)
    metrics.watch_namespaces(registry.live)
    registry.start_fleet_scan()
    rebuilder = Rebuilder(runner, static_store, holder=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
                          location=config.advertise_address or config.address(), lease_ttl=config.rebuild_lease_seconds,
                          peer_sync=peer_sync, default_keep=config.keep_generations,
                          corpus_roots=parse_roots(config.corpus_root))
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if config.reuse_port else 0),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
    ]
    auth = AuthInterceptor.from_config(config)  # None: no tokens_file, every call allowed
    # grpc.aio runs the first interceptor outermost: the observers see the status a client gets
    # (including auth refusals), ErrorInterceptor maps what auth and the servicers raise.
    observers = [MetricsInterceptor(metrics, rpc_methods(*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)),
                 LoggingInterceptor(ok_level=logging.INFO if config.log_calls else logging.DEBUG)]
    server = aio.server(interceptors=[*observers, ErrorInterceptor(), *([auth] if auth else [])], options=options)
    drafting = DraftingServicer(registry, max_sessions=config.max_sessions, idle_timeout=config.session_idle_timeout,
                                max_sessions_per_client=config.max_sessions_per_client,
                                max_session_tokens=config.max_session_tokens, max_step_tokens=config.max_step_tokens,
                                max_draft_tokens=config.max_draft_tokens, metrics=metrics)
    drafting_pb2_grpc.add_DraftingServicer_to_server(drafting, server)
    counts = CountsServicer(runner, max_push_rows=config.max_push_rows, max_chunk_rows=config.max_chunk_rows,
                            metrics=metrics, push_batch_window_ms=config.push_batch_window_ms,
                            push_group_rows=config.push_group_rows or None, registry=registry,
                            push_queue_rows=config.push_queue_rows, history=history)
    counts_pb2_grpc.add_CountsServicer_to_server(counts, server)
    static_files_pb2_grpc.add_StaticFilesServicer_to_server(
        StaticFilesServicer(static_store, runner, max_file_bytes=config.max_file_bytes, rebuilder=rebuilder), server)
    limits = ServerLimits(
        max_message_bytes=config.max_message_bytes, max_draft_tokens=config.max_draft_tokens,
        max_step_tokens=config.max_step_tokens, max_session_tokens=config.max_session_tokens,
        max_sessions=config.max_sessions, max_batch_rows=counts.max_push_rows,
        max_chunk_rows=config.max_chunk_rows, max_static_file_bytes=config.max_file_bytes,
        max_history_records=MAX_BATCH_RECORDS, max_history_record_tokens=MAX_RECORD_TOKENS,
        max_history_wait_ms=config.history_max_wait_ms)

    async def on_drop(namespace: str) -> None:  # Admin.DropNamespace: forget its drafting state and files
        registry.drop(namespace)
        replica_history.detach(namespace)
        history.drop(namespace)
        await static_store.drop(namespace)

    admin_pb2_grpc.add_AdminServicer_to_server(
        AdminServicer(runner, server_info=ServerInfo(limits=limits, auth_required=auth is not None), on_drop=on_drop,
                      latest_generation=lambda ns: (g.generation if (g := static_store.latest(ns)) else 0),
                      rebuilder=rebuilder),
        server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    service = Service(config, server, runner, static_store, registry, health_servicer, drafting)
    service.counts = counts
    service.replica_history = replica_history
    service.rebuilder = rebuilder
    service.metrics = metrics
    try:
        await _start(service, metrics, peer_sync)
    except BaseException:  # a bind failure, or Ctrl-C (cancellation) mid-start: nothing left running
        await service.stop(0, quiet=True)
        raise
    log.info("serving ngramcache.v1 on %s:%d (pid %d), counts store %s, data dir %s", config.host, service.port,
             os.getpid(), redact_url(config.counts_url), data_dir.resolve())
    return service, service.port


async def _start(service: Service, metrics: Metrics, peer_sync: PeerSync) -> None:
    """Binds, starts the grpc server and the metrics endpoint, and begins following the store."""
    config, server, rebuilder = service.config, service.server, service.rebuilder
    assert rebuilder is not None
    try:
        credentials = server_credentials(config)  # None: plaintext (loopback, or allow_insecure_remote)
        port = (server.add_secure_port(config.address(), credentials) if credentials is not None
                else server.add_insecure_port(config.address()))
    except RuntimeError:  # grpc says only "Failed to bind"; the usual cause is another listener
        port = 0
    if port == 0:
        raise OSError(errno.EADDRINUSE, bind_failure(config.host, config.port, "--host", "--port"))
    # Uploads a crash left behind; an hour old at least, in case replicas share the folder.
    await asyncio.to_thread(service.static_store.remove_leftovers, 3600.0)
    metrics.watch_rebuilds(rebuilder, peer_sync)
    if not config.advertise_address:
        rebuilder.location = peer_sync.location = f"{config.host}:{port}"
    service.port = port
    if config.metrics_port >= 0:
        try:
            service.metrics_http, service.metrics_port = start_metrics_http_server(
                metrics, config.metrics_host, config.metrics_port)
        except OSError as e:
            raise OSError(e.errno, bind_failure(config.metrics_host, config.metrics_port, "--metrics-host",
                                                "--metrics-port", e)) from None
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, service.metrics_port)
    await service.set_serving(False)
    await server.start()
    if await service.check_store():
        await service.set_serving(True)
        service.start_mapping()
    service._store_watch = asyncio.get_running_loop().create_task(_follow_store(service), name="store-probe")
    service.start_schedule()


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """The credentials to listen with: TLS (mutual with ``tls_client_ca``), or None for plaintext.

    Logs what it chose; warns when bearer tokens would cross a non-loopback network in plaintext.
    """
    files = read_tls_files(config.tls_cert, config.tls_key, config.tls_client_ca)
    if files is None:
        if config.tokens_file and not config.is_loopback():
            log.warning("bearer tokens travel in plaintext to %s: configure tls_cert and tls_key", config.host)
        return None
    log.info("TLS on%s", ", client certificates required (mutual TLS)" if files.client_ca else "")
    return grpc.ssl_server_credentials([(files.key, files.cert)], root_certificates=files.client_ca,
                                       require_client_auth=files.client_ca is not None)


def _read_optional(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


async def _follow_store(service: Service) -> None:
    """Health follows the store: NOT_SERVING from the first probe that fails until one succeeds again
    (every ``store_probe_interval`` seconds); the first success also starts mapping the published generations."""
    interval = service.config.store_probe_interval
    serving = bool(service.store_ok)
    while not service._stopped:
        await asyncio.sleep(interval)
        ok = await service.check_store(timeout=max(2.0, 2 * interval))
        if service._stopped:
            return
        if ok and not serving:
            await service.set_serving(True)
            service.start_mapping()
        elif not ok and serving:
            await service.set_serving(False)
        serving = ok


async def _map_generations(service: Service) -> None:
    """Opens every namespace that has a published generation, one after another, so its file is mapped
    and its mirror filled before a client asks; a failure is logged, the namespace opens on use.

    It runs in the background once health says SERVING: opening every namespace (a full export of
    its counts each) takes long on a large store or a CPU-starved node, or waits on a builder that
    hangs, and a request for a namespace not open yet opens that one itself meanwhile."""
    started = time.monotonic()
    opened = 0
    for name in await asyncio.to_thread(service.static_store.namespaces):
        try:
            await service.registry.get(name)
            opened += 1
        except NgramCacheError as e:
            log.warning("namespace %s not opened at startup: %s", name, e)
        except Exception:  # a bug: logged, the namespace opens on use (nobody awaits this task)
            log.exception("namespace %s not opened at startup", name)
    if opened:
        log.info("%d namespace(s) with published generations opened in %.1f s", opened, time.monotonic() - started)


async def _open_store(config: ServiceConfig) -> tuple[CountsStore, ServiceConfig]:
    """Opens the counts store; while it is unreachable, serves only health (NOT_SERVING) on the
    service's address and retries with backoff. Returns the store and the config (with the port
    the interim server bound, when config.port was 0)."""
    try:
        return await asyncio.to_thread(open_counts_store, config.counts_url), config
    except BackendUnavailableError as e:
        log.warning("counts store %s unreachable (%s); serving health NOT_SERVING and retrying%s",
                    redact_url(config.counts_url), e, _redis_hint(config.counts_url))
    interim = aio.server(options=[("grpc.so_reuseport", 1 if config.reuse_port else 0)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, interim)
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    credentials = server_credentials(config)
    port = (interim.add_secure_port(config.address(), credentials) if credentials is not None
            else interim.add_insecure_port(config.address()))
    await interim.start()
    if config.port == 0:
        config = dataclasses.replace(config, port=port)
    backoff = Backoff(base=0.5, cap=10.0, jitter=0.0)  # 0.5, 1, 2, 4, 8, then every 10 s

    def unreachable(e: BackendUnavailableError, attempt: int) -> float:
        delay = backoff.delay(attempt + 1)
        log.warning("counts store still unreachable (%s); retrying in %.1f s", e, delay)
        return delay

    try:
        await asyncio.sleep(backoff.delay(0))
        store = await retry(functools.partial(asyncio.to_thread, open_counts_store, config.counts_url), unreachable,
                            errors=BackendUnavailableError)
    finally:
        await interim.stop(0)
    log.info("counts store %s reachable", redact_url(config.counts_url))
    return store, config


def _redis_hint(url: str) -> str:
    """How to start the Redis a loopback URL names, for a user trying a fleet on one machine ('' otherwise)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "rediss") or parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        return ""
    return (f" (is a Redis running there? on one machine: redis-server --port {parsed.port or 6379} --daemonize yes "
            "--appendonly yes; Debian's package: apt-get install redis-server)")


__all__ = ["SERVICE_NAMES", "Service", "create_server"]
