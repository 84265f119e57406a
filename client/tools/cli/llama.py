"""`ngramcache llama-follow`: llama-server behind a proxy, moved to each new generation of a namespace (arguments and printing; the work is ngramcache.client.tools.llama_follow's)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ngramcache.client._core import MAX_VOCAB
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    ConnectTimeoutError,
    InvalidArgumentError,
    NamespaceNotFoundError,
    NgramCacheError,
    ServiceUnreachableError,
    TokenizerMismatchError,
)
from ngramcache.client.tools.cli.arguments import _fingerprint_from_hex, int_in, load_tokenizer_spec, seconds_in
from ngramcache.client.wire.address import DEFAULT_SERVER

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

RETRY_SECONDS = 10.0  # between two tries to reach an unreachable service, while llama-server serves without it


def add_llama_follow(sub: SubParsers) -> None:
    p = sub.add_parser(
        "llama-follow",
        help="run llama-server on a namespace's newest generation (its -lcs file), switching with no failed request",
        description="Runs the llama-server command given after '--' on a loopback port behind an HTTP proxy that "
        "listens on --listen, and keeps it on the namespace's newest static generation: when a generation lands "
        "(published or rebuilt), it is downloaded and verified, written to --lcs in llama.cpp's format (a temporary "
        "file, then a rename), and a llama-server reading it replaces the running one. llama-server reads its -lcs "
        "file only when it starts, so it is replaced, not signalled. --switch overlap (default) starts the new "
        "server beside the old one, sends new requests to it once its /health answers 200, and stops the old one "
        "when its requests are done: no request fails, and two copies of the model are loaded for the few seconds "
        "of the switch. --switch restart loads one copy at a time: new requests wait in the proxy while the old "
        "server finishes its requests and the new one starts (the longest request in flight plus one start). The "
        "proxy answers "
        "/health with the server's answer (503 while none is ready): point a readiness probe at it. GET "
        "/ngramcache/status gives the generation served and the switch figures as JSON, and every answer carries "
        "X-Ngramcache-Generation (the generation of the server that gave it). A server that exits on "
        "its own is started again; an unreachable service never stops llama-server (it serves the last "
        "generation written, or none, while the connection is retried). Ctrl-C stops the servers at once; SIGTERM "
        "lets their requests finish first (up to --drain-timeout).",
        epilog="Example: ngramcache llama-follow --server ngramcache:50051 --namespace code --tokenizer "
        "model/tokenizer.json --lcs /var/lib/llama/static.lcs --listen 0.0.0.0:8080 -- llama-server -m model.gguf "
        "--spec-type ngram-cache",
    )
    p.add_argument("--server", action="append", metavar="HOST:PORT",
                   help=f"a replica of the ngramcache service; repeat for failover (default: $NGC_SERVER, else "
                        f"{DEFAULT_SERVER})")
    p.add_argument("--namespace", required=True, metavar="NS", help="the namespace whose generations are followed")
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="the model's tokenizer (a tokenizer.json path, or tiktoken:<encoding>): the namespace must be "
                        "bound to it, so the -lcs file holds the model's token ids")
    p.add_argument("--vocab-size", type=int_in(1, MAX_VOCAB), metavar="V",
                   help="without --tokenizer: the namespace's vocabulary size (`ngramcache namespace list`)")
    p.add_argument("--fingerprint", metavar="HEX", help="without --tokenizer: the namespace's tokenizer fingerprint")
    p.add_argument("--lcs", required=True, metavar="PATH",
                   help="the llama.cpp static cache file written for each generation and given to llama-server as "
                        "-lcs (its folder must exist and be writable)")
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                   help="where clients (and probes) connect: the proxy in front of llama-server (default "
                        "127.0.0.1:8080, llama-server's own default; 0.0.0.0:8080 in a pod)")
    p.add_argument("--switch", choices=("overlap", "restart"), default="overlap",
                   help="overlap (default): the new server starts beside the old one (twice the model's memory "
                        "during the switch); restart: one server at a time, requests held while the new one starts")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where the node's generation files are kept (default $XDG_CACHE_HOME/ngramcache)")
    p.add_argument("--token", default=os.environ.get("NGC_TOKEN"),
                   help="bearer token with the draft role (default: $NGC_TOKEN)")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="connect with TLS, trusting the CA certificates in this file (default: plaintext)")
    p.add_argument("--tls-cert", metavar="PEM", help="with --tls-ca: a client certificate, for a service that requires mutual TLS")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--connect-timeout", type=seconds_in(0, 3600), default=10.0, metavar="S",
                   help="seconds to wait for the service at start; past them llama-server starts without a "
                        "generation and the service is tried again every 10 s (default 10)")
    p.add_argument("--start-timeout", type=seconds_in(0, 86400), default=600.0, metavar="S",
                   help="seconds a llama-server may take to answer /health 200 (default 600)")
    p.add_argument("--drain-timeout", type=seconds_in(0, 86400), default=600.0, metavar="S",
                   help="seconds an old server gets to finish its requests before it is stopped (default 600)")
    p.add_argument("--hold-timeout", type=seconds_in(0, 86400), default=120.0, metavar="S",
                   help="seconds a request waits in the proxy while no server is ready, before a 503 (default 120)")
    p.add_argument("server_command", nargs=argparse.REMAINDER, metavar="-- llama-server ARGS",
                   help="the llama-server command and its arguments, with --spec-type ngram-cache and without "
                        "--host, --port and -lcs (llama-follow sets them)")
    p.set_defaults(func=cmd_llama_follow)


def _say(message: str) -> None:
    print(f"ngramcache llama-follow: {message}", file=sys.stderr, flush=True)


def _listen_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"--listen {text!r} is not HOST:PORT (e.g. 0.0.0.0:8080; port 0 picks a free one)")
    return host.strip("[]"), int(port)


def _identity(args: argparse.Namespace) -> tuple[bytes, int]:
    """The tokenizer's (fingerprint, vocabulary size) the namespace must be bound to."""
    tokenizer = load_tokenizer_spec(args.tokenizer)
    if tokenizer is not None:
        if args.vocab_size is not None and args.vocab_size != tokenizer.vocab_size:
            raise InvalidArgumentError(f"--vocab-size {args.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}")
        if args.fingerprint is not None and _fingerprint_from_hex(args.fingerprint) != tokenizer.fingerprint:
            raise TokenizerMismatchError("--fingerprint differs from the tokenizer's fingerprint")
        return tokenizer.fingerprint, tokenizer.vocab_size
    if args.vocab_size is None or args.fingerprint is None:
        raise InvalidArgumentError("give the model's tokenizer: --tokenizer SPEC, or --vocab-size V with --fingerprint "
                                   "HEX (the namespace's, as `ngramcache namespace list` shows them)")
    return _fingerprint_from_hex(args.fingerprint), args.vocab_size


