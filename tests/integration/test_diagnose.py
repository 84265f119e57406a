"""`diagnose` and `wait_ready` against real loopback listeners: a closed port, servers that are not gRPC, real gRPC servers with and without TLS (certificates from tests/helpers/tls.py)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.tls import Issued, Pki

from ngramcache.client.kernel.errors import BackendUnavailableError, ConnectTimeoutError, ServiceUnreachableError
from ngramcache.client.sync.admin import AdminClient
from ngramcache.client.sync.client import NgramClient
from ngramcache.client.sync.remote import RemoteDrafter
from ngramcache.client.wire.diagnose import CLI_NAMES, diagnose


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Listener:
    """A TCP server on loopback that answers every connection with ``reply`` (after reading what comes) and closes it."""

    def __init__(self, reply: bytes | None, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.reply, self.tls = reply, tls
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen()
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            conn.settimeout(5)
            conn.recv(1024)
            if self.reply:
                conn.sendall(self.reply)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Issued, Issued, Pki]:
    folder = tmp_path_factory.mktemp("pki")
    ca = Pki(folder)
    other = Pki(folder / "other", "other-ca")
    return ca, ca.issue("server"), ca.issue("client", client=True), other


def _grpc_server(credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials is not None
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def plain_server() -> Iterator[str]:
    server, address = _grpc_server()
    yield address
    server.stop(None)


def _tls_credentials(server: Issued, client_ca: Path | None = None) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(server.key.read_bytes(), server.cert.read_bytes())],
                                       root_certificates=client_ca.read_bytes() if client_ca else None,
                                       require_client_auth=client_ca is not None)


@pytest.fixture
def tls_server(pki: tuple[Pki, Issued, Issued, Pki]) -> Iterator[str]:
    server, address = _grpc_server(_tls_credentials(pki[1]))
    yield address
    server.stop(None)


def test_a_closed_port_is_refused_at_once() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    d = diagnose(address)
    assert time.monotonic() - started < 2
    assert d is not None and not d.permanent
    assert d.message() == (f"cannot reach the service at {address}: connection refused: nothing listens on that port; "
                           "is the service running? check the port in address")
    assert d.message(CLI_NAMES).endswith("check the port in --server")


def test_an_unknown_host() -> None:
    d = diagnose("no-such-host.invalid:50051")
    assert d is not None
    assert d.message() == ("cannot reach the service at no-such-host.invalid:50051: unknown host no-such-host.invalid "
                           "(the name does not resolve); check the host in address")


def test_a_host_that_drops_the_connection() -> None:
    """A listener whose accept queue is full: Linux drops the next SYNs, as a firewall that drops packets does."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        queued = []
        for _ in range(8):  # fill the queue until a connect times out
            c = socket.socket()
            c.settimeout(0.3)
            queued.append(c)
            try:
                c.connect(server.getsockname())
            except TimeoutError:
                break
        else:
            pytest.skip("the accept queue never filled")
        try:
            d = diagnose(address, timeout=0.5)
        finally:
            for c in queued:
                c.close()
    assert d is not None and not d.permanent
    assert d.message(CLI_NAMES) == (f"cannot reach the service at {address}: no answer within 0.5 s: the host is down or "
                                    "a firewall drops the connection; check the host and port in --server")


