"""The `ngramcache` command with the service's subcommands (`serve`, `rebuild`, `token-hash`) added to the client's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import getpass
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError
from ngramcache.client.tools import cli as client_cli

from .admin_commands import add_namespace, add_publish, add_rebuild
from .config import ENV_PREFIX, ServiceConfig
from .interceptors.logging import LOG_FIELDS
from .security import ALL_NAMESPACES, MIN_TOKEN_CHARS, Role, new_token, token_sha256, token_toml

_HELP = {
    "host": "address to listen on (default 127.0.0.1; a non-loopback address needs TLS or --allow-insecure-remote)",
    "port": "TCP port (default 50051; 0 picks a free one and prints it)",
    "data_dir": "folder for static generations and the embedded counts store's snapshot (default ./ngramcache-data)",
    "counts": "counts store URL: redis://HOST:PORT[/DB], rediss://..., redis+cluster://H:P[,H:P], "
              "redis+sentinel://H:P[,H:P]/MASTER-NAME[/DB], embedded://PATH (default: embedded, snapshotted in "
              "--data-dir)",
    "counts_min_replicas": "Redis replicas that must hold a pushed batch of counts or history before the push is "
                           "acknowledged (WAIT; a push that reaches fewer in time fails, retriable); generation "
                           "numbers and leases always wait for every connected replica (default 0: the master's "
                           "answer suffices, and a failover may lose the last acknowledged pushes)",
    "allow_insecure_remote": "allow plaintext gRPC on a non-loopback address (default off)",
    "tls_cert": "PEM certificate (chain) of the server; with --tls-key, serve TLS (default: plaintext)",
    "tls_key": "PEM private key of --tls-cert, unencrypted (default: none)",
    "tls_client_ca": "PEM CA certificates; clients must present a certificate they signed: mutual TLS (default: none)",
    "tokens_file": "TOML file of bearer token hashes with their roles and namespaces (`ngramcache token-hash` "
                   "writes entries; default: none, every call allowed)",
    "max_sessions": "drafting sessions open at once (default 10000)",
    "max_sessions_per_client": "sessions one client may hold at once: per bearer token, or per address when no "
                               "tokens are configured (default 1000)",
    "max_streams_per_connection": "concurrent calls on one HTTP/2 connection (default 100)",
    "session_idle_timeout": "seconds without a step before a session is closed (default 300)",
    "max_session_tokens": "most tokens of one session's sequence (default 1048576)",
    "max_step_tokens": "most tokens one session step may carry (default 65536)",
    "max_draft_tokens": "most tokens of a one-shot Draft request (default 65536)",
    "session_memory": "bytes of session context tables per namespace; least recently used are evicted beyond "
                      "(default 1 GiB)",
    "max_push_rows": "most rows in one pushed batch (default 1048576)",
    "max_chunk_rows": "most rows in one Pull chunk (default 65536)",
    "push_batch_window_ms": "milliseconds a group of concurrent pushes waits for more before it goes to the store "
                            "(default 0: it goes as soon as the store is free)",
    "push_group_rows": "most rows summed into one store unit from concurrent pushes (default 0: the store's "
                       "max_batch_rows)",
    "push_queue_rows": "most rows of pushes waiting for the counts store per namespace; a push over it is answered "
                       "RESOURCE_EXHAUSTED/OVERLOADED with a retry-after, nothing applied (default 262144)",
    "store_probe_interval": "seconds between two checks that the counts store answers; health is NOT_SERVING "
                            "while it does not (default 1)",
    "mirror_interval": "seconds between two refreshes of a namespace's dynamic mirror and draft view (default 0.25)",
    "history_poll_interval": "seconds between two counts store reads of a namespace's fleet history tail while "
                             "clients pull it (a push through the replica reads at once; default 0.05)",
    "history_tail_bytes": "bytes of the newest fleet history records a replica keeps in memory per namespace, "
                          "answering pulls without the store (default 8 MiB)",
    "history_max_wait_ms": "longest PullHistory long poll in milliseconds; longer waits are capped (default 5000)",
    "view_top_k": "followers per n-gram in the draft view clients mirror (default 8)",
    "view_min_change_pct": "a count in the draft view is republished when it moves by more than this percent "
                           "(default 25; 0: on every change)",
    "view_max_rows": "most rows of the draft view (a client's mirror); over it, the view's key minimum doubles "
                     "(default 2000000)",
    "view_max_rows_per_second": "most rows the draft view logs per second, i.e. what each client pulls; over it, "
                                "the view's key minimum doubles (default 20000, 1.1 MB/s)",
    "keep_generations": "generations each replica keeps per namespace, the newest one included: what a rebuild "
                        "keeps unless it says otherwise, and what a replica keeps after fetching one (default 3)",
    "corpus_root": "folders (separated by ':') whose token files a rebuild request may name with --corpus; a path "
                   "outside them is refused (default: none, so rebuilds read only the store's counts; docs/security.md)",
    "rebuild_every": "seconds between scheduled rebuilds of every namespace; replicas race for each namespace's "
                     "lease and one wins (default 0: only `ngramcache rebuild` / Admin.StartRebuild)",
    "rebuild_lease_seconds": "seconds a rebuild's lease lasts unless renewed (it is renewed every third of it; "
                             "a replica that stalls longer is fenced off) (default 30)",
    "advertise_address": "host:port other replicas reach this one at, recorded with the generations it builds "
                         "(default: the address it listens on)",
    "peer_sync_interval": "seconds between two checks for a generation another replica built, fetched from it "
                          "(default 1)",
    "peer_token": "bearer token (draft role) this replica fetches other replicas' generations with (default: none)",
    "peer_tls_ca": "PEM file of the CA certificates to reach other replicas with TLS (default: plaintext)",
    "max_message_bytes": "largest gRPC message in either direction, bytes (default 64 MiB)",
    "max_file_bytes": "largest static file a Publish may upload, bytes (default 16 GiB)",
    "grace_period": "seconds in-flight calls get to finish on SIGTERM (default 10)",
    "store_threads": "threads calling the counts store at once (default 8)",
    "metrics_host": "address of the Prometheus /metrics endpoint; it has no authentication (default 127.0.0.1)",
    "metrics_port": "port of the /metrics endpoint (default -1: off; 0 picks a free one and logs it; with --workers N, "
                    "worker i serves it on port + i)",
    "log_calls": "log every call at INFO, not only failed ones (default off)",
    "workers": "server processes sharing the port (SO_REUSEPORT), all mapping the same generation files; more "
               "than 1 needs a shared counts store, --counts redis://... (default 1)",
    "reuse_port": "share the port with other processes (what --workers sets for its workers; default off)",
}


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="run the gRPC service",
        description="Runs the ngramcache.v1 gRPC service (Drafting, Counts, StaticFiles, Admin, health, "
        "reflection). With no options: an embedded counts store snapshotted under ./ngramcache-data, on "
        "127.0.0.1:50051. Every option may also come from a TOML --config file (same names, underscores) or "
        f"an {ENV_PREFIX}<NAME> environment variable ({ENV_PREFIX}PORT=50052); flags win over variables, "
        f"variables over the file; an {ENV_PREFIX}* variable nothing reads is refused, like an unknown key of the "
        "file. SIGTERM or Ctrl-C stops gracefully: health turns NOT_SERVING, in-flight "
        "calls get --grace-period seconds, the embedded store writes its snapshot.")
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (default: none)")
    for f in dataclasses.fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=_HELP[f.name])
        else:
            kind = type(f.default) if f.default is not None else str
            p.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=_HELP[f.name])
    p.add_argument("--log-json", action="store_true",
                   help="log one JSON object per line, times in ISO 8601 UTC (default: plain text)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="the least severe messages logged: debug adds every successful call (default info)")
    p.set_defaults(func=cmd_serve)


LOG_LEVELS = ("debug", "info", "warning", "error")


def iso_utc(seconds: float) -> str:
    """A Unix time as ISO 8601 in UTC with milliseconds: 2026-12-04T19:00:36.455Z."""
    whole = int(seconds)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((seconds - whole) * 1000):03d}Z"


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601 UTC), level, logger, message and the per-call fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {"time": iso_utc(record.created), "level": record.levelname, "logger": record.name,
                                    "message": record.getMessage()}
        # Only the named per-call fields, never the whole record (no payload, no metadata).
        entry.update({k: v for k in LOG_FIELDS if (v := getattr(record, k, None)) is not None})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _Announcer:
    """The lines `serve` prints itself (listening, draining, stopped): plain, or under --log-json one JSON object
    like the log's, so that every line a JSON-logging server writes parses."""

    def __init__(self, log_json: bool) -> None:
        self.log_json = log_json

    def __call__(self, message: str, *, stdout: bool = False, level: str = "INFO", exception: str | None = None) -> None:
        if self.log_json:
            entry = {"time": iso_utc(time.time()), "level": level, "logger": "ngramcache.serve", "message": message}
            message = json.dumps({**entry, "exception": exception} if exception else entry)
        # One write for the line and its newline: the workers of `serve --workers N` share the parent's stderr,
        # which is unbuffered, and print() writes the newline apart, so two workers' lines could run together.
        stream = sys.stdout if stdout else sys.stderr
        stream.write(message + "\n")
        stream.flush()


