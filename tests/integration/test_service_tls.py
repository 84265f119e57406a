"""TLS and mutual TLS on the whole service (create_server on loopback): who may connect, tokens over mutual TLS,
the clients, the commands and AdminClient over TLS."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.auth import ALPHA, bearer, token, write_tokens_file
from helpers.rpc_calls import FP, VOCAB, Stubs, call_create, call_push, refused, static_file
from helpers.service import ServiceThread
from helpers.tls import Issued, Pki

from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Issued, Issued, Issued]:
    """A CA, its server and client certificates, and a client certificate of another CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca = Pki(folder)
    other = Pki(folder / "other", "other-ca")
    return ca, ca.issue("server"), ca.issue("client", client=True), other.issue("stranger", client=True)


def _health(channel: grpc.Channel) -> int:
    try:
        status: int = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        return status
    finally:
        channel.close()


def _tls(port: int, ca: Path | None, client: Issued | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes() if ca else None,
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None)
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def test_tls_needs_a_tls_client_trusting_the_ca(pki: tuple[Pki, Issued, Issued, Issued], tmp_path: Path) -> None:
    ca, server, _, stranger = pki
    with ServiceThread(tmp_path / "data", tls_cert=str(server.cert), tls_key=str(server.key)) as svc:
        assert _health(_tls(svc.port, ca.ca.cert)) == health_pb2.HealthCheckResponse.SERVING
        # a client certificate is not asked for, and does no harm
        assert _health(_tls(svc.port, ca.ca.cert, stranger)) == health_pb2.HealthCheckResponse.SERVING
        plaintext = refused(lambda: _health(grpc.insecure_channel(f"127.0.0.1:{svc.port}")))
        assert plaintext.code() == grpc.StatusCode.UNAVAILABLE
        untrusted = refused(lambda: _health(_tls(svc.port, None)))  # the system's CAs never signed it
        assert untrusted.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_of_the_client_ca(pki: tuple[Pki, Issued, Issued, Issued],
                                                               tmp_path: Path) -> None:
    ca, server, client, stranger = pki
    with ServiceThread(tmp_path / "data", tls_cert=str(server.cert), tls_key=str(server.key),
                       tls_client_ca=str(ca.ca.cert)) as svc:
        assert _health(_tls(svc.port, ca.ca.cert, client)) == health_pb2.HealthCheckResponse.SERVING
        assert refused(lambda: _health(_tls(svc.port, ca.ca.cert))).code() == grpc.StatusCode.UNAVAILABLE
        assert refused(lambda: _health(_tls(svc.port, ca.ca.cert, stranger))).code() == grpc.StatusCode.UNAVAILABLE
        assert refused(lambda: _health(grpc.insecure_channel(f"127.0.0.1:{svc.port}"))).code() \
            == grpc.StatusCode.UNAVAILABLE


def test_tokens_over_mutual_tls(pki: tuple[Pki, Issued, Issued, Issued], tmp_path: Path) -> None:
    ca, server, client, _ = pki
    tokens = write_tokens_file(tmp_path / "tokens.toml")
    with ServiceThread(tmp_path / "data", tls_cert=str(server.cert), tls_key=str(server.key),
                       tls_client_ca=str(ca.ca.cert), tokens_file=str(tokens)) as svc:
        channel = _tls(svc.port, ca.ca.cert, client)
        s = Stubs(channel, tmp_path)
        assert call_create(s, ALPHA, bearer("admin_all")).created
        call_push(s, ALPHA, bearer("push_alpha"))
        # the certificate alone is no token
        assert refused(lambda: call_push(s, ALPHA, None)).code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()


def test_clients_sync_and_draft_over_tls_and_mutual_tls(pki: tuple[Pki, Issued, Issued, Issued], tmp_path: Path) -> None:
    """NgramClient and RemoteDrafter reach a TLS service trusting its CA, and a mutual-TLS one with a certificate."""

    from ngramcache import NgramClient, RemoteDrafter

    ca, server, client_cert, _ = pki
    fp = bytes(32)
    fast = {"pull_interval": 0.1, "push_interval": 0.05, "ready_timeout": 20.0}
    for mutual in (False, True):
        extra = {"tls_client_ca": str(ca.ca.cert)} if mutual else {}
        mine = {"tls_cert": str(client_cert.cert), "tls_key": str(client_cert.key)} if mutual else {}
        with ServiceThread(tmp_path / f"data-{mutual}", tls_cert=str(server.cert), tls_key=str(server.key),
                           **extra) as svc:
            address = f"127.0.0.1:{svc.port}"
            admin_pb2_grpc.AdminStub(_tls(svc.port, ca.ca.cert, client_cert if mutual else None)).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="tls", tokenizer_fingerprint=fp, vocab_size=16), timeout=10)
            text = np.array([1, 2, 3, 4, 5] * 8, dtype=np.int32)
            with NgramClient(address, "tls", (fp, 16), cache_dir=tmp_path / f"cache-{mutual}", tls_ca=str(ca.ca.cert),
                             **mine, **fast) as a, \
                    NgramClient(address, "tls", (fp, 16), cache_dir=tmp_path / f"cache2-{mutual}",
                                tls_ca=ca.ca.cert.read_bytes(), **mine, **fast) as b:
                a.drafter().accept(1, text)
                deadline = time.monotonic() + 10
                while b.drafter().draft(1, np.array([9, 1, 2, 3], dtype=np.int32), 4).size == 0:
                    assert time.monotonic() < deadline, "B never drafted A's counts over TLS"
                    time.sleep(0.05)
            with RemoteDrafter(address, "tls", (fp, 16), tls_ca=str(ca.ca.cert), **mine) as remote:
                assert remote.draft(1, text, 4).tolist() == [1, 2, 3, 4]


