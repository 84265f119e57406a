"""Test certificates made with the `openssl` command: a CA, a server certificate for 127.0.0.1 and localhost, client certificates.

    pki = Pki(tmp_path)            # a CA in tmp_path
    server = pki.issue("server")   # Issued(cert=..., key=...): paths of PEM files
    client = pki.issue("client", client=True)

Every key is P-256 EC, unencrypted; certificates are valid for a day.
"""

from __future__ import annotations

import dataclasses
import secrets
import subprocess
from pathlib import Path

__all__ = ["Issued", "Pki"]

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
authorityKeyIdentifier = keyid
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclasses.dataclass(frozen=True)
class Issued:
    """Paths of a PEM certificate and its unencrypted PEM private key."""

    cert: Path
    key: Path


class Pki:
    """A throwaway certificate authority in `folder` (files named after `name`)."""

    def __init__(self, folder: Path, name: str = "ca") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._config = folder / f"{name}.cnf"
        self._config.write_text(_CONFIG)
        self.ca = Issued(folder / f"{name}.pem", folder / f"{name}.key")
        _openssl("req", "-x509", "-config", str(self._config), "-extensions", "ca", "-newkey", "ec",
                 "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(self.ca.key), "-out", str(self.ca.cert),
                 "-days", "1", "-subj", f"/CN=ngramcache test {name}")

    def issue(self, name: str, *, client: bool = False) -> Issued:
        """A certificate signed by this CA: for a server (127.0.0.1, localhost) or, with `client`, a client."""
        out = Issued(self.folder / f"{name}.pem", self.folder / f"{name}.key")
        csr = self.folder / f"{name}.csr"
        _openssl("req", "-new", "-config", str(self._config), "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-nodes", "-keyout", str(out.key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca.cert), "-CAkey", str(self.ca.key),
                 "-set_serial", "0x" + secrets.token_hex(8), "-days", "1", "-out", str(out.cert),
                 "-extfile", str(self._config), "-extensions", "client" if client else "server")
        return out