def _check_lcs(path: str) -> Path:
    lcs = Path(path)
    folder = lcs.parent if str(lcs.parent) else Path(".")
    if lcs.is_dir():
        raise InvalidArgumentError(f"--lcs {path} is a folder: give the file to write, e.g. {lcs / 'static.lcs'}")
    if not folder.is_dir():
        raise InvalidArgumentError(f"--lcs {path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"--lcs {path}: its folder {folder} is not writable")
    return lcs


def cmd_llama_follow(args: argparse.Namespace) -> int:
    from ngramcache.client.tools.llama_follow import FollowConfig, check_server_command
    from ngramcache.client.wire.address import check_address

    command = list(args.server_command)
    if command and command[0] == "--":
        command = command[1:]
    check_server_command(command)
    if shutil.which(command[0]) is None:
        raise InvalidArgumentError(f"llama-server command {command[0]!r} not found (not on PATH, or not an executable "
                                   "file): give its path after '--'")
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert is not None and args.tls_ca is None):
        raise InvalidArgumentError("--tls-cert and --tls-key go together, and with --tls-ca")
    addresses = args.server or [os.environ.get("NGC_SERVER") or DEFAULT_SERVER]
    for a in addresses:
        check_address(a, "--server", "--tls-ca")
    lcs = _check_lcs(args.lcs)
    host, port = _listen_address(args.listen)
    identity = _identity(args)
    config = FollowConfig(command=tuple(command), lcs=lcs, listen_host=host, listen_port=port, switch=args.switch,
                          start_timeout=args.start_timeout, drain_timeout=args.drain_timeout,
                          hold_timeout=args.hold_timeout, say=_say)
    return asyncio.run(_follow(args, config, addresses, identity))


