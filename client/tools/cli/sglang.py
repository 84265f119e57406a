"""The `sglang-sync` command: SGLang servers fed a namespace's generations as external corpora, live (arguments and printing; `SglangSync` does the work)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ngramcache.client.kernel.errors import ConnectTimeoutError, InvalidArgumentError, NgramCacheError, ServiceUnreachableError
from ngramcache.client.tools.cli.arguments import int_in, load_tokenizer_spec, quiet_option, seconds_in
from ngramcache.client.wire.address import DEFAULT_SERVER

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]



def add_sglang_commands(sub: SubParsers) -> None:
    from ngramcache.client.kernel.sglang_corpus import SGLANG_DEFAULT_MAX_TOKENS

    p = sub.add_parser(
        "sglang-sync",
        help="keep running SGLang servers' external n-gram corpora on a namespace's newest generation",
        description="Follows the namespace's generations (each fetched once into --cache-dir and verified) and feeds "
        "each new one to every SGLang server as an external corpus through its HTTP API (SGLang 0.5.11 or newer, run "
        "with --speculative-algorithm NGRAM and --speculative-ngram-external-sam-budget above 0, else the corpus is "
        "loaded but never drafted from): the generation's corpus index (built with --corpus-index) decoded with "
        "--tokenizer is added as ngramcache-<namespace>-g<generation>, and the corpus it replaces is removed once the "
        "new one is listed. Every --interval each server is listed again: a server that restarted gets the corpus "
        "again; one that does not answer is retried with a growing delay (at most --interval), apart from the "
        "others. SGLang's --speculative-ngram-external-corpus-max-tokens counts all its corpora and the new one "
        "is added before the old one goes, so a corpus is cut to half of --max-tokens: whole documents in order, "
        "up to the first that does not fit (only a first document that alone is past it is sent in part, its "
        "beginning); the generation line says what was cut. An add a server refuses (its own limit below "
        "--max-tokens, say) is said once and that generation is not sent to it again until a newer one lands "
        "(or 10 minutes pass). Runs until interrupted (Ctrl-C); meant as a sidecar beside the servers.",
    )
    p.add_argument("--namespace", required=True, metavar="NS", help="the namespace to follow")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="the namespace's tokenizer (the model's): a Hugging Face tokenizer.json path, or "
                        "tiktoken:<encoding>; decodes the corpus into the text SGLang tokenizes again")
    p.add_argument("--sglang", action="append", required=True, metavar="URL",
                   help="an SGLang server's base URL, http://HOST:PORT or https://HOST:PORT; repeat for each server")
    p.add_argument("--sglang-api-key", default=os.environ.get("SGLANG_API_KEY"), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY': the servers' --admin-api-key, else their --api-key "
                        "(default: $SGLANG_API_KEY; none when unset)")
    p.add_argument("--sglang-header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="one more header on every request to the servers (a gateway's); repeatable (default: none)")
    p.add_argument("--sglang-ca", metavar="PEM",
                   help="for https URLs: trust the CA certificates in this file (default: the system's)")
    p.add_argument("--max-tokens", type=int_in(2), default=SGLANG_DEFAULT_MAX_TOKENS, metavar="N",
                   help="the servers' --speculative-ngram-external-corpus-max-tokens (default "
                        f"{SGLANG_DEFAULT_MAX_TOKENS:,}, SGLang's); each corpus is cut to half of it")
    p.add_argument("--interval", type=seconds_in(0.05, 3600), default=10.0, metavar="S",
                   help="seconds between two checks of a server, and the longest wait before one that failed is "
                        "tried again (default 10)")
    p.add_argument("--load-timeout", type=seconds_in(0, 86400), default=600.0, metavar="S",
                   help="seconds to wait for a server to load a corpus (it answers once loaded; default 600)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where generation files are fetched (default: $XDG_CACHE_HOME/ngramcache); in a pod, an "
                        "emptyDir")
    p.add_argument("--server", action="append", metavar="HOST:PORT",
                   help=f"a replica of the ngramcache service; repeat for failover (default: $NGC_SERVER, else "
                        f"{DEFAULT_SERVER})")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="connect to the service with TLS, trusting the CA certificates in this file (default: plaintext)")
    p.add_argument("--tls-cert", metavar="PEM", help="with --tls-ca: a client certificate, for a service that requires mutual TLS")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--token", default=os.environ.get("NGC_TOKEN"),
                   help="bearer token for the service (default: $NGC_TOKEN)")
    p.add_argument("--timeout", type=seconds_in(0, 86400), default=10.0, metavar="S",
                   help="seconds to wait for the service at the start, and for a server's list or remove (default 10)")
    p.add_argument("--json", action="store_true",
                   help="print each event as one JSON object a line on stdout ({\"event\": connected | generation | listed | "
                        "removed | note | error | recovered, \"time\": ISO 8601 UTC, ...}); an error that stops the "
                        "command is still one line on stderr")
    quiet_option(p)
    p.set_defaults(func=cmd_sglang_sync)


def _headers(values: list[str]) -> dict[str, str]:
    headers = {}
    for value in values:
        name, sep, rest = value.partition(":")
        if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
            raise InvalidArgumentError(f"--sglang-header {value!r}: give 'NAME: VALUE', e.g. 'X-Tenant: a'")
        headers[name.strip()] = rest.strip()
    return headers


def cmd_sglang_sync(args: argparse.Namespace) -> int:
    from ngramcache.client.tools.sglang_http import SglangTarget
    from ngramcache.client.tools.sglang_sync import SglangSync
    from ngramcache.client.wire.diagnose import CLI_NAMES

    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert is not None and args.tls_ca is None):
        raise InvalidArgumentError("--tls-cert and --tls-key go together, and with --tls-ca")
    if args.sglang_ca is not None and not os.path.isfile(args.sglang_ca):
        raise InvalidArgumentError(f"--sglang-ca {args.sglang_ca}: no such file")
    headers = _headers(args.sglang_header)
    targets = [SglangTarget(url, api_key=args.sglang_api_key, headers=headers, ca_file=args.sglang_ca)
               for url in args.sglang]
    servers = args.server or [os.environ.get("NGC_SERVER") or DEFAULT_SERVER]
    tokenizer = load_tokenizer_spec(args.tokenizer)
    assert tokenizer is not None  # --tokenizer is required
    printer = _Printer(args.json, args.quiet)
    sync = SglangSync(servers, args.namespace, tokenizer, targets, cache_dir=args.cache_dir, token=args.token,
                      tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, interval=args.interval,
                      max_tokens=args.max_tokens, timeout=args.timeout, load_timeout=args.load_timeout,
                      connect_timeout=args.timeout, on_event=printer)
    try:
        asyncio.run(sync.run())
    except ServiceUnreachableError as e:
        raise NgramCacheError(e.diagnosis.message(CLI_NAMES)) from None
    except ConnectTimeoutError as e:
        raise NgramCacheError(e.message({**CLI_NAMES, "connect_timeout": "--timeout"})) from None
    return 0


class _Printer:
    """The events as lines: results on stdout, notes and errors on stderr; or JSON lines on stdout."""

    def __init__(self, as_json: bool, quiet: bool) -> None:
        self.as_json = as_json
        self.quiet = quiet

    def __call__(self, kind: str, f: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps({"event": kind, "time": _iso_utc(time.time()), **f}), flush=True)
            return
        where = f"{f['server']}: " if "server" in f else ""
        if kind == "error":
            retry = f"; trying again in {f['retry_seconds']:g} s" if "retry_seconds" in f else ""
            if f.get("refused"):
                retry = (f"; not sent to this server again before a newer generation lands or {f['retry_seconds']:g} s "
                         "pass")
            print(f"{where}error: {f['message']}{retry}", file=sys.stderr, flush=True)
        elif kind == "note":
            print(f"{where}note: {f['message']}", file=sys.stderr, flush=True)
        elif self.quiet:
            return
        elif kind == "connected":
            n = len(f["servers"])
            print(f"following namespace {f['namespace']} at {f['service']} for {n} SGLang server{'s' if n > 1 else ''}"
                  f", checking each every {f['interval']:g} s (Ctrl-C stops)", file=sys.stderr, flush=True)
        elif kind == "generation":
            print(f"generation {f['generation']}: {_kept(f)}, {f['tokens']:,} tokens, {f['bytes'] / 1e6:.2f} MB to send "
                  f"to each server{_cut(f)}", flush=True)
        elif kind == "listed":
            how = ("listed already" if not f["bytes"] else
                   f"{'added again (the server had lost it)' if f['re_added'] else 'added'} and listed "
                   f"({f['tokens']:,} tokens, {f['bytes'] / 1e6:.2f} MB sent"
                   + (f", {f['seconds_since_fetched']:.2f} s after the feeder fetched it)" if
                      f["seconds_since_fetched"] is not None else ")"))
            print(f"{where}generation {f['generation']} {how}", flush=True)
        elif kind == "removed":
            print(f"{where}removed {f['corpus_id']}", flush=True)
        elif kind == "recovered":
            print(f"{where}answering again", flush=True)


def _iso_utc(seconds: float) -> str:
    """A Unix time as ISO 8601 in UTC with milliseconds (as serve --log-json writes its lines' "time"): 2026-12-04T19:00:36.455Z."""
    whole = int(seconds)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((seconds - whole) * 1000):03d}Z"


def _documents(n: int) -> str:
    return f"{n:,} document{'' if n == 1 else 's'}"


def _kept(f: dict[str, Any]) -> str:
    if f["documents"] == f["total_documents"]:
        return _documents(f["documents"])
    return f"{f['documents']:,} of its {_documents(f['total_documents'])}"


def _cut(f: dict[str, Any]) -> str:
    """What was cut, in the generation line: documents left out whole, or the end of a first document too long."""
    budget = f"the budget of {f['budget_tokens']:,} tokens (half of --max-tokens)"
    if f["shortened_tokens"]:
        after = f" and the {_documents(f['cut_documents'])} after it" if f["cut_documents"] else ""
        return (f"; its first document alone is past {budget}: its beginning is sent, its last "
                f"{f['shortened_tokens']:,} tokens{after} ({f['cut_tokens']:,} tokens in all) are cut")
    if f["cut_documents"]:
        them = "it" if f["documents"] == 1 else "them"
        return (f"; the {_documents(f['cut_documents'])} after {them} ({f['cut_tokens']:,} tokens) "
                f"{'is' if f['cut_documents'] == 1 else 'are'} cut, whole, past {budget}")
    return ""
