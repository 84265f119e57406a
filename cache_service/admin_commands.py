"""The commands that talk to a running service's Admin: `namespace create|list|delete`, `publish` and `rebuild` (arguments and printing; `AdminClient` makes the calls)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator

import grpc

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError, ServiceUnreachableError
from ngramcache.client.sync.admin import AdminClient, RebuildStatus
from ngramcache.client.tools import cli as client_cli
from ngramcache.client.wire.address import DEFAULT_SERVER, check_address
from ngramcache.client.wire.diagnose import CLI_NAMES

__all__ = ["DEFAULT_SERVER", "add_namespace", "add_publish", "add_rebuild"]



def _connection_options(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help=f"a replica of the service (default: $NGC_SERVER, else {DEFAULT_SERVER})")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="connect with TLS, trusting the CA certificates in this file (default: plaintext)")
    p.add_argument("--tls-cert", metavar="PEM", help="with --tls-ca: a client certificate, for a service that requires mutual TLS")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--token", default=os.environ.get("NGC_TOKEN"),
                   help=f"bearer token with the {role} role (default: $NGC_TOKEN)")
    p.add_argument("--timeout", type=client_cli.seconds_in(0, 86400), default=10.0,
                   help="seconds to wait for the server to answer, in (0, 86400] (default 10)")


def server_of(args: argparse.Namespace, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(address, what names it): --server, else $NGC_SERVER, else the default (named --server, the flag to give)."""
    env = dict(os.environ) if env is None else env
    if args.server:
        return args.server, "--server"
    if env.get("NGC_SERVER"):
        return env["NGC_SERVER"], "$NGC_SERVER"
    return DEFAULT_SERVER, "--server"


def _unset_server_hint(args: argparse.Namespace, env: dict[str, str] | None = None) -> str:
    """Where neither --server nor $NGC_SERVER was given: a note naming a set variable that looks like a typo of it."""
    env = dict(os.environ) if env is None else env
    if args.server or env.get("NGC_SERVER"):
        return ""
    import difflib

    typo = difflib.get_close_matches("NGC_SERVER", sorted(k for k in env if k.startswith("NGC_")), n=1, cutoff=0.8)
    unset = f"neither --server nor $NGC_SERVER was given, so the default {DEFAULT_SERVER} was tried"
    return f" ({unset}; ${typo[0]} is set: a typo of NGC_SERVER?)" if typo else f" ({unset})"


def _cli_error(e: NgramCacheError, args: argparse.Namespace) -> NgramCacheError:
    """``e`` worded for the command line: the flags to change, not the library's arguments or gRPC metadata."""
    server, server_name = server_of(args)
    if isinstance(e, ServiceUnreachableError):
        return NgramCacheError(e.diagnosis.message({**CLI_NAMES, "address": server_name}) + _unset_server_hint(args))
    code = getattr(e, "code", None)
    if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return e
    detail = getattr(e, "details", None) or str(e).removeprefix(f"{code.name}: ")
    if code == grpc.StatusCode.UNAUTHENTICATED and not args.token:
        return NgramCacheError(f"the service at {server} requires a bearer token: pass --token TOKEN or set "
                               "$NGC_TOKEN (a token with the admin role)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return NgramCacheError(f"the service at {server} refused the token: {detail}; pass --token TOKEN or set "
                               "$NGC_TOKEN to a token in its tokens file, with the admin role")
    return NgramCacheError(f"the service at {server} refused the call: {detail}; pass --token TOKEN or set "
                           "$NGC_TOKEN to a token with that role")


@contextlib.contextmanager
def _client(args: argparse.Namespace) -> Iterator[AdminClient]:
    """An AdminClient to --server, once it answers; errors worded for the command line (`_cli_error`)."""
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert is not None and args.tls_ca is None):
        raise InvalidArgumentError("--tls-cert and --tls-key go together, and with --tls-ca")
    server, server_name = server_of(args)
    check_address(server, server_name, "--tls-ca")
    client = AdminClient(server, token=args.token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, timeout=args.timeout)
    try:
        client.wait_ready()
        yield client
    except NgramCacheError as e:
        raise _cli_error(e, args) from None
    finally:
        client.close()


# namespace create | list | delete