@pytest.mark.parametrize("reply, cause", [
    (b"-ERR unknown command 'PRI', with args beginning with: '*'\r\n",
     "a server that is not a gRPC service answered (\"-ERR unknown command 'PRI', with args beginning with: '*'\")"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
     "an HTTP/1 server answered (HTTP/1.1 400 Bad Request), not a gRPC service"),
    (b"\x00\xff garbage", "a server that is not a gRPC service answered"),
    (None, "a server accepted the connection and closed it without an HTTP/2 answer: not a gRPC service"),
], ids=["redis", "http1", "binary", "closes"])
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext-client", "tls-client"])
def test_a_server_that_is_not_grpc(reply: bytes | None, cause: str, tls: bool,
                                   pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    listener = Listener(reply)
    try:
        d = diagnose(listener.address, tls_ca=pki[0].ca.cert.read_bytes() if tls else None)
    finally:
        listener.close()
    assert d is not None and d.permanent
    if tls and reply is None:
        cause = "the TLS handshake failed"
    assert f"cannot reach the service at {listener.address}: {cause}" in d.message(), d.message()
    assert d.message(CLI_NAMES).endswith("check the port in --server")


def test_a_grpc_server_that_speaks_what_the_client_speaks_has_nothing_to_say(
        plain_server: str, tls_server: str, pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    assert diagnose(plain_server) is None
    assert diagnose(tls_server, tls_ca=pki[0].ca.cert.read_bytes()) is None


def test_a_plaintext_client_to_a_tls_server(tls_server: str) -> None:
    d = diagnose(tls_server)
    assert d is not None and d.permanent
    assert d.message(CLI_NAMES) == (f"cannot reach the service at {tls_server}: the service speaks TLS and this client "
                                    "plaintext; give --tls-ca the CA certificate that signed the service's certificate")


def test_a_tls_client_to_a_plaintext_server(plain_server: str, pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    d = diagnose(plain_server, tls_ca=pki[0].ca.cert.read_bytes())
    assert d is not None and d.permanent
    assert d.message(CLI_NAMES) == (f"cannot reach the service at {plain_server}: the service speaks plaintext and this "
                                    "client TLS; drop --tls-ca (or start the service with --tls-cert and --tls-key)")


def test_a_certificate_another_ca_signed(tls_server: str, pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    d = diagnose(tls_server, tls_ca=pki[3].ca.cert.read_bytes())
    assert d is not None and d.permanent
    assert d.message(CLI_NAMES) == (
        f"cannot reach the service at {tls_server}: its TLS certificate (for localhost, 127.0.0.1, issued by "
        "ngramcache test ca) is not trusted: unable to get local issuer certificate; give --tls-ca the CA certificate "
        "that signed the service's certificate")


def test_a_certificate_for_another_host(pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki[1].cert, pki[1].key)
    listener = Listener(None, host="127.0.0.2", tls=ctx)  # the certificate names localhost and 127.0.0.1
    try:
        d = diagnose(listener.address, tls_ca=pki[0].ca.cert.read_bytes())
    finally:
        listener.close()
    assert d is not None and d.permanent
    assert d.message(CLI_NAMES) == (
        f"cannot reach the service at {listener.address}: its TLS certificate is issued for localhost, 127.0.0.1, not "
        "127.0.0.2; connect by a name the certificate holds (--server), or reissue the service's certificate for 127.0.0.2")


def test_mutual_tls_without_a_client_certificate(pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    server, address = _grpc_server(_tls_credentials(pki[1], client_ca=pki[0].ca.cert))
    try:
        ca = pki[0].ca.cert.read_bytes()
        d = diagnose(address, tls_ca=ca)
        assert d is not None and d.permanent
        assert "requires a client certificate (mutual TLS); give --tls-cert and --tls-key" in d.message(CLI_NAMES)
        assert diagnose(address, tls_ca=ca, tls_cert=str(pki[2].cert), tls_key=str(pki[2].key)) is None
        assert diagnose(address, tls_ca=ca, tls_cert=pki[2].cert.read_bytes(), tls_key=pki[2].key.read_bytes()) is None
        refused = diagnose(address, tls_ca=ca, tls_cert=str(pki[1].cert), tls_key=str(pki[1].key))  # a server's
        assert refused is not None and "it refuses the client certificate" in refused.message(CLI_NAMES)
        assert refused.message(CLI_NAMES).endswith("check --tls-cert and --tls-key")
    finally:
        server.stop(None)


def test_ca_bytes_that_are_no_certificate(plain_server: str) -> None:
    d = diagnose(plain_server, tls_ca=b"not a certificate")
    assert d is not None and d.message(CLI_NAMES) == (f"cannot reach the service at {plain_server}: the CA certificates "
                                                      "given are not PEM certificates; give --tls-ca a PEM file of CA "
                                                      "certificates")



# wait_ready: what AdminClient (and so the CLI) does with a channel that does not become ready


def test_wait_ready_fails_at_once_on_a_refused_connection() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    with AdminClient(address, timeout=10) as admin:
        started = time.monotonic()
        with pytest.raises(ServiceUnreachableError) as e:
            admin.wait_ready()
        took = time.monotonic() - started
    assert took < 2, took  # it waited the whole timeout (10 s) before
    assert str(e.value) == (f"cannot reach the service at {address}: connection refused: nothing listens on that port; "
                            "is the service running? check the port in address")
    assert e.value.retriable


@pytest.mark.parametrize("client_tls", [False, True], ids=["plaintext-client-tls-server", "tls-client-plaintext-server"])
def test_wait_ready_fails_at_once_on_a_tls_mismatch(client_tls: bool, plain_server: str, tls_server: str,
                                                    pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    address = plain_server if client_tls else tls_server
    with AdminClient(address, timeout=10, tls_ca=str(pki[0].ca.cert) if client_tls else None) as admin:
        started = time.monotonic()
        with pytest.raises(ServiceUnreachableError) as e:
            admin.wait_ready()
        assert time.monotonic() - started < 2
    assert ("the service speaks plaintext and this client TLS; drop tls_ca" if client_tls
            else "the service speaks TLS and this client plaintext; give tls_ca") in str(e.value)
    assert not e.value.retriable


def test_wait_ready_returns_for_a_grpc_server(plain_server: str) -> None:
    with AdminClient(plain_server, timeout=10) as admin:
        admin.wait_ready()


def test_wait_ready_times_out_on_a_silent_server_with_what_the_probe_saw() -> None:
    silent = socket.socket()  # accepts (the kernel does), never answers: gRPC keeps connecting
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        with AdminClient(address, timeout=1) as admin, pytest.raises(BackendUnavailableError) as e:
            admin.wait_ready()
    finally:
        silent.close()
    assert f"cannot reach the service at {address}: a server accepted the connection but did not answer" in str(e.value)


def test_a_tls_client_of_a_plaintext_service_prints_its_error_and_nothing_of_grpc(
        plain_server: str, pki: tuple[Pki, Issued, Issued, Pki]) -> None:
    # A fresh interpreter, as a user's: gRPC's C core reads GRPC_VERBOSITY once, at its first import.
    # grpcio 1.85 left to itself prints four "ssl_transport_security.cc:2563] Handshake failed" lines first.
    code = ("from ngramcache.client.sync.client import NgramClient\n"
            "from ngramcache.client.kernel.tokenizer import load_tokenizer\n"
            "try:\n"
            f"    NgramClient({plain_server!r}, 'default', load_tokenizer('tiktoken:cl100k_base'), tls_ca={str(pki[0].ca.cert)!r})\n"
            "except Exception as e:\n"
            "    print(f'{type(e).__name__}: {e}')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"ServiceUnreachableError: cannot reach the service at {plain_server}: the service "
                                  "speaks plaintext and this client TLS; drop tls_ca"), proc.stdout
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                           env={**env, "GRPC_VERBOSITY": "info"})  # the user's level is kept
    assert "Handshake failed" in shown.stderr


# the other clients: RemoteDrafter (its first call) and NgramClient (its constructor)


def test_remote_drafter_says_why_its_session_could_not_open() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    with RemoteDrafter(address, "ns", (bytes(32), 100)) as remote:
        started = time.monotonic()
        with pytest.raises(ServiceUnreachableError) as e:
            remote.draft(1, np.array([1, 2, 3], np.int32))
        assert time.monotonic() - started < 2
    assert str(e.value) == (f"cannot reach the service at {address}: connection refused: nothing listens on that port; "
                            "is the service running? check the port in address")


def test_ngram_client_fails_at_once_when_waiting_cannot_help(tls_server: str, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ServiceUnreachableError) as e:
        NgramClient(tls_server, "ns", (bytes(32), 100), cache_dir=tmp_path, connect_timeout=10)
    assert time.monotonic() - started < 5  # not connect_timeout
    assert str(e.value) == (f"cannot reach the service at {tls_server}: the service speaks TLS and this client "
                            "plaintext; give tls_ca the CA certificate that signed the service's certificate")


def test_ngram_client_says_what_the_probe_saw_at_connect_timeout(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_closed_port()}"  # refused: retried until connect_timeout (a service may be starting)
    with pytest.raises(BackendUnavailableError) as e:
        NgramClient(address, "ns", (bytes(32), 100), cache_dir=tmp_path, connect_timeout=1)
    assert (f"no ngramcache service answered at {address} within 1 s (connect_timeout): cannot reach the service at "
            f"{address}: connection refused: nothing listens on that port") in str(e.value)


def test_the_connect_timeout_error_names_the_settings_as_its_caller_does(tmp_path: Path) -> None:
    """The library names its arguments (address, connect_timeout); a command names its flags."""
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ConnectTimeoutError) as e:
        NgramClient(address, "ns", (bytes(32), 100), cache_dir=tmp_path, connect_timeout=1)
    assert e.value.addresses == (address,) and e.value.timeout == 1 and len(e.value.diagnoses) == 1
    assert str(e.value).endswith("(connect_timeout): cannot reach the service at " + address + ": connection refused: "
                                 "nothing listens on that port; is the service running? check the port in address")
    cli = e.value.message({**CLI_NAMES, "connect_timeout": "--timeout"})
    assert cli == (f"no ngramcache service answered at {address} within 1 s (--timeout): cannot reach the service at "
                   f"{address}: connection refused: nothing listens on that port; is the service running? check the "
                   "port in --server")


def test_sglang_sync_with_the_service_down_names_its_flags() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    done = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", "sglang-sync", "--namespace", "ns",
                           "--tokenizer", "tiktoken:cl100k_base", "--sglang", "http://127.0.0.1:9", "--server", address,
                           "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"ngramcache sglang-sync: error: no ngramcache service answered at {address} within 1 s (--timeout): cannot "
        f"reach the service at {address}: connection refused: nothing listens on that port; is the service running? "
        "check the port in --server"]