def _setup_logging(args: argparse.Namespace) -> None:
    """Every record to stderr (ngramcache's at --log-level, other libraries' from WARNING), Python warnings too."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if args.log_json else logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    level = getattr(logging, args.log_level.upper())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))
    ours = logging.getLogger("ngramcache")
    ours.handlers.clear()
    ours.setLevel(level)
    logging.captureWarnings(True)


def cmd_serve(args: argparse.Namespace) -> int:
    announce = _Announcer(args.log_json)
    if not args.log_json:
        return _run_serve(args, announce)
    # Under --log-json what would end as a plain line (run.py's) is a JSON line too, with the same exit status.
    try:
        return _run_serve(args, announce)
    except KeyboardInterrupt:
        announce("ngramcache serve: interrupted", level="WARNING")
        return client_cli.EXIT_INTERRUPTED
    except (NgramCacheError, OSError) as e:
        reason = client_cli.describe_os_error(e) if isinstance(e, OSError) else str(e)
        announce(f"ngramcache serve: error: {reason}", level="ERROR")
        return client_cli.EXIT_ERROR
    except Exception as e:
        announce(f"ngramcache serve: unexpected error: {type(e).__name__}: {e} (please report it)", level="ERROR",
                 exception=traceback.format_exc())
        return client_cli.EXIT_UNEXPECTED


def _run_serve(args: argparse.Namespace, announce: _Announcer) -> int:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServiceConfig)}
    config = ServiceConfig.load(file=args.config, overrides=overrides)
    _setup_logging(args)
    from .data_lock import HELD_BY_PARENT_ENV, DataDirLock

    lock = DataDirLock(config.data_dir)
    if os.environ.get(HELD_BY_PARENT_ENV) != str(Path(config.data_dir).resolve()):
        lock.acquire()  # a second server on this data directory exits 2 here, in one line
    try:
        if config.workers > 1:
            return _serve_workers(config, args, announce)
        return asyncio.run(_serve(config, announce))
    finally:
        lock.release()


def _free_port(host: str) -> int:
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def _serve_workers(config: ServiceConfig, args: argparse.Namespace, announce: _Announcer) -> int:
    """Runs `config.workers` worker processes of `serve` on one port and relays signals to them."""
    import os
    import subprocess

    port = config.port or _free_port(config.host)
    # Every worker gets the settings this process resolved (defaults, file, variables, flags)
    # as NGC_* variables, with one worker each and the shared port.
    env = dict(os.environ)
    for f in dataclasses.fields(ServiceConfig):
        value = getattr(config, f.name)
        if value is not None:
            env[ENV_PREFIX + f.name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    env.update({ENV_PREFIX + "WORKERS": "1", ENV_PREFIX + "REUSE_PORT": "true", ENV_PREFIX + "PORT": str(port)})
    from .data_lock import HELD_BY_PARENT_ENV

    env[HELD_BY_PARENT_ENV] = str(Path(config.data_dir).resolve())  # this process holds the data directory's lock
    argv = [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())",
            "serve", "--log-level", args.log_level, *(["--log-json"] if args.log_json else [])]
    def worker_env(i: int) -> dict[str, str]:
        if config.metrics_port > 0:  # one /metrics per worker: the given port, then the next ones
            return {**env, ENV_PREFIX + "METRICS_PORT": str(config.metrics_port + i)}
        return env

    children = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=worker_env(i))
                for i in range(config.workers)]
    stopping: list[int] = []

    def relay(sig: int, frame: object) -> None:
        stopping.append(sig)
        for c in children:
            if c.poll() is None:
                c.send_signal(sig)

    signal.signal(signal.SIGTERM, relay)
    signal.signal(signal.SIGINT, relay)
    started = 0
    for c in children:
        assert c.stdout is not None
        line = c.stdout.readline()
        started += "listening on" in line
    if started < len(children):
        signalled = list(stopping)  # a signal before they all started (they wait for an unreachable store)
        relay(signal.SIGTERM, None)
        codes = [c.wait() for c in children]
        if signalled:
            return client_cli.EXIT_INTERRUPTED if signalled[0] == signal.SIGINT else max(codes)
        raise OSError(f"only {started} of {len(children)} workers started on {config.host}:{port}")
    announce(f"ngramcache serve: listening on {config.host}:{port} ({len(children)} workers, pids "
             f"{', '.join(str(c.pid) for c in children)})", stdout=True)
    codes = [c.wait() for c in children]
    if stopping and stopping[0] == signal.SIGINT:
        return client_cli.EXIT_INTERRUPTED
    return max(codes) if any(codes) else 0


async def _serve(config: ServiceConfig, announce: _Announcer) -> int:
    from .server import create_server

    stop = asyncio.Event()
    got: list[int] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        got.append(sig)
        stop.set()

    # Before the server starts and says so: a SIGTERM right after "listening" drains, never kills.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    stopper = asyncio.create_task(stop.wait())
    # The start waits for the counts store as long as it is unreachable: a signal meanwhile stops it
    # (nothing is served yet but health, so there is nothing to drain) rather than waiting for SIGKILL.
    starting = asyncio.create_task(create_server(config))
    await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        announce(f"ngramcache serve: {signal.Signals(got[0]).name} before the counts store answered: stopped")
        return client_cli.EXIT_INTERRUPTED if got[0] == signal.SIGINT else 0
    service, port = starting.result()
    announce(f"ngramcache serve: listening on {config.host}:{port}", stdout=True)
    waiter = asyncio.create_task(service.wait_for_termination())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    name = signal.Signals(got[0]).name if got else "server ended"
    announce(f"ngramcache serve: {name}: draining (up to {config.grace_period:g} s)...")
    await service.stop()
    waiter.cancel()
    stopper.cancel()
    return client_cli.EXIT_INTERRUPTED if got and got[0] == signal.SIGINT else 0


def add_token_hash(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "token-hash", help="hash a bearer token into a tokens-file entry",
        description="Reads a bearer token from stdin (or makes a random one with --new) and prints a [[token]] "
        "entry for the service's tokens_file: its SHA-256, namespaces and roles, never the token. With --new the "
        "token itself goes to stderr, once: `ngramcache token-hash --new --role push >> tokens.toml`.")
    p.add_argument("--new", action="store_true", help="generate a random token (printed once, on stderr)")
    p.add_argument("--name", help="the name logs show for this token (default: sha256:<first 12 hex digits>)")
    p.add_argument("--namespace", dest="namespaces", action="append", metavar="NS",
                   help="a namespace the token may use; repeat for more (default: *, every namespace)")
    p.add_argument("--role", dest="roles", action="append", choices=[r.value for r in Role],
                   help="a role to grant; repeat for more (default: draft)")
    client_cli.json_option(p, "the entry (sha256, name, namespaces, roles, and the TOML text as entry)")
    p.set_defaults(func=cmd_token_hash)


def cmd_token_hash(args: argparse.Namespace) -> int:
    if args.new:
        token = new_token()
    elif sys.stdin.isatty():
        token = getpass.getpass("token (not echoed): ")
    else:
        token = sys.stdin.readline().strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise InvalidArgumentError(f"a token is at least {MIN_TOKEN_CHARS} characters without spaces (a short one is "
                                   "guessable from its hash); --new makes a random one")
    namespaces, roles = args.namespaces or [ALL_NAMESPACES], args.roles or [Role.DRAFT.value]
    entry = token_toml(token_sha256(token), name=args.name, namespaces=namespaces, roles=roles)
    if args.new:
        print(f"new token, shown once (clients send `authorization: Bearer <token>`): {token}", file=sys.stderr)
    if args.json:  # never the token itself: stdout may go to a file or a log
        print(json.dumps({"sha256": token_sha256(token), "name": args.name, "namespaces": namespaces, "roles": roles,
                          "entry": entry}))
        return 0
    sys.stdout.write(entry)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `ngramcache` console script: the client's commands plus `serve`, `rebuild` and `token-hash`."""
    return client_cli.main(argv, extra_commands=[add_demo_service, add_serve, add_rebuild, add_namespace, add_publish,
                                                 add_token_hash])



# ----------------------------------------------------------------------------- the demo, served


def add_demo_service(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Extends the client's `demo`: after building and replaying, serve the cache to two worker processes."""
    demo = sub.choices["demo"]
    demo.description = (demo.description or "") + (
        " Then serves the cache: starts the gRPC service in this process (embedded counts store, loopback), "
        "publishes the cache as generation 1, and starts two worker processes that draft locally with "
        "NgramClient on one node (one downloads the generation, the other maps the same file). Worker A "
        "replays held-out files, then B replays files overlapping A's, once sharing A's counts through the "
        "service and once without; it prints acceptance and drafting cost per worker and how long an n-gram "
        "A accepts takes to reach B's drafts, then drafts one file over a remote Session. Everything it "
        "started is stopped and the temporary folder removed, also on Ctrl-C.")
    demo.add_argument("--no-serve", action="store_true", help="stop after the local replay (default: serve too)")
    demo.add_argument("--port", type=client_cli.int_in(0, 65535), default=0, metavar="N",
                      help="loopback port of the service (default 0: a free one)")
    demo.add_argument("--probes", type=client_cli.int_in(0, 100), default=5, metavar="N",
                      help="push-to-visible measurements, 0..100 (default 5)")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
