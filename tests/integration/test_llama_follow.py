"""`ngramcache llama-follow` against the real service on loopback: a llama-server moved to each new generation with no failed request.

Most tests run a stand-in for llama-server (tests/helpers/llama_stand_in.py: llama-server's
flags and routes, no model; every answer names the -lcs file it read), so the switching runs
on every CI run; the last one runs the real llama-server when tests/bench/engines/build_llama_server.py
has built it, and is skipped, saying so, when it has not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.corpus import FP, VOCAB
from helpers.corpus import motif_corpus as corpus
from helpers.service import ServiceThread, wait_until

from ngramcache import AdminClient, StaticCache, build_static_from_tokens, export_llama

pytestmark = pytest.mark.integration

STAND_IN = Path(__file__).resolve().parents[1] / "helpers" / "llama_stand_in.py"
CLI = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    code, raw, _ = http_headers(url, body, timeout)
    return code, raw


def http_headers(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, bytes, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


@dataclass
class Fleet:
    tmp: Path
    svc: ServiceThread
    admin: AdminClient
    namespace: str = "llama"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.svc.port}"

    def publish(self, generation: int) -> str:
        """Publishes a generation; returns the SHA-256 of its llama.cpp export (what the -lcs file must hold)."""
        path = self.tmp / f"gen{generation}.ngc"
        build_static_from_tokens([corpus(generation * 10 + i) for i in range(3)], str(path), vocab_size=VOCAB,
                                 ngram_size=2, fingerprint=FP, generation=generation)
        self.admin.publish(self.namespace, path)
        lcs = self.tmp / f"gen{generation}.lcs"
        export_llama(StaticCache.open(str(path)), str(lcs))
        return hashlib.sha256(lcs.read_bytes()).hexdigest()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with ServiceThread(tmp_path / "service") as svc:
        admin = AdminClient(f"127.0.0.1:{svc.port}", timeout=30)
        admin.create_namespace("llama", (FP, VOCAB))
        try:
            yield Fleet(tmp_path, svc, admin)
        finally:
            admin.close()


@dataclass
class Follower:
    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def status(self) -> dict[str, Any]:
        code, body = http(f"{self.url}/ngramcache/status")
        assert code == 200, body
        return json.loads(body)

    def read_stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def start_follower(fleet: Fleet, *extra: str, server: list[str] | None = None, address: str | None = None,
                   env: dict[str, str] | None = None) -> Follower:
    port = free_port()
    command = server or [sys.executable, str(STAND_IN), "--spec-type", "ngram-cache"]
    proc = subprocess.Popen([*CLI, "llama-follow", "--server", address or fleet.address, "--namespace", fleet.namespace,
                             "--vocab-size", str(VOCAB), "--fingerprint", FP.hex(), "--lcs",
                             str(fleet.tmp / "static.lcs"), "--cache-dir", str(fleet.tmp / "cache"), "--listen",
                             f"127.0.0.1:{port}", *extra, "--", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "NGC_TOKEN"}, **(env or {})})
    return Follower(proc, f"http://127.0.0.1:{port}")


def wait_ready(f: Follower, timeout: float = 30) -> None:
    def ready() -> bool:
        if f.proc.poll() is not None:
            raise AssertionError(f"llama-follow exited with {f.proc.returncode}: {f.read_stderr()}")
        try:
            return http(f"{f.url}/health", timeout=2)[0] == 200
        except OSError:
            return False

    wait_until(ready, timeout, "llama-follow's /health 200")


def stop(f: Follower, sig: int = signal.SIGTERM) -> tuple[int, str]:
    if f.proc.poll() is None:
        f.proc.send_signal(sig)
    try:
        code = f.proc.wait(30)
    except subprocess.TimeoutExpired:
        f.proc.kill()
        raise
    return code, f.read_stderr()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Traffic:
    """A client thread sending completions (plain and streamed, some slow) through the proxy until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, str | None, int, str]] = []  # (time, lcs sha, pid, X-Ngramcache-Generation)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            body = {"delay": 0.3 if i % 5 == 0 else 0.01, "stream": i % 3 == 0}
            i += 1
            try:
                code, raw, headers = http_headers(f"{self.url}/completion", body)
            except OSError as e:
                self.failures.append(f"request {i}: {e}")
                continue
            if code != 200:
                self.failures.append(f"request {i}: {code} {raw[:200]!r}")
                continue
            if body["stream"]:
                events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
                if [e["index"] for e in events] != [0, 1, 2]:
                    self.failures.append(f"request {i}: a cut stream {raw!r}")
                    continue
                answer = events[0]
            else:
                answer = json.loads(raw)
            self.answers.append((time.monotonic(), answer["lcs_sha256"], answer["pid"],
                                 headers.get("X-Ngramcache-Generation")))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def last(self) -> str | None:
        return self.answers[-1][1] if self.answers else None


