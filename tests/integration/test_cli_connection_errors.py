"""The admin commands (`namespace`, `publish`, `rebuild`) against every way a connection goes wrong: one line naming the address, the cause and the flag, at once; no gRPC log lines.

The commands run in this process (`cache_service.cli.main`, timed) against real services on
loopback (`ServiceThread`: plaintext, TLS, bearer tokens) and plain sockets; one runs as the
console script does (`entry.main`, a child process) to see what reaches a terminal.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.auth import token, write_tokens_file
from helpers.service import ServiceThread
from helpers.tls import Issued, Pki

from ngramcache.cache_service.cli import main

pytestmark = pytest.mark.integration

ENTRY = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NGC_TOKEN", raising=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Issued, Pki]:
    folder = tmp_path_factory.mktemp("pki")
    ca = Pki(folder)
    return ca, ca.issue("server"), Pki(folder / "other", "other-ca")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ServiceThread(tmp_path_factory.mktemp("plain") / "data") as svc:
        yield f"127.0.0.1:{svc.port}"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, pki: tuple[Pki, Issued, Pki]) -> Iterator[str]:
    with ServiceThread(tmp_path_factory.mktemp("tls") / "data", tls_cert=str(pki[1].cert), tls_key=str(pki[1].key)) as svc:
        yield f"127.0.0.1:{svc.port}"


@pytest.fixture(scope="module")
def with_tokens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tokens")
    with ServiceThread(folder / "data", tokens_file=str(write_tokens_file(folder / "tokens.toml"))) as svc:
        yield f"127.0.0.1:{svc.port}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, float]:
    """Runs `ngramcache ARGV...` in this process: (exit status, stderr, seconds)."""
    capsys.readouterr()
    started = time.monotonic()
    rc = main(list(argv))
    took = time.monotonic() - started
    return rc, capsys.readouterr().err, took


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", [["namespace", "list"], ["namespace", "delete", "x", "--yes"],
                                     ["rebuild", "--namespace", "x"]], ids=["namespace-list", "namespace-delete", "rebuild"])
def test_a_refused_connection_fails_at_once(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    address = f"127.0.0.1:{closed_port()}"
    rc, err, took = run(capsys, *command, "--server", address)
    assert rc == 2
    assert took < 2, took  # the whole --timeout (10 s) before
    assert one_line(err).endswith(f": error: cannot reach the service at {address}: connection refused: nothing listens "
                                  "on that port; is the service running? check the port in --server")


@pytest.mark.parametrize("server, message", [
    ("http://127.0.0.1:50051", "--server http://127.0.0.1:50051: no URL scheme is taken (http://); give HOST:PORT, e.g. "
                               "127.0.0.1:50051 (or a gRPC target such as dns:///HOST:PORT)"),
    ("https://cache.internal:443", "--server https://cache.internal:443: no URL scheme is taken (https://); give "
                                   "HOST:PORT, e.g. cache.internal:443 (or a gRPC target such as dns:///HOST:PORT); for "
                                   "TLS give --tls-ca"),
    ("grpc://127.0.0.1:50051", "--server grpc://127.0.0.1:50051: no URL scheme is taken (grpc://); give HOST:PORT, e.g. "
                               "127.0.0.1:50051 (or a gRPC target such as dns:///HOST:PORT)"),
    ("127.0.0.1", "--server 127.0.0.1 has no port: give HOST:PORT, e.g. 127.0.0.1:50051 (50051 is what `ngramcache "
                  "serve` listens on by default)"),
])
def test_an_address_that_is_not_host_port(capsys: pytest.CaptureFixture[str], server: str, message: str) -> None:
    rc, err, took = run(capsys, "namespace", "list", "--server", server)
    assert rc == 2 and took < 2
    assert one_line(err) == f"ngramcache namespace: error: {message}"


def test_an_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = run(capsys, "namespace", "list", "--server", "no-such-host.invalid:50051")
    assert rc == 2
    assert one_line(err) == ("ngramcache namespace: error: cannot reach the service at no-such-host.invalid:50051: "
                             "unknown host no-such-host.invalid (the name does not resolve); check the host in --server")


def test_a_port_where_an_http1_server_listens(capsys: pytest.CaptureFixture[str]) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    address = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        rc, err, took = run(capsys, "namespace", "list", "--server", address)
    finally:
        srv.close()
    assert rc == 2 and took < 2
    assert one_line(err) == (f"ngramcache namespace: error: cannot reach the service at {address}: an HTTP/1 server "
                             "answered (HTTP/1.1 400 Bad Request), not a gRPC service; check the port in --server")


def test_a_plaintext_client_to_a_tls_service(capsys: pytest.CaptureFixture[str], tls: str) -> None:
    rc, err, took = run(capsys, "namespace", "list", "--server", tls)
    assert rc == 2 and took < 2
    assert one_line(err) == (f"ngramcache namespace: error: cannot reach the service at {tls}: the service speaks TLS "
                             "and this client plaintext; give --tls-ca the CA certificate that signed the service's "
                             "certificate")


def test_a_tls_client_to_a_plaintext_service(capsys: pytest.CaptureFixture[str], plain: str,
                                             pki: tuple[Pki, Issued, Pki]) -> None:
    rc, err, took = run(capsys, "namespace", "list", "--server", plain, "--tls-ca", str(pki[0].ca.cert))
    assert rc == 2 and took < 2
    assert one_line(err) == (f"ngramcache namespace: error: cannot reach the service at {plain}: the service speaks "
                             "plaintext and this client TLS; drop --tls-ca (or start the service with --tls-cert and "
                             "--tls-key)")


def test_a_ca_that_did_not_sign_the_service_certificate(capsys: pytest.CaptureFixture[str], tls: str,
                                                        pki: tuple[Pki, Issued, Pki]) -> None:
    rc, err, took = run(capsys, "namespace", "list", "--server", tls, "--tls-ca", str(pki[2].ca.cert))
    assert rc == 2 and took < 2
    assert one_line(err) == (f"ngramcache namespace: error: cannot reach the service at {tls}: its TLS certificate (for "
                             "localhost, 127.0.0.1, issued by ngramcache test ca) is not trusted: unable to get local "
                             "issuer certificate; give --tls-ca the CA certificate that signed the service's certificate")


def test_the_right_settings_still_work(capsys: pytest.CaptureFixture[str], plain: str, tls: str,
                                       pki: tuple[Pki, Issued, Pki]) -> None:
    assert run(capsys, "namespace", "list", "--server", plain)[0] == 0
    assert run(capsys, "namespace", "list", "--server", tls, "--tls-ca", str(pki[0].ca.cert))[0] == 0


def test_no_token_names_the_flag_and_the_variable(capsys: pytest.CaptureFixture[str], with_tokens: str) -> None:
    rc, err, _ = run(capsys, "namespace", "list", "--server", with_tokens)
    assert rc == 2
    assert one_line(err) == (f"ngramcache namespace: error: the service at {with_tokens} requires a bearer token: pass "
                             "--token TOKEN or set $NGC_TOKEN (a token with the admin role)")


def test_an_unknown_token_names_the_flag_and_the_variable(capsys: pytest.CaptureFixture[str], with_tokens: str) -> None:
    rc, err, _ = run(capsys, "namespace", "list", "--server", with_tokens, "--token", "not-a-configured-token-0123456789")
    assert rc == 2
    line = one_line(err)
    assert line.startswith(f"ngramcache namespace: error: the service at {with_tokens} refused the token: unknown "
                           "bearer token (sha256:"), line
    assert line.endswith("; pass --token TOKEN or set $NGC_TOKEN to a token in its tokens file, with the admin role")
    assert "not-a-configured-token" not in line


def test_a_token_without_the_role_names_the_role(capsys: pytest.CaptureFixture[str], with_tokens: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NGC_TOKEN", token("draft_all"))
    rc, err, _ = run(capsys, "namespace", "delete", "x", "--yes", "--server", with_tokens)
    assert rc == 2
    assert one_line(err) == (f"ngramcache namespace: error: the service at {with_tokens} refused the call: token "
                             "'draft_all' lacks the admin role that Admin.DropNamespace needs (it has: draft); pass "
                             "--token TOKEN or set $NGC_TOKEN to a token with that role")


def test_the_console_script_prints_no_grpc_log_lines(tls: str, tmp_path: Path) -> None:
    r = subprocess.run([*ENTRY, "namespace", "list", "--server", tls], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"ngramcache namespace: error: cannot reach the service at {tls}: the service speaks "
                                     "TLS and this client plaintext; give --tls-ca the CA certificate that signed the "
                                     "service's certificate"], r.stderr