def add_namespace(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("namespace", help="create, list or delete a service's namespaces",
                       description="Manages the namespaces of the service at --server. A namespace is bound to one "
                       "tokenizer (its fingerprint and vocabulary size): clients, sessions and generations of another "
                       "are refused. Needs a token with the admin role when the service checks tokens.")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="{create,list,delete}")
    create = verbs.add_parser("create", help="create a namespace bound to a tokenizer (idempotent for the same one)",
                              description="Creates NAME bound to the tokenizer of --tokenizer (or --vocab-size and "
                              "--fingerprint). Creating it again with the same tokenizer changes nothing; with "
                              "another it is refused.")
    create.add_argument("name", metavar="NAME", help="1..64 characters of [A-Za-z0-9_.-]")
    client_cli.tokenizer_options(create)
    _connection_options(create, "admin")
    client_cli.json_option(create, "the namespace (name, created, vocabulary size, fingerprint)")
    create.set_defaults(func=cmd_namespace_create)
    lst = verbs.add_parser("list", help="list the namespaces", description="Lists every namespace: name, "
                           "vocabulary size, fingerprint (first 16 hex digits), latest generation.")
    _connection_options(lst, "admin")
    lst.add_argument("--json", action="store_true", help="print a JSON list of the namespaces (name, vocabulary "
                     "size, fingerprint, latest generation) on stdout instead of the table")
    lst.set_defaults(func=cmd_namespace_list)
    delete = verbs.add_parser("delete", help="delete a namespace with its counts and generation files",
                              description="Deletes NAME: its dynamic counts in the store and its generation files on "
                              "the replica that answers. Sessions and clients of it end NOT_FOUND. Asks for no "
                              "confirmation: --yes is required.")
    delete.add_argument("name", metavar="NAME")
    delete.add_argument("--yes", action="store_true", help="really delete it (required)")
    _connection_options(delete, "admin")
    client_cli.json_option(delete, "the outcome (name, deleted)")
    delete.set_defaults(func=cmd_namespace_delete)


def cmd_namespace_create(args: argparse.Namespace) -> int:
    vocab, fingerprint, _ = client_cli.vocab_and_fingerprint(args, client_cli.load_tokenizer_spec(args.tokenizer))
    with _client(args) as admin:
        ns = admin.create_namespace(args.name, (fingerprint, vocab))
    if args.json:
        print(json.dumps({"name": ns.name, "created": ns.created, "vocab_size": ns.vocab_size,
                          "fingerprint": ns.fingerprint.hex(), "latest_generation": ns.latest_generation}))
        return 0
    verb = "created" if ns.created else "exists already (same tokenizer)"
    print(f"namespace {ns.name} {verb}: vocabulary {ns.vocab_size:,}, fingerprint {ns.fingerprint.hex()[:16]}...")
    return 0


def cmd_namespace_list(args: argparse.Namespace) -> int:
    with _client(args) as admin:
        names = admin.list_namespaces()
    if args.json:
        print(json.dumps([{"name": ns.name, "vocab_size": ns.vocab_size, "fingerprint": ns.fingerprint.hex(),
                           "latest_generation": ns.latest_generation} for ns in names]))
        return 0
    if not names:
        print("no namespaces", file=sys.stderr)
        return 0
    width = max(len("namespace"), *(len(ns.name) for ns in names))
    print(f"{'namespace':{width}s}  {'vocabulary':>10s}  {'fingerprint':16s}  generation")
    for ns in names:
        print(f"{ns.name:{width}s}  {ns.vocab_size:>10,}  {ns.fingerprint.hex()[:16]}  {ns.latest_generation or '-'}")
    return 0


def cmd_namespace_delete(args: argparse.Namespace) -> int:
    if not args.yes:
        raise InvalidArgumentError(f"deleting {args.name} drops its counts and files for good: add --yes")
    with _client(args) as admin:
        existed = admin.drop_namespace(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "deleted": existed}))
        return 0
    print(f"namespace {args.name} {'deleted' if existed else 'did not exist'}")
    return 0


# publish