def _cli(*args: object) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_namespace_and_publish_commands_and_admin_client_over_mutual_tls_with_tokens(
        pki: tuple[Pki, Issued, Issued, Issued], tmp_path: Path) -> None:
    from ngramcache import AdminClient, GenerationNotNewerError

    ca, server, client, _ = pki
    tokens = write_tokens_file(tmp_path / "tokens.toml")
    gen1 = tmp_path / "gen1.ngc"
    gen1.write_bytes(static_file(tmp_path, 1))
    with ServiceThread(tmp_path / "data", tls_cert=str(server.cert), tls_key=str(server.key),
                       tls_client_ca=str(ca.ca.cert), tokens_file=str(tokens)) as svc:
        conn = ["--server", f"127.0.0.1:{svc.port}", "--tls-ca", ca.ca.cert, "--tls-cert", client.cert,
                "--tls-key", client.key]
        admin = [*conn, "--token", token("admin_all")]
        r = _cli("namespace", "create", "pub", "--vocab-size", VOCAB, "--fingerprint", FP.hex(), *admin)
        assert r.returncode == 0 and "namespace pub created" in r.stdout, r.stderr
        r = _cli("namespace", "create", "pub", "--vocab-size", VOCAB, "--fingerprint", FP.hex(), *admin)
        assert r.returncode == 0 and "exists already" in r.stdout, r.stderr
        r = _cli("namespace", "create", "pub", "--vocab-size", VOCAB + 1, "--fingerprint", FP.hex(), *admin)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # another tokenizer
        r = _cli("publish", gen1, "--namespace", "pub", *admin)
        assert r.returncode == 0 and "as generation 1 of pub" in r.stdout, r.stderr
        r = _cli("publish", gen1, "--namespace", "pub", *admin)  # the same file again: nothing changes
        assert r.returncode == 0 and "already published as generation 1" in r.stdout, r.stderr
        r = _cli("namespace", "list", *admin)
        assert r.returncode == 0 and "pub" in r.stdout and FP.hex()[:16] in r.stdout, r.stderr
        # the role is checked: a draft token may not publish, create or delete
        for argv in (["publish", gen1, "--namespace", "pub"], ["namespace", "delete", "pub", "--yes"]):
            r = _cli(*argv, *conn, "--token", token("draft_all"))
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert "lacks the admin role" in r.stderr and "pass --token TOKEN or set $NGC_TOKEN to a token with that role" in r.stderr
        r = _cli("publish", gen1, "--namespace", "pub", *conn)  # no token at all
        assert r.returncode == 2 and "requires a bearer token: pass --token TOKEN or set $NGC_TOKEN" in r.stderr, r.stderr
        r = _cli("namespace", "delete", "pub", *admin)  # no --yes
        assert r.returncode == 2 and "--yes" in r.stderr, r.stderr

        # The same operations as a Python API.
        with AdminClient(f"127.0.0.1:{svc.port}", token=token("admin_all"), tls_ca=str(ca.ca.cert),
                         tls_cert=str(client.cert), tls_key=str(client.key)) as api:
            ns = api.get_namespace("pub")
            assert ns.latest_generation == 1 and ns.fingerprint == FP and ns.vocab_size == VOCAB
            gen5, gen4 = tmp_path / "gen5.ngc", tmp_path / "gen4.ngc"
            gen5.write_bytes(static_file(tmp_path, 5))
            gen4.write_bytes(static_file(tmp_path, 4))
            assert api.publish("pub", gen5).generation == 5
            assert api.publish("pub", gen5).already_published
            with pytest.raises(GenerationNotNewerError):
                api.publish("pub", gen4)  # below the latest: the service's error arrives as itself
            assert "pub" in {n.name for n in api.list_namespaces()}
        r = _cli("publish", gen4, "--namespace", "pub", *admin)  # older than the latest
        assert r.returncode == 2 and "not above" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = _cli("namespace", "delete", "pub", "--yes", *admin)
        assert r.returncode == 0 and "namespace pub deleted" in r.stdout, r.stderr
        r = _cli("namespace", "delete", "pub", "--yes", *admin)
        assert r.returncode == 0 and "did not exist" in r.stdout, r.stderr
