"""Security files read as the service reads them, with what that takes beyond this process: TLS certificates
issued by openssl (a child process), and the tokens file and --config read with tomli where the standard
library has no tomllib (Python 3.10, simulated in a child process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.tls import Issued, Pki

from ngramcache.cache_service.config import ServiceConfig
from ngramcache.cache_service.security import (
    read_tls_files,
    token_sha256,
    token_toml,
)
from ngramcache.client.kernel.errors import InvalidArgumentError

SECRET = "ngc_this-is-a-secret-token-nobody-may-see"


SHA = token_sha256(SECRET)


def tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    return str(path)


def test_tokens_and_config_files_read_on_python_3_10_with_tomli(tmp_path: Path) -> None:
    """Where the standard library has no tomllib (Python 3.10), the tokens file and --config are read with tomli
    (a dependency there): simulated in a child process with tomllib missing and a tomli that counts its calls."""
    tokens = tokens_file(tmp_path, token_toml(SHA, namespaces=["code"]))
    config = tmp_path / "serve.toml"
    config.write_text(f'tokens_file = "{tokens}"\nport = 7001\n')
    child = textwrap.dedent(f"""
        import sys, types
        import tomllib as real
        sys.modules["tomllib"] = None  # as on Python 3.10: `import tomllib` raises ModuleNotFoundError
        calls = []
        tomli = types.ModuleType("tomli")
        tomli.TOMLDecodeError = real.TOMLDecodeError
        tomli.load = lambda f: calls.append("load") or real.load(f)
        tomli.loads = lambda s: calls.append("loads") or real.loads(s)
        sys.modules["tomli"] = tomli
        from ngramcache.cache_service.config import ServiceConfig
        from ngramcache.cache_service.security import load_tokens
        grant = load_tokens({tokens!r}).grants()[0]
        config = ServiceConfig.load(file={str(config)!r}, environ={{}})
        print(sorted(grant.namespaces), config.port, calls)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['code'] 7001 ['load', 'load', 'load']"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Issued, Issued]:
    folder = tmp_path_factory.mktemp("pki")
    ca = Pki(folder)
    return ca, ca.issue("server"), ca.issue("other-server")


def test_read_tls_files(pki: tuple[Pki, Issued, Issued]) -> None:
    ca, server, _ = pki
    assert read_tls_files(None, None, None) is None
    files = read_tls_files(str(server.cert), str(server.key), None)
    assert files is not None and files.cert == server.cert.read_bytes() and files.key == server.key.read_bytes()
    assert files.client_ca is None
    mutual = read_tls_files(str(server.cert), str(server.key), str(ca.ca.cert))
    assert mutual is not None and mutual.client_ca == ca.ca.cert.read_bytes()


def _tls_error(cert: object, key: object, client_ca: object = None) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        read_tls_files(*(str(p) if p is not None else None for p in (cert, key, client_ca)))
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_read_tls_files_refuses_every_bad_setting_naming_it(pki: tuple[Pki, Issued, Issued], tmp_path: Path) -> None:
    ca, server, other = pki
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(server.key), "-out", str(encrypted), "-aes256", "-passout", "pass:pw"],
                   check=True, capture_output=True)
    mangled = tmp_path / "mangled.pem"
    mangled.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")

    assert _tls_error(server.cert, None) == f"tls_cert {server.cert}: TLS needs both tls_cert and tls_key; tls_key is not set"
    assert _tls_error(None, server.key) == f"tls_key {server.key}: TLS needs both tls_cert and tls_key; tls_cert is not set"
    assert _tls_error(None, None, ca.ca.cert) == (f"tls_client_ca {ca.ca.cert}: mutual TLS needs tls_cert and tls_key "
                                                  "as well")
    assert _tls_error(tmp_path / "none.pem", server.key) == f"tls_cert {tmp_path / 'none.pem'}: no such file"
    assert _tls_error(server.cert, tmp_path) == f"tls_key {tmp_path}: is a folder, not a PEM file"
    assert _tls_error(garbage, server.key).startswith(f"tls_cert {garbage}: not a PEM file with a certificate")
    assert _tls_error(server.cert, server.cert).startswith(f"tls_key {server.cert}: not a PEM file with a private key")
    assert _tls_error(server.key, server.key).startswith(f"tls_cert {server.key}: not a PEM file with a certificate")
    assert _tls_error(server.cert, encrypted).startswith(f"tls_key {encrypted}: the key is encrypted")
    assert _tls_error(server.cert, other.key) == f"tls_key {other.key}: not the private key of tls_cert {server.cert}"
    assert _tls_error(mangled, server.key).startswith(f"tls_cert {mangled} / tls_key {server.key}: not a usable")
    assert _tls_error(server.cert, server.key, garbage).startswith(f"tls_client_ca {garbage}: not a PEM file")
    assert _tls_error(server.cert, server.key, mangled).startswith(f"tls_client_ca {mangled}: not usable CA")


def test_settings_check_the_security_files(pki: tuple[Pki, Issued, Issued], tmp_path: Path) -> None:
    _, server, _ = pki
    with pytest.raises(InvalidArgumentError, match="^tls_key .*: not a PEM file with a private key"):
        ServiceConfig(tls_cert=str(server.cert), tls_key=str(server.cert))
    with pytest.raises(InvalidArgumentError, match="^tokens_file .*: no such file"):
        ServiceConfig(tokens_file=str(tmp_path / "missing.toml"))
    path = tokens_file(tmp_path, token_toml(SHA))
    assert ServiceConfig(tokens_file=path).tokens_file == path
    env = ServiceConfig.load(environ={"NGC_TOKENS_FILE": path, "NGC_TLS_CERT": str(server.cert),
                                      "NGC_TLS_KEY": str(server.key)})
    assert (env.tokens_file, env.tls_cert, env.tls_key, env.tls_client_ca) == (path, str(server.cert), str(server.key), None)


def test_a_network_address_needs_tls_or_an_explicit_plaintext_choice(pki: tuple[Pki, Issued, Issued]) -> None:
    _, server, _ = pki
    with pytest.raises(InvalidArgumentError, match="not a loopback address: serving the network needs TLS"):
        ServiceConfig(host="0.0.0.0")
    assert ServiceConfig(host="0.0.0.0", allow_insecure_remote=True).host == "0.0.0.0"
    assert ServiceConfig(host="0.0.0.0", tls_cert=str(server.cert), tls_key=str(server.key)).host == "0.0.0.0"
    assert ServiceConfig(host="::", tls_cert=str(server.cert), tls_key=str(server.key)).host == "::"