def add_publish(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("publish", help="upload a static cache file as a namespace's next generation",
                       description="Uploads FILE (built by `ngramcache build` with the namespace's tokenizer) to the "
                       "service at --server as generation G of --namespace, G being the number in the file's header "
                       "(`build --generation G`); it must be above the namespace's latest. The service verifies size, "
                       "checksum, format and tokenizer before it publishes; every client and session swaps to it. "
                       "Needs a token with the admin role.")
    p.add_argument("file", metavar="FILE", help="a static cache file (.ngc)")
    p.add_argument("--namespace", required=True, metavar="NS", help="the namespace to publish into")
    _connection_options(p, "admin")
    client_cli.json_option(p, "the published generation (number, size, sha256, already published)")
    p.set_defaults(func=cmd_publish)


def cmd_publish(args: argparse.Namespace) -> int:
    client_cli.check_input_file(args.file, "FILE")
    with _client(args) as admin:
        g = admin.publish(args.namespace, args.file)
    if args.json:
        print(json.dumps({"file": args.file, "namespace": g.namespace, "generation": g.generation, "size": g.size,
                          "sha256": g.sha256.hex(), "already_published": g.already_published}))
        return 0
    if g.already_published:
        print(f"{args.file} was already published as generation {g.generation} of {g.namespace} (nothing changed)")
        return 0
    print(f"published {args.file} as generation {g.generation} of {g.namespace} ({g.size / 1e6:.2f} MB, "
          f"sha256 {g.sha256.hex()[:16]}...)")
    return 0


# rebuild


def add_rebuild(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rebuild", help="ask a service to fold a namespace's counts into its next static generation",
        description="Asks the service at --server to rebuild NAMESPACE: fold its corpus base (the latest generation "
        "made by `ngramcache publish`, with its corpus index; none until one is published), its dynamic counts (the "
        "totals the clients pushed), the fleet history (into the corpus index) and token files under the server's "
        "--corpus-root (--corpus) into the next static generation and publish it; every client and session swaps to "
        "it. A generation a rebuild made is never folded (it holds the dynamic counts already), so the base carries "
        "into every rebuild until a newer one is published or --no-base drops it. A base whose file no replica has "
        "fails the rebuild (pass --no-base, or publish the corpus again). One rebuild per namespace runs at a time "
        "across all replicas (a "
        "lease in the counts store); if one is running, this says where and exits 2 (as for every error). Shows "
        "progress until it ends (Ctrl-C stops watching, not the rebuild). Needs a token with the admin role when "
        "the service checks tokens.")
    p.add_argument("--namespace", required=True, metavar="NS", help="the namespace to rebuild")
    _connection_options(p, "admin")
    p.add_argument("--min-count", type=client_cli.int_in(1, 2**31 - 1), default=1,
                   help="leave out dynamic counts below this (default 1)")
    p.add_argument("--ngram-size", type=int, default=0, choices=range(0, 5), metavar="N",
                   help="tokens per key of the new file, 1..4 (default: the previous generation's, else 2)")
    p.add_argument("--no-base", action="store_true",
                   help="leave the corpus base out and forget it: this generation and the next rebuilds fold the "
                        "counts alone, until a generation is published again")
    p.add_argument("--include-previous", action="store_true",
                   help="deprecated and ignored: every rebuild folds the corpus base now")
    p.add_argument("--decay", type=float, default=1.0,
                   help="multiply the corpus base's counts by this, in (0, 1] (default 1: no decay)")
    p.add_argument("--corpus", action="append", default=[], metavar="PATH",
                   help="token files or folders (.bin/.tokens/.npy) on the server, under its --corpus-root, to add; "
                        "repeat for more")
    p.add_argument("--keep", type=client_cli.int_in(1, 10**6), default=3,
                   help="published generations kept, this one included (default 3)")
    p.add_argument("--no-wait", action="store_true", help="return once the rebuild started")
    client_cli.json_option(p, "the rebuild's final status (with --no-wait: its start status); progress goes to "
                              "stderr")
    p.add_argument("--no-history", action="store_true",
                   help="leave the fleet history out (by default the sequences it keeps join the new file's corpus "
                        "index, so the match mode drafts from what the fleet generated)")
    p.set_defaults(func=cmd_rebuild)


def _status_json(status: RebuildStatus) -> str:
    return json.dumps({**dataclasses.asdict(status), "seconds": round(status.seconds, 3)})


def cmd_rebuild(args: argparse.Namespace) -> int:
    if not 0 < args.decay <= 1:
        raise InvalidArgumentError(f"--decay must be in (0, 1], got {args.decay}")
    shown = ""
    talk = sys.stderr if args.json else sys.stdout  # under --json stdout holds the one JSON object

    def progress(status: RebuildStatus) -> None:
        nonlocal shown
        line = (f"  {status.phase or 'starting'}: {status.previous_rows:,} base rows, "
                f"{status.dynamic_rows:,} dynamic rows, {status.corpus_tokens:,} corpus tokens, "
                f"{status.history_tokens:,} history tokens")
        if line != shown:
            print(line, file=talk, flush=True)
            shown = line

    if args.include_previous:
        print("ngramcache rebuild: note: --include-previous is ignored: every rebuild folds the corpus base (the "
              "latest published generation) now; --no-base leaves it out", file=sys.stderr)
    with _client(args) as admin:
        status = admin.start_rebuild(args.namespace, min_count=args.min_count, ngram_size=args.ngram_size,
                                     base=not args.no_base, decay=args.decay, corpus=args.corpus,
                                     keep=args.keep, history=not args.no_history)
        print(f"rebuilding {args.namespace} on {status.holder} (lease token {status.lease_token})", file=talk, flush=True)
        if args.no_wait:
            if args.json:
                print(_status_json(status))
            return 0
        status = admin.wait_rebuild(status, progress=progress)
    took = f"{status.seconds:.3f} s" if status.seconds < 1 else f"{status.seconds:.1f} s"
    if status.state != "done":
        print(f"ngramcache rebuild: error: the rebuild of {args.namespace} failed after {took}: {status.error}",
              file=sys.stderr)
        return client_cli.EXIT_ERROR
    if args.json:
        print(_status_json(status))
        return 0
    if status.base_generation:
        base = f"base generation {status.base_generation}: {status.previous_rows:,} rows"
    else:
        base = "corpus base dropped (--no-base)" if args.no_base else "no corpus base (none published)"
    print(f"published generation {status.generation} of {args.namespace} in {took}: {status.n_keys:,} keys, "
          f"{status.n_followers:,} followers, {status.file_bytes / 1e6:.2f} MB ({base}, {status.dynamic_rows:,} "
          f"dynamic rows, {status.corpus_tokens:,} corpus tokens, {status.history_tokens:,} history tokens indexed)")
    return 0