@pytest.mark.parametrize("switch", ["overlap", "restart"])
def test_a_new_generation_is_served_with_no_failed_request(fleet, switch):
    sha1 = fleet.publish(1)
    f = start_follower(fleet, "--switch", switch)
    try:
        wait_ready(f)
        status = f.status()
        assert status["generation"] == 1 and status["written"] == 1, status
        assert (fleet.tmp / "static.lcs").read_bytes() and hashlib.sha256(
            (fleet.tmp / "static.lcs").read_bytes()).hexdigest() == sha1
        traffic = Traffic(f.url)
        wait_until(lambda: len(traffic.answers) >= 5, 20, "answers from generation 1")
        first_pid = traffic.answers[-1][2]
        sha2 = fleet.publish(2)
        landed = time.monotonic()
        wait_until(lambda: traffic.last() == sha2, 30, "an answer from generation 2")
        served_after = traffic.answers[-1][0] - landed
        n_at_switch = len(traffic.answers)
        wait_until(lambda: len(traffic.answers) >= n_at_switch + 5, 20, "answers after the switch")
        wait_until(lambda: not alive(first_pid), 30, "the old server stopped")
        traffic.stop()
        assert traffic.failures == []
        shas = [a[1] for a in traffic.answers]
        assert set(shas) == {sha1, sha2}
        assert shas.index(sha2) > 0 and set(shas[shas.index(sha2):]) == {sha2}  # never back to generation 1
        assert {(a[1], a[3]) for a in traffic.answers} == {(sha1, "1"), (sha2, "2")}  # the header names the file read
        status = f.status()
        assert status["generation"] == 2 and status["switches"] == 1 and status["failed_requests"] == 0, status
        assert served_after < 10, served_after
        code, err = stop(f)
        assert code == 0, err
        assert re.search(r"generation 2 served [\d.]+ s after it was installed", err), err
        assert "Traceback" not in err
        assert not alive(traffic.answers[-1][2])
    finally:
        if f.proc.poll() is None:
            f.proc.kill()


def test_health_follows_the_server_and_a_crashed_server_is_started_again(fleet):
    fleet.publish(1)
    f = start_follower(fleet, server=[sys.executable, str(STAND_IN), "--spec-type", "ngram-cache",
                                      "--load-seconds", "1.5"])
    try:
        codes = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                code, body = http(f"{f.url}/health", timeout=2)
            except OSError:
                continue  # the proxy is not listening yet
            codes.add(code)
            if code == 200:
                break
            assert code == 503 and b"unavailable_error" in body, (code, body)
            time.sleep(0.05)
        assert codes == {503, 200}, codes  # not ready while the server loads, ready once it is
        pid = json.loads(http(f"{f.url}/completion", {})[1])["pid"]
        # The server dies with the request, answering nothing: the proxy waits for the server started again and
        # sends the request to it, which answers.
        code, body = http(f"{f.url}/crash", {"pid": pid}, timeout=60)
        assert code == 200, body
        assert json.loads(body) == {"crashed": False, "pid": json.loads(body)["pid"]} and json.loads(body)["pid"] != pid
        code, body = http(f"{f.url}/completion", {})
        assert code == 200, body
        assert f.status()["restarts"] == 1
        code, err = stop(f)
        assert code == 0 and "exited with status 3: starting it again" in err, err
    finally:
        if f.proc.poll() is None:
            f.proc.kill()


