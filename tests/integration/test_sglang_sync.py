"""SglangSync and `ngramcache sglang-sync` against a real service and servers answering as SGLang 0.5.23's source does (tests/helpers/sglang_fake.py).

SGLang itself is not run: the contract is its routes, bodies, statuses and token budget, read from its wheel.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.service import ServiceThread, wait_until
from helpers.sglang_fake import FakeSglang
from helpers.tls import Pki

from ngramcache import build_static_from_tokens
from ngramcache.client.kernel.tokenizer import Tokenizer, load_tokenizer
from ngramcache.client.sync.admin import AdminClient
from ngramcache.client.tools.sglang_http import SglangTarget
from ngramcache.client.tools.sglang_sync import SglangSync, corpus_id

pytestmark = pytest.mark.integration

TOKENIZER = "tiktoken:qwen"
MODULES = ("bisect.py", "heapq.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(lib / name).read_text(encoding="utf-8") for name in MODULES]


class Service:
    """A service on loopback with one namespace bound to the tokenizer; publishes generations of real text."""

    def __init__(self, tmp: Path, svc: ServiceThread, tokenizer: Tokenizer, texts: list[str]) -> None:
        self.tmp, self.svc, self.tokenizer, self.texts = tmp, svc, tokenizer, texts
        self.address = f"127.0.0.1:{svc.port}"
        self.namespace = "sgl-" + uuid.uuid4().hex[:8]
        self.admin = AdminClient(self.address, timeout=10)
        self.admin.create_namespace(self.namespace, tokenizer)

    def publish(self, generation: int, documents: int = 3) -> float:
        """Publish a generation whose corpus is ``documents`` of the texts (rotated by generation); returns
        time.time() when the service answered."""
        return self.publish_documents(generation, [self.texts[(generation + i) % len(self.texts)]
                                                   for i in range(documents)])

    def publish_documents(self, generation: int, docs: list[str]) -> float:
        """Publish a generation whose corpus is ``docs``; returns time.time() when the service answered."""
        path = self.tmp / f"g{generation}.ngc"
        build_static_from_tokens([self.tokenizer.encode(d) for d in docs], str(path),
                                 vocab_size=self.tokenizer.vocab_size, fingerprint=self.tokenizer.fingerprint,
                                 generation=generation, corpus_index=True)
        self.admin.publish(self.namespace, path)
        return time.time()


@pytest.fixture
def service(tmp_path: Path, tokenizer: Tokenizer, texts: list[str]) -> Iterator[Service]:
    with ServiceThread(tmp_path / "data") as svc:
        s = Service(tmp_path, svc, tokenizer, texts)
        try:
            yield s
        finally:
            s.admin.close()


class Events:
    """The feeder's events, collected (on_event)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self.lock:
            self.items.append((kind, dict(fields)))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [f for k, f in self.items if k == kind]


def feeder(service: Service, targets: list[SglangTarget], events: Events, **options: Any) -> SglangSync:
    options.setdefault("interval", 0.5)
    return SglangSync(service.address, service.namespace, service.tokenizer, targets,
                      cache_dir=service.tmp / "cache", on_event=events, **options).start()