def _connect(args: argparse.Namespace, addresses: list[str], identity: tuple[bytes, int]) -> Any:
    from ngramcache.client.sync import NgramClient

    return NgramClient(addresses, args.namespace, identity, cache_dir=args.cache_dir, token=args.token,
                       tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                       connect_timeout=args.connect_timeout, pull_interval=1.0)


def _cli_error(e: NgramCacheError, args: argparse.Namespace, addresses: list[str]) -> NgramCacheError:
    """``e`` worded for the command line: the flag to change, not the library's arguments or gRPC metadata."""
    import grpc

    from ngramcache.client.wire.diagnose import CLI_NAMES

    if isinstance(e, ServiceUnreachableError):
        return NgramCacheError(e.diagnosis.message(CLI_NAMES))
    if isinstance(e, ConnectTimeoutError):
        return NgramCacheError(e.message({**CLI_NAMES, "connect_timeout": "--connect-timeout"}))
    code = getattr(e, "code", None)
    where = f"the service at {', '.join(addresses)}"
    detail = getattr(e, "details", None) or (str(e).removeprefix(f"{code.name}: ") if code is not None else str(e))
    if code == grpc.StatusCode.UNAUTHENTICATED and not args.token:
        return NgramCacheError(f"{where} requires a bearer token: pass --token TOKEN or set $NGC_TOKEN (a token with "
                               "the draft role on the namespace)")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return NgramCacheError(f"{where} refused the token: {detail}; pass --token TOKEN or set $NGC_TOKEN to a token "
                               "with the draft role on the namespace")
    if isinstance(e, NamespaceNotFoundError) or code == grpc.StatusCode.NOT_FOUND:
        return NgramCacheError(f"namespace {args.namespace!r} does not exist on {where}: create it (ngramcache "
                               "namespace create) or give another --namespace")
    return e


async def _follow(args: argparse.Namespace, config: Any, addresses: list[str], identity: tuple[bytes, int]) -> int:
    from ngramcache.client.tools.llama_follow import ClientGenerations, LlamaFollower

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    got: list[int] = []
    follower = LlamaFollower(config, None)

    def on_signal(sig: int) -> None:
        got.append(sig)
        if sig == signal.SIGINT:
            follower.drain_on_stop = False
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    clients: list[Any] = []

    async def connect(first: bool) -> bool:
        try:
            client = await asyncio.to_thread(_connect, args, addresses, identity)
        except ServiceUnreachableError as e:
            if first and not e.retriable:
                raise _cli_error(e, args, addresses) from None
            reason: NgramCacheError = e
        except BackendUnavailableError as e:
            reason = _cli_error(e, args, addresses) if isinstance(e, ConnectTimeoutError) else e
        except NgramCacheError as e:
            raise _cli_error(e, args, addresses) from None
        else:
            clients.append(client)
            follower.attach(ClientGenerations(client))
            if not first:
                _say(f"connected to {', '.join(addresses)}: following namespace {args.namespace!r}")
            return True
        if first:
            _say(f"{reason}; llama-server starts without a generation, the service is tried again every "
                 f"{RETRY_SECONDS:g} s")
        return False

    async def reconnect() -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_SECONDS)
            if stop.is_set():
                return
            try:
                if await connect(False):
                    return
            except NgramCacheError as e:  # llama-server keeps serving: say why, and try again
                _say(f"{e}; trying again in {RETRY_SECONDS:g} s")

    retrying: asyncio.Task[None] | None = None
    try:
        if not await connect(True):
            retrying = asyncio.create_task(reconnect())
        if stop.is_set():
            _say("interrupted before llama-server started")
            return 130 if got[0] == signal.SIGINT else 0
        await follower.run(stop)
    finally:
        if retrying is not None:
            retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retrying
        for client in clients:
            await asyncio.to_thread(client.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    name = signal.Signals(got[0]).name if got else "stopped"
    _say(f"{'interrupted' if got and got[0] == signal.SIGINT else name}: llama-server stopped")
    return 130 if got and got[0] == signal.SIGINT else 0