def test_ctrl_c_stops_the_server_and_says_so_in_one_line(fleet):
    fleet.publish(1)
    f = start_follower(fleet)
    try:
        wait_ready(f)
        pid = json.loads(http(f"{f.url}/completion", {})[1])["pid"]
        code, err = stop(f, signal.SIGINT)
        assert code == 130, err
        assert err.splitlines()[-1] == "ngramcache llama-follow: interrupted: llama-server stopped", err
        assert "Traceback" not in err
        assert not alive(pid)
    finally:
        if f.proc.poll() is None:
            f.proc.kill()


def test_an_unreachable_service_never_stops_the_server(fleet):
    """Started before any service answers, llama-server serves without a generation; the follower connects later."""
    port = free_port()
    f = start_follower(fleet, "--connect-timeout", "0.5", address=f"127.0.0.1:{port}")
    try:
        wait_ready(f)
        answer = json.loads(http(f"{f.url}/completion", {})[1])
        assert answer["lcs_sha256"] is None  # no -lcs file: no generation yet
        assert f.status()["generation"] == 0
    finally:
        code, err = stop(f)
    assert code == 0, err
    assert "llama-server starts without a generation, the service is tried again every 10 s" in err, err


def test_a_server_that_cannot_start_is_one_line_and_exit_2(fleet):
    f = start_follower(fleet, server=[sys.executable, str(STAND_IN), "--spec-type", "ngram-cache", "--fail"])
    code = f.proc.wait(60)
    err = f.read_stderr()
    assert code == 2, err
    assert err.splitlines()[-1] == ("ngramcache llama-follow: error: llama-server exited with status 1 before /health "
                                    "answered 200 (its output is above) (the command after '--')"), err
    assert "Traceback" not in err


def test_what_the_service_refuses_is_one_line_naming_the_flag(tmp_path):
    """No token, a wrong token, a namespace that does not exist: exit 2 before llama-server starts, saying what to pass."""
    from helpers.auth import token, write_tokens_file

    with ServiceThread(tmp_path / "service", tokens_file=str(write_tokens_file(tmp_path / "tokens.toml"))) as svc:
        with AdminClient(f"127.0.0.1:{svc.port}", token=token("admin_all"), timeout=30) as admin:
            admin.create_namespace("llama", (FP, VOCAB))
        fleet = Fleet(tmp_path, svc, admin)
        address = fleet.address
        cases = [
            ({}, (), f"the service at {address} requires a bearer token: pass --token TOKEN or set $NGC_TOKEN (a "
                     "token with the draft role on the namespace)"),
            ({"NGC_TOKEN": "wrong-token-" + "x" * 20}, (), f"the service at {address} refused the token: unknown "
             "bearer token (sha256:"),
            ({"NGC_TOKEN": token("draft_all")}, ("--namespace", "nope"),
             f"namespace 'nope' does not exist on the service at {address}: create it (ngramcache namespace create) or "
             "give another --namespace"),
        ]
        for extra_env, extra, expected in cases:
            f = start_follower(fleet, *extra, env=extra_env)
            code = f.proc.wait(60)
            err = f.read_stderr()
            assert code == 2, err
            assert len(err.strip().splitlines()) == 1 and err.startswith(f"ngramcache llama-follow: error: {expected}"), err


@pytest.mark.parametrize("live_first", [False, True])
def test_server_is_repeatable_for_failover(fleet, live_first):
    """--server A --server B, one of them answering nothing: the follower serves the generation of the one that does."""
    sha1 = fleet.publish(1)
    dead = f"127.0.0.1:{free_port()}"
    first, second = (fleet.address, dead) if live_first else (dead, fleet.address)
    f = start_follower(fleet, "--server", second, address=first)
    try:
        wait_ready(f)
        assert json.loads(http(f"{f.url}/completion", {})[1])["lcs_sha256"] == sha1
    finally:
        code, err = stop(f)
    assert code == 0, err


