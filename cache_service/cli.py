"""The `ngramcache` command with the service's subcommands (`serve`, `token-hash`) added to the client's."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import getpass
import logging
import signal
import sys

from ngramcache.client import cli as client_cli
from ngramcache.client.errors import InvalidArgumentError

from .config import ENV_PREFIX, ServiceConfig
from .security import ALL_NAMESPACES, MIN_TOKEN_CHARS, Role, new_token, token_sha256, token_toml

_HELP = {
    "host": "address to listen on (default 127.0.0.1; a non-loopback address needs TLS or --allow-insecure-remote)",
    "port": "TCP port (default 50051; 0 picks a free one and prints it)",
    "data_dir": "folder for static generations and the embedded counts store's snapshot (default ./ngramcache-data)",
    "counts": "counts store URL: redis://HOST:PORT[/DB], rediss://..., redis+cluster://H:P[,H:P], "
              "embedded://PATH (default: embedded, snapshotted in --data-dir)",
    "allow_insecure_remote": "allow plaintext gRPC on a non-loopback address (default off)",
    "tls_cert": "PEM certificate (chain) of the server; with --tls-key, serve TLS (default: plaintext)",
    "tls_key": "PEM private key of --tls-cert, unencrypted (default: none)",
    "tls_client_ca": "PEM CA certificates; clients must present a certificate they signed: mutual TLS (default: none)",
    "tokens_file": "TOML file of bearer token hashes with their roles and namespaces (`ngramcache token-hash` "
                   "writes entries; default: none, every call allowed)",
    "max_sessions": "drafting sessions open at once (default 10000)",
    "session_idle_timeout": "seconds without a step before a session is closed (default 300)",
    "max_session_tokens": "most tokens of one session's sequence (default 1048576)",
    "max_step_tokens": "most tokens one session step may carry (default 65536)",
    "max_draft_tokens": "most tokens of a one-shot Draft request (default 65536)",
    "session_memory": "bytes of session context tables per namespace; least recently used are evicted beyond "
                      "(default 1 GiB)",
    "max_push_rows": "most rows in one pushed batch (default 1048576)",
    "max_chunk_rows": "most rows in one Pull chunk (default 65536)",
    "mirror_interval": "seconds between two refreshes of a namespace's dynamic mirror (default 1)",
    "max_message_bytes": "largest gRPC message in either direction, bytes (default 64 MiB)",
    "max_file_bytes": "largest static file a Publish may upload, bytes (default 16 GiB)",
    "grace_period": "seconds in-flight calls get to finish on SIGTERM (default 10)",
    "store_threads": "threads calling the counts store at once (default 8)",
}


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="run the gRPC service",
        description="Runs the ngramcache.v1 gRPC service (Drafting, Counts, StaticFiles, Admin, health, "
        "reflection). With no options: an embedded counts store snapshotted under ./ngramcache-data, on "
        "127.0.0.1:50051. Every option may also come from a TOML --config file (same names, underscores) or "
        f"an {ENV_PREFIX}<NAME> environment variable ({ENV_PREFIX}PORT=50052); flags win over variables, "
        "variables over the file. SIGTERM or Ctrl-C stops gracefully: health turns NOT_SERVING, in-flight "
        "calls get --grace-period seconds, the embedded store writes its snapshot.")
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (default: none)")
    for f in dataclasses.fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=_HELP[f.name])
        else:
            kind = type(f.default) if f.default is not None else str
            p.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=_HELP[f.name])
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line (default: plain text)")
    p.set_defaults(func=cmd_serve)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        return json.dumps({"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                           "message": record.getMessage()})


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServiceConfig)}
    config = ServiceConfig.load(file=args.config, overrides=overrides)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if args.log_json else logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("ngramcache")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    return asyncio.run(_serve(config))


async def _serve(config: ServiceConfig) -> int:
    from .server import create_server

    service, port = await create_server(config)
    print(f"ngramcache serve: listening on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    got: list[int] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        got.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    waiter = asyncio.create_task(service.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    name = signal.Signals(got[0]).name if got else "server ended"
    print(f"ngramcache serve: {name}: draining (up to {config.grace_period:g} s)...", file=sys.stderr, flush=True)
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
    entry = token_toml(token_sha256(token), name=args.name, namespaces=args.namespaces or [ALL_NAMESPACES],
                       roles=args.roles or [Role.DRAFT.value])
    if args.new:
        print(f"new token, shown once (clients send `authorization: Bearer <token>`): {token}", file=sys.stderr)
    sys.stdout.write(entry)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `ngramcache` console script: the client's commands plus `serve` and `token-hash`."""
    return client_cli.main(argv, extra_commands=[add_serve, add_token_hash])


if __name__ == "__main__":
    sys.exit(main())