def black_hole() -> socket.socket:
    """A port that accepts connections (the kernel's backlog) and never answers: a hung server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


# Bounds on how fast the feeder follows: 10x what an idle machine takes, for a loaded one (each waits on its condition;
# the bound is the point). UNBLOCKED stays under the hung server's 30 s timeout: it shows that server holds no one up.
UNBLOCKED = 20.0
ONE_ROUND = 10 * (0.5 + 0.5)  # one 0.5 s interval and the add


def test_generations_follow_the_namespace(service: Service, tokenizer: Tokenizer) -> None:
    ns = service.namespace
    hung = black_hole()
    with FakeSglang(tokenizer) as a, FakeSglang(tokenizer, api_key="k-123") as b:
        landed = service.publish(1)
        events = Events()
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        targets = [SglangTarget(a.url), SglangTarget(b.url, api_key="k-123"), SglangTarget(hung_url)]
        with feeder(service, targets, events, timeout=30.0) as sync:
            # every reachable server lists generation 1 soon after it lands, though one server never answers
            wait_until(lambda: corpus_id(ns, 1) in a.corpora and corpus_id(ns, 1) in b.corpora, UNBLOCKED, "g1 listed")
            assert time.time() - landed < UNBLOCKED
            assert a.corpora[corpus_id(ns, 1)] == sum(len(tokenizer.encode(d)) for d in
                                                      [service.texts[(1 + i) % len(service.texts)]
                                                       for i in range(3)]) + 2  # two separators
            # a new generation: listed, then the old one removed, on both
            landed = service.publish(2)
            wait_until(lambda: set(a.corpora) == set(b.corpora) == {corpus_id(ns, 2)}, UNBLOCKED, "g2 replaces g1")
            assert time.time() - landed < UNBLOCKED
            adds = [r for r in a.requests if r[1] == "/add_external_corpus"]
            removes = [r for r in a.requests if r[1] == "/remove_external_corpus"]
            assert len(adds) == 2 and len(removes) == 1
            first_remove = next(i for i, r in enumerate(a.requests) if r[1] == "/remove_external_corpus")
            assert a.requests[first_remove - 1][1] == "/list_external_corpora"  # removed after the new one was listed
            # a restarted server (its corpora lost) gets ours again at the next round
            a.restart()
            wait_until(lambda: corpus_id(ns, 2) in a.corpora, ONE_ROUND, "g2 re-added after the restart")
            # a server down while a generation lands catches up within one interval after it returns
            b.stop()
            time.sleep(1.5)
            service.publish(3)
            wait_until(lambda: set(a.corpora) == {corpus_id(ns, 3)}, UNBLOCKED, "g3 on the server that is up")
            time.sleep(1.5)  # down for a while: its retries are backed off to the interval
            with b.lock:
                b.corpora = {corpus_id(ns, 2): 10}  # it comes back with what it had
            b.start()
            wait_until(lambda: set(b.corpora) == {corpus_id(ns, 3)}, ONE_ROUND, "g3 on the server back")
            # The corpora change before the syncer has read the reply that changed them: wait for its status
            # to say so (reading it at once flaked: b's error was still the refused connection of its outage).
            wait_until(lambda: {s["url"]: s["error"] for s in sync.status()}[b.url] == "", UNBLOCKED,
                       "b's error cleared")
            status = {s["url"]: s for s in sync.status()}
            assert status[a.url]["generation"] == 3 and status[a.url]["re_adds"] == 1
            assert status[b.url]["generation"] == 3 and status[b.url]["error"] == ""
            assert status[hung_url]["generation"] == 0 and status[hung_url]["adds"] == 0
    hung.close()
    errors = [e["message"] for e in events.of("error")]
    assert any(e.startswith("unreachable") for e in errors), errors
    # b recovered from its outage; the hung server never answered. (a may have too: a round that meets its restart.)
    recovered = [e["server"] for e in events.of("recovered")]
    assert b.url in recovered and hung_url not in recovered, recovered
    assert [e["generation"] for e in events.of("generation")] == [1, 2, 3]
    assert all(e["cut_documents"] == 0 for e in events.of("generation"))


def test_budget_cuts_the_corpus_and_says_what(service: Service, tokenizer: Tokenizer) -> None:
    ns = service.namespace
    service.publish(1, documents=6)
    events = Events()
    with FakeSglang(tokenizer, max_tokens=6000) as a, feeder(service, [SglangTarget(a.url)], events,
                                                             max_tokens=6000):
        wait_until(lambda: corpus_id(ns, 1) in a.corpora, 5.0, "g1 listed")
        ready = events.of("generation")[0]
        assert ready["budget_tokens"] == 3000 and ready["cut_documents"] > 0 and ready["cut_tokens"] > 0
        assert ready["tokens"] <= 3000 and a.corpora[corpus_id(ns, 1)] == ready["tokens"]
        service.publish(2, documents=6)  # room for both during the switch: no removal first
        wait_until(lambda: set(a.corpora) == {corpus_id(ns, 2)}, 5.0, "g2 replaces g1")
        assert not events.of("note")


def test_no_room_beside_other_corpora(service: Service, tokenizer: Tokenizer) -> None:
    """A server whose other corpora leave no room for old and new together: the old one goes first, said; with no
    room at all, an error names the flags."""
    ns = service.namespace
    service.publish(1, documents=2)
    events = Events()
    with FakeSglang(tokenizer) as a:
        with feeder(service, [SglangTarget(a.url)], events):
            wait_until(lambda: corpus_id(ns, 1) in a.corpora, 5.0, "g1 listed")
            with a.lock:
                a.corpora["someone-else"] = a.max_tokens - a.corpora[corpus_id(ns, 1)] - 10
            service.publish(2, documents=2)
            wait_until(lambda: set(a.corpora) == {"someone-else", corpus_id(ns, 2)}, 5.0, "g2 after removing g1")
            notes = [e["message"] for e in events.of("note")]
            assert notes == [f"no room for generation 2's corpus beside {corpus_id(ns, 1)}: removing it first (the "
                             "server drafts from its other corpora meanwhile)"]
            # The feeder is done with generation 2 (added, listed again, said) before its corpus goes: else its own
            # check that the add is listed could see it gone ("added ... but the server does not list it").
            wait_until(lambda: any(e["generation"] == 2 for e in events.of("listed")), 5.0, "g2 said listed")
            with a.lock:
                a.corpora = {"someone-else": a.max_tokens - 10}
            wait_until(lambda: events.of("error"), 5.0, "the refusal")
    message = events.of("error")[0]["message"]
    assert "exceeds the remaining token budget (10) after loading 0 tokens." in message
    assert message.endswith("does not fit beside the server's other corpora (9,999,990 tokens): raise its "
                            "--speculative-ngram-external-corpus-max-tokens, or give a smaller --max-tokens")


def test_a_server_limit_below_max_tokens_is_named_and_a_refused_add_is_not_resent(service: Service,
                                                                                   tokenizer: Tokenizer) -> None:
    """A server run with a corpus limit (1000) far below --max-tokens: SGLang keeps the whole documents that fit, and
    loads nothing when the first is past it. The note names the limit; each refused generation is one error line,
    and its corpus is not sent again every interval."""
    ns = service.namespace
    small = [text[:1200] for text in service.texts[:5]]
    sizes = [len(tokenizer.encode(d)) for d in small]
    assert sizes[0] < 1000 < sum(sizes)
    big = [service.texts[2], service.texts[3]]
    assert min(len(tokenizer.encode(d)) for d in big) > 1000
    events = Events()
    with FakeSglang(tokenizer, max_tokens=1000) as a:
        service.publish_documents(1, small)
        with feeder(service, [SglangTarget(a.url)], events, interval=0.2) as sync:
            wait_until(lambda: corpus_id(ns, 1) in a.corpora, 10.0, "g1 listed")
            wait_until(lambda: events.of("note"), 10.0, "the truncation note")
            note = events.of("note")[0]["message"]
            assert note.startswith(f"SGLang cut generation 1's corpus: Loaded corpus '{corpus_id(ns, 1)}' with ")
            assert note.endswith("(truncated: exceeded 1000 token limit): the server's "
                                 "--speculative-ngram-external-corpus-max-tokens is 1,000, below --max-tokens "
                                 "10,000,000; give --max-tokens 1000 (each corpus is cut to half of it)")
            assert "tokenizer" not in note

            def adds() -> int:
                return sum(1 for r in a.requests if r[1] == "/add_external_corpus")

            def lists() -> int:
                return sum(1 for r in a.requests if r[1] == "/list_external_corpora")

            for gen in (2, 3):  # two generations refused alike: each said once, neither sent again each interval
                service.publish_documents(gen, big)
                wait_until(lambda: any(e.get("generation") == gen for e in events.of("error")), 10.0,  # noqa: B023
                           f"g{gen} refused")
                sent, listed = adds(), lists()
                wait_until(lambda: lists() >= listed + 4, 30.0, "four more rounds")  # noqa: B023
                assert adds() == sent, f"generation {gen}'s corpus was sent again"
                assert set(a.corpora) == {corpus_id(ns, 1)}  # the server keeps drafting from generation 1
                assert sync.status()[0]["error"].startswith(f"generation {gen}'s corpus was refused: ")
    errors = events.of("error")
    assert [e["generation"] for e in errors] == [2, 3], errors
    for e in errors:
        assert e["message"] == (
            f"generation {e['generation']}'s corpus was refused: /add_external_corpus answered 400: External corpus "
            f"is empty — no tokens were loaded. SGLang loaded none of it: its first document ("
            f"{len(tokenizer.encode(big[0])):,} tokens) is past the server's "
            "--speculative-ngram-external-corpus-max-tokens (so is every document: SGLang keeps whole documents), "
            "which is below --max-tokens (10,000,000): give --max-tokens the server's value")
        assert e["status"] == 400 and e["retry_seconds"] == 600


def test_refusals_are_named(service: Service, tokenizer: Tokenizer) -> None:
    service.publish(1)
    events = Events()
    with FakeSglang(tokenizer, api_key="right") as keyed, FakeSglang(tokenizer, ngram=False) as plain:
        targets = [SglangTarget(keyed.url, api_key="wrong"), SglangTarget(plain.url)]
        with feeder(service, targets, events):
            wait_until(lambda: len(events.of("error")) >= 2, 5.0, "two refusals")
    errors = {e["server"]: e for e in events.of("error")}
    assert errors[keyed.url]["status"] == 401
    assert errors[keyed.url]["message"] == ("/list_external_corpora answered 401 Unauthorized: the key was refused; "
                                            "give --sglang-api-key (the server's --admin-api-key, else its --api-key)")
    assert errors[plain.url]["message"] == ("Ngram speculative decoding is not enabled. Run SGLang with "
                                            "--speculative-algorithm NGRAM")
    assert errors[plain.url]["retry_seconds"] == 0.5  # not retried faster than the interval


def test_https_with_a_ca(service: Service, tokenizer: Tokenizer, tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("server")
    service.publish(1)
    events = Events()
    with FakeSglang(tokenizer, tls=(cert.cert, cert.key)) as a:
        assert a.url.startswith("https://")
        with feeder(service, [SglangTarget(a.url, ca_file=str(pki.ca.cert))], events):
            wait_until(lambda: corpus_id(service.namespace, 1) in a.corpora, 5.0, "g1 listed over https")
        untrusted = Events()
        with feeder(service, [SglangTarget(a.url)], untrusted):
            wait_until(lambda: untrusted.of("error"), 5.0, "the refusal")
    assert "its TLS certificate is not trusted" in untrusted.of("error")[0]["message"]
    assert untrusted.of("error")[0]["message"].endswith("give --sglang-ca with the CA that signed it")


# the command


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_command_feeds_and_stops_cleanly_on_ctrl_c(service: Service, tokenizer: Tokenizer) -> None:
    ns = service.namespace
    service.publish(1)
    with FakeSglang(tokenizer, api_key="k") as a:
        env = {**os.environ, "SGLANG_API_KEY": "k"}
        p = subprocess.Popen([sys.executable, "-m", "ngramcache.client.tools.cli", "sglang-sync", "--server",
                              service.address, "--namespace", ns, "--tokenizer", TOKENIZER, "--sglang", a.url,
                              "--interval", "0.5", "--cache-dir", str(service.tmp / "cli-cache"), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            wait_until(lambda: corpus_id(ns, 1) in a.corpora, 10.0, "g1 added by the command")
            added = next(i for i, r in enumerate(a.requests) if r[1] == "/add_external_corpus")
            wait_until(lambda: len(a.requests) > added + 1, 5.0, "the list after the add")
            time.sleep(0.3)  # the event is printed once that list is answered
        finally:
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=10)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ngramcache sglang-sync: interrupted"
    assert "Traceback" not in err
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["event"] for e in events][:3] == ["connected", "generation", "listed"], out
    assert all(e["time"].endswith("Z") for e in events), out  # each event says when (ISO 8601, UTC)


@pytest.mark.parametrize(("args", "message"), [
    (["--sglang", "127.0.0.1:30000"], "--sglang 127.0.0.1:30000: not an http:// or https:// URL with a host "
     "(e.g. http://127.0.0.1:30000)"),
    (["--sglang", "http://127.0.0.1:1", "--namespace", "nope"], "namespace 'nope'"),
])
def test_command_errors_are_one_line(service: Service, args: list[str], message: str) -> None:
    base = {"--server": service.address, "--namespace": service.namespace, "--tokenizer": TOKENIZER,
            "--cache-dir": str(service.tmp / "cli-cache")}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    result = run_cli("sglang-sync", *[x for kv in base.items() for x in kv])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ngramcache sglang-sync: error: "), result.stderr
    assert message in lines[0]