def built_llama_server() -> Path:
    """The llama-server tests/bench/engines/build_llama_server.py caches, or a skip saying how to build it."""
    from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, TARGET, server_dir

    binary = server_dir(DEFAULT_CACHE, SERVER_CMAKE_ARGS) / TARGET
    if not binary.is_file():
        pytest.skip(f"{binary} is not built: python tests/bench/engines/build_llama_server.py (6-8 min on 2 cores)")
    return binary


@pytest.mark.slow
def test_the_real_llama_server_switches_with_no_failed_request(fleet):
    """The real llama-server (SmolLM2-135M) behind llama-follow: completions all along, a new generation, none failed."""
    binary = built_llama_server()
    from helpers.model import smollm2_gguf

    try:
        model = smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fleet.publish(1)
    f = start_follower(fleet, server=[str(binary), "-m", str(model), "--spec-type", "ngram-cache", "-np", "2", "-c",
                                      "1024", "-t", "2", "--no-webui"])
    answers: list[str] = []
    failures: list[str] = []
    stopping = threading.Event()

    def client() -> None:
        while not stopping.is_set():
            try:
                code, raw, headers = http_headers(f"{f.url}/completion", {"prompt": "def add(a, b):", "n_predict": 4,
                                                                         "temperature": 0})
            except OSError as e:
                failures.append(str(e))
                continue
            if code != 200 or "content" not in json.loads(raw):
                failures.append(f"{code} {raw[:200]!r}")
            else:
                answers.append(headers.get("X-Ngramcache-Generation"))

    try:
        wait_ready(f, 120)
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        wait_until(lambda: len(answers) >= 3, 60, "answers from generation 1")
        fleet.publish(2)
        wait_until(lambda: answers[-1:] == ["2"], 120, "an answer from generation 2")
        n = len(answers)
        wait_until(lambda: len(answers) >= n + 3, 60, "answers after the switch")
        stopping.set()
        thread.join(60)
        assert failures == []
        assert answers[0] == "1" and answers[-1] == "2" and answers.index("2") > 0
        assert f.status()["switches"] == 1
    finally:
        stopping.set()
        code, err = stop(f)
    assert code == 0, err[-3000:]


def test_ctrl_c_while_the_model_loads_stops_at_once(fleet):
    """A server that takes long to load does not hold up Ctrl-C (nor a SIGTERM): it is stopped, exit 130."""
    fleet.publish(1)
    f = start_follower(fleet, server=[sys.executable, str(STAND_IN), "--spec-type", "ngram-cache",
                                      "--load-seconds", "60"])
    try:
        wait_until(lambda: _answers(f"{f.url}/health") == 503, 30, "the proxy answering 503 while the model loads")
        t0 = time.monotonic()
        code, err = stop(f, signal.SIGINT)
        assert time.monotonic() - t0 < 10, err
        assert code == 130, err
        assert err.splitlines()[-1] == "ngramcache llama-follow: interrupted: llama-server stopped", err
    finally:
        if f.proc.poll() is None:
            f.proc.kill()


def _answers(url: str) -> int:
    try:
        return http(url, timeout=2)[0]
    except OSError:
        return 0


def test_ctrl_c_during_a_drain_stops_the_old_server_too(fleet):
    """An old server still finishing a long request after a switch is stopped at once by Ctrl-C, not after it."""
    fleet.publish(1)
    f = start_follower(fleet)
    try:
        wait_ready(f)
        old_pid = json.loads(http(f"{f.url}/completion", {})[1])["pid"]
        slow = threading.Thread(target=lambda: _quietly(lambda: http(f"{f.url}/completion", {"delay": 60}, 90)),
                                daemon=True)
        slow.start()
        time.sleep(0.3)  # the slow request reached the old server
        fleet.publish(2)
        wait_until(lambda: f.status()["generation"] == 2, 30, "the switch to generation 2")
        assert alive(old_pid)  # draining: its request is not done
        t0 = time.monotonic()
        code, err = stop(f, signal.SIGINT)
        assert code == 130 and time.monotonic() - t0 < 15, err
        wait_until(lambda: not alive(old_pid), 10, "the old server stopped")
    finally:
        if f.proc.poll() is None:
            f.proc.kill()


def _quietly(call: Any) -> None:
    try:
        call()
    except OSError:
        pass  # cut by the Ctrl-C: expected
