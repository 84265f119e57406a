"""Why a service address does not answer: a raw probe (TCP connect, TLS handshake, HTTP/2 preface) that names the cause and the setting to change.

gRPC reports every failed connection alike (UNAVAILABLE, or a channel that never becomes
ready); `diagnose` opens its own short-lived sockets to the same address and tells the
cases apart: nothing listening, no route, an unknown host, a server that is not gRPC,
plaintext against TLS either way round, a certificate the given CA did not sign or that
names another host, a service that wants a client certificate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ngramcache.client.wire.address import host_port

__all__ = ["CLI_NAMES", "Diagnosis", "diagnose"]

CLI_NAMES = {"address": "--server", "tls_ca": "--tls-ca", "tls_cert": "--tls-cert", "tls_key": "--tls-key"}
"""How the `ngramcache` commands name the settings a `Diagnosis` asks to change."""

_LIBRARY_NAMES = {"address": "address", "tls_ca": "tls_ca", "tls_cert": "tls_cert", "tls_key": "tls_key"}

# The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 3.4): a gRPC server answers
# with a SETTINGS frame of its own.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why ``address`` does not answer, and what to change.

    ``fix`` names the settings as ``{address}``, ``{tls_ca}``, ``{tls_cert}``, ``{tls_key}``, which
    `message` fills in with the caller's names for them (the library's arguments, or the CLI's flags).
    """

    address: str
    cause: str  # what the probe found, e.g. "connection refused: nothing listens on that port"
    fix: str  # what to change, naming settings by placeholder
    permanent: bool  # True: the same settings fail again however long one waits (TLS mismatch, not gRPC)

    def message(self, names: Mapping[str, str] | None = None) -> str:
        """One line: the address, the cause and the fix, settings named as ``names`` says (default: the library's)."""
        return f"cannot reach the service at {self.address}: {self.cause}; {self.fix.format(**{**_LIBRARY_NAMES, **(names or {})})}"


def _resolve(host: str, port: int, timeout: float) -> list[Any] | OSError | None:
    """getaddrinfo bounded by ``timeout`` (it has none of its own): the addresses, the error, or None (no answer in time)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True, name="ngramcache-resolve")
    t.start()
    t.join(timeout)
    return out[0] if out else None


@contextlib.contextmanager
def _connected(infos: list[Any], timeout: float) -> Iterator[socket.socket]:
    """A TCP connection to the first of ``infos`` that accepts one; raises the first address's error if none does."""
    first: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.settimeout(timeout)
            s.connect(sockaddr)
        except OSError as e:
            s.close()
            first = first or e
            continue
        try:
            yield s
        finally:
            s.close()
        return
    raise first or OSError(errno.EHOSTUNREACH, "no address")


def _read_some(s: socket.socket | ssl.SSLSocket, timeout: float) -> bytes | None:
    """Up to 256 bytes the peer sends within ``timeout``: b"" when it closed, None when it sent nothing in time."""
    s.settimeout(timeout)
    try:
        return s.recv(256)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


def _h2_answer(s: socket.socket | ssl.SSLSocket, timeout: float) -> tuple[str, bytes | None]:
    """Sends the HTTP/2 preface and classifies the answer: "h2", "tls", "http1", "other", "closed" or "silent"."""
    try:
        s.sendall(_H2_PREFACE)
    except OSError:
        return "closed", b""
    data = _read_some(s, timeout)
    if data is None:
        return "silent", None
    if not data:
        return "closed", data
    if len(data) >= 9 and data[3] == _SETTINGS:
        return "h2", data
    if data[0] in (0x15, 0x16) and data[1:2] == b"\x03":
        return "tls", data
    if data.startswith(b"HTTP/"):
        return "http1", data
    return "other", data


def _first_line(data: bytes | None) -> str:
    line = (data or b"").split(b"\n", 1)[0].strip()[:60]
    return line.decode("ascii", "replace") if line and all(32 <= b < 127 for b in line) else repr(line)[2:-1]


def _not_grpc(kind: str, data: bytes | None, address: str) -> Diagnosis:
    if kind == "http1":
        cause = f"an HTTP/1 server answered ({_first_line(data)}), not a gRPC service"
    elif kind == "other":
        cause = f"a server that is not a gRPC service answered ({_first_line(data)!r})"
    elif kind == "silent":  # perhaps a gRPC server too loaded to answer: not a reason to stop waiting for it
        return Diagnosis(address, "a server accepted the connection but did not answer HTTP/2 or TLS: not a gRPC "
                         "service, or one too busy to answer", "check the port in {address}", permanent=False)
    else:
        cause = "a server accepted the connection and closed it without an HTTP/2 answer: not a gRPC service"
    return Diagnosis(address, cause, "check the port in {address}", permanent=True)


