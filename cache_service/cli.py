"""The `ngramcache` command with the service's subcommands (`serve`) added to the client's."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from ngramcache.client import cli as client_cli

from .config import ENV_PREFIX, ServiceConfig

_HELP = {
    "host": "address to listen on (default 127.0.0.1; a non-loopback address needs --allow-insecure-remote until TLS lands)",
    "port": "TCP port (default 50051; 0 picks a free one and prints it)",
    "data_dir": "folder for static generations and the embedded counts store's snapshot (default ./ngramcache-data)",
    "counts": "counts store URL: redis://HOST:PORT[/DB], rediss://..., redis+cluster://H:P[,H:P], "
              "embedded://PATH (default: embedded, snapshotted in --data-dir)",
    "allow_insecure_remote": "allow plaintext gRPC on a non-loopback address (default off)",
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


def main(argv: list[str] | None = None) -> int:
    """The `ngramcache` console script: the client's commands plus `serve`."""
    return client_cli.main(argv, extra_commands=[add_serve])


if __name__ == "__main__":
    sys.exit(main())