def _names_in(der: bytes | None) -> tuple[list[str], str]:
    """The DNS/IP names and the issuer's common name of a DER certificate ([], "" when unreadable)."""
    if not der:
        return [], ""
    fd, path = tempfile.mkstemp(suffix=".pem")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ssl.DER_cert_to_PEM_cert(der))
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]  # the stdlib's own decoder
    except Exception:
        return [], ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    names = [v for k, v in decoded.get("subjectAltName", ()) if k in ("DNS", "IP Address")]
    if not names:
        names = [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
    issuer = next((v for rdn in decoded.get("issuer", ()) for k, v in rdn if k == "commonName"), "")
    return names, issuer


def _peer_certificate(infos: list[Any], host: str, timeout: float) -> bytes | None:
    """The server's certificate, read without verifying it (only to name it in a message)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with _connected(infos, timeout) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
            return s.getpeercert(binary_form=True)
    except OSError:
        return None


def _client_context(ca: bytes, cert: str | bytes | None, key: str | bytes | None) -> tuple[ssl.SSLContext, bool]:
    """The probe's TLS context: trusting ``ca``, with the client certificate when one is given and loads
    (the flag says whether it did; gRPC takes PEM bytes, the ssl module files, so bytes go through a
    private temporary folder)."""
    ctx = ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
    ctx.set_alpn_protocols(["h2"])
    if cert is None or key is None:
        return ctx, False
    try:
        if isinstance(cert, str) and isinstance(key, str):
            ctx.load_cert_chain(cert, key)
        else:
            with tempfile.TemporaryDirectory(prefix="ngc-probe-") as folder:
                paths = []
                for name, value in (("cert.pem", cert), ("key.pem", key)):
                    path = os.path.join(folder, name)
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                        f.write(value if isinstance(value, bytes) else Path(value).read_bytes())
                    paths.append(path)
                ctx.load_cert_chain(paths[0], paths[1])
    except (OSError, ssl.SSLError):
        return ctx, False
    return ctx, True


def _tls_speaker(infos: list[Any], host: str, timeout: float) -> bool:
    """Whether the server completes a TLS handshake (any certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with _connected(infos, timeout) as raw, ctx.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ValueError):
        return False


def _verify_failure(e: ssl.SSLCertVerificationError, infos: list[Any], host: str, address: str,
                    timeout: float) -> Diagnosis:
    names, issuer = _names_in(_peer_certificate(infos, host, timeout))
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    by = f" by {issuer}" if issuer else ""
    code = getattr(e, "verify_code", 0)
    if code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
        cause = (f"its TLS certificate is issued for {shown}, not {host}" if names
                 else f"its TLS certificate does not name {host}")
        return Diagnosis(address, cause, "connect by a name the certificate holds ({address}), or reissue the "
                         f"service's certificate for {host}", permanent=True)
    if code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
        return Diagnosis(address, f"its TLS certificate{f' (for {shown})' if names else ''} has expired",
                         "renew the service's certificate", permanent=True)
    what = f"its TLS certificate (for {shown}, issued{by})" if names else "its TLS certificate"
    return Diagnosis(address, f"{what} is not trusted: {getattr(e, 'verify_message', '') or e.reason}",
                     "give {tls_ca} the CA certificate that signed the service's certificate", permanent=True)


def _probe_tls(infos: list[Any], host: str, address: str, ca: bytes, cert: str | bytes | None,
               key: str | bytes | None, timeout: float) -> Diagnosis | None:
    try:
        ctx, with_cert = _client_context(ca, cert, key)
    except (ssl.SSLError, ValueError):
        return Diagnosis(address, "the CA certificates given are not PEM certificates",
                         "give {tls_ca} a PEM file of CA certificates", permanent=True)
    try:
        with _connected(infos, timeout) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
            kind, data = _h2_answer(s, timeout)
            if kind == "h2":
                return None
            if kind == "closed" and cert is not None and not with_cert:
                return None  # the probe could not present the certificate gRPC presents: nothing to conclude
            if kind == "closed" and cert is None:
                return Diagnosis(address, "the service closed the TLS connection, as it does when it requires a "
                                 "client certificate (mutual TLS)", "give {tls_cert} and {tls_key}", permanent=True)
            if kind == "closed":
                return Diagnosis(address, "the service closed the TLS connection: it refuses the client certificate "
                                 "(not signed by the CA it trusts for clients, or not a client certificate)",
                                 "check {tls_cert} and {tls_key}", permanent=True)
            return _not_grpc(kind, data, address)
    except ssl.SSLCertVerificationError as e:
        return _verify_failure(e, infos, host, address, timeout)
    except ssl.SSLError as e:
        if "CERTIFICATE_REQUIRED" in str(e).upper():
            return Diagnosis(address, "the service requires a client certificate (mutual TLS)",
                             "give {tls_cert} and {tls_key}", permanent=True)
        if "ALERT" in str(e).upper() and cert is not None:
            return Diagnosis(address, f"the service refused the TLS handshake ({e.reason or e})",
                             "check {tls_cert} and {tls_key} (a client certificate its CA signed)", permanent=True)
        reason = e.reason or str(e)
    except (ConnectionResetError, BrokenPipeError, TimeoutError) as e:
        reason = "no answer" if isinstance(e, TimeoutError) else "the connection was closed"
    # The TLS handshake failed without a certificate problem: is it a plaintext server?
    try:
        with _connected(infos, timeout) as raw:
            kind, data = _h2_answer(raw, timeout)
    except OSError:
        kind, data = "closed", b""
    if kind == "h2":
        return Diagnosis(address, "the service speaks plaintext and this client TLS",
                         "drop {tls_ca} (or start the service with --tls-cert and --tls-key)", permanent=True)
    if kind in ("http1", "other"):
        return _not_grpc(kind, data, address)
    return Diagnosis(address, f"the TLS handshake failed ({reason}) and the server answers no plaintext HTTP/2 either: "
                     "not a gRPC service", "check the port in {address}", permanent=True)


def _probe_plain(infos: list[Any], host: str, address: str, timeout: float) -> Diagnosis | None:
    with _connected(infos, timeout) as raw:
        kind, data = _h2_answer(raw, timeout)
    if kind == "h2":
        return None
    if kind == "tls" or (kind in ("closed", "silent") and _tls_speaker(infos, host, timeout)):
        return Diagnosis(address, "the service speaks TLS and this client plaintext",
                         "give {tls_ca} the CA certificate that signed the service's certificate", permanent=True)
    return _not_grpc(kind, data, address)


def diagnose(address: str, *, tls_ca: bytes | None = None, tls_cert: str | bytes | None = None,
             tls_key: str | bytes | None = None, timeout: float = 2.0) -> Diagnosis | None:
    """Why a gRPC client with these settings gets no answer from ``address``; None when the probe finds a
    gRPC server that speaks what the client speaks (or the address is not a TCP one: a unix socket).

    Opens a few short-lived connections of its own: TCP connect; with ``tls_ca`` a verified TLS
    handshake, else a test for TLS; the HTTP/2 preface, which a gRPC server answers with SETTINGS.

    Args:
        address: ``HOST:PORT`` (or ``dns:``, ``ipv4:``, ``ipv6:`` targets of one address).
        tls_ca: the PEM CA certificates the client trusts; None: a plaintext client.
        tls_cert, tls_key: the client certificate and key of mutual TLS (paths are used; bytes only say one is given).
        timeout: seconds each step may take.
    """
    target = host_port(address)
    if target is None:
        return None
    host, port = target
    infos = _resolve(host, port, timeout)
    if infos is None:
        return Diagnosis(address, f"the host name {host} did not resolve within {timeout:g} s (DNS does not answer)",
                         "check the host in {address} and this machine's DNS", permanent=False)
    if isinstance(infos, OSError):
        return Diagnosis(address, f"unknown host {host} (the name does not resolve)", "check the host in {address}",
                         permanent=False)
    try:
        with _connected(infos, timeout):
            pass  # refused, unreachable or silent: said below, before any protocol is tried
        if tls_ca is not None:
            return _probe_tls(infos, host, address, tls_ca, tls_cert, tls_key, timeout)
        return _probe_plain(infos, host, address, timeout)
    except ConnectionRefusedError:
        return Diagnosis(address, "connection refused: nothing listens on that port",
                         "is the service running? check the port in {address}", permanent=False)
    except TimeoutError:
        return Diagnosis(address, f"no answer within {timeout:g} s: the host is down or a "
                         "firewall drops the connection", "check the host and port in {address}", permanent=False)
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return Diagnosis(address, "no route to the host", "check the host in {address}", permanent=False)
        return Diagnosis(address, f"cannot connect: {e.strerror or e}", "check {address}", permanent=False)
