"""Bearer tokens (their hashes, roles and namespaces) and the TLS credentials of the service.

Tokens never appear in configuration: the tokens file (``tokens_file``, TOML) lists the
SHA-256 of each token with the roles and namespaces it grants, and ``ngramcache
token-hash`` turns a token into such an entry. A presented token is hashed, then looked up
by its hash (`TokenTable.authenticate`); the auth interceptor
(`interceptors.auth.AuthInterceptor`) enforces what the grant allows. docs/security.md is
the operator's guide.

Tokens file::

    [[token]]
    name = "ci-publisher"                 # optional; what logs show (default "sha256:<12 hex>")
    sha256 = "<64 hex digits>"            # the SHA-256 of the UTF-8 token
    namespaces = ["code", "docs"]         # or ["*"]: every namespace
    roles = ["draft", "push"]             # draft, push, admin (admin includes the others)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
import secrets
import ssl
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ngramcache.client.kernel.errors import InvalidArgumentError

from .counts.namespace import validate_namespace
from .toml_files import tomllib

ALL_NAMESPACES = "*"
"""In a grant's ``namespaces``: every namespace, present and future."""

TOKEN_PREFIX = "ngc_"
"""Generated tokens start with it, so secret scanners and people recognize them."""

MIN_TOKEN_CHARS = 16
"""The shortest token `token-hash` accepts: a fast unsalted hash is safe only for tokens nobody can guess."""

_NAME_RE = re.compile(r"[A-Za-z0-9_.:@/-]{1,64}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_ENTRY_KEYS = frozenset({"name", "sha256", "namespaces", "roles"})


class Role(enum.Enum):
    """What a token may do (docs/security.md lists the RPCs of each)."""

    DRAFT = "draft"  # draft (Session, Draft) and read: Pull, PullHistory, SubscribeHistory, List, Fetch, Watch
    PUSH = "push"  # Counts.Push, Counts.PushHistory
    ADMIN = "admin"  # everything: also CreateNamespace, DropNamespace, StaticFiles.Publish


@dataclasses.dataclass(frozen=True)
class TokenGrant:
    """One entry of the tokens file: what the holder of the token whose hash is `sha256` may do.

    Attributes:
        name: what logs show instead of the token (never the token itself).
        sha256: the token's SHA-256, 64 lowercase hex digits.
        roles: the roles granted; `Role.ADMIN` includes every other role.
        namespaces: the namespaces it may touch; None for every namespace (``"*"``).
    """

    name: str
    sha256: str
    roles: frozenset[Role]
    namespaces: frozenset[str] | None

    def has_role(self, role: Role) -> bool:
        return role in self.roles or Role.ADMIN in self.roles

    def may_use(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_sha256(token: str) -> str:
    """The SHA-256 of a token's UTF-8 bytes, as the tokens file holds it (64 lowercase hex digits)."""
    return _digest(token).hex()


def new_token() -> str:
    """A fresh random token: `TOKEN_PREFIX` then 256 random bits, URL-safe base64 (47 characters)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class TokenTable:
    """The grants of a tokens file, keyed by the hash of their token.

    Timing: `authenticate` hashes the presented token first and then looks the digest up
    in a dict. Whatever the lookup's timing reveals is about SHA-256(presented token), a
    value the caller cannot steer bit by bit; learning that some stored digest starts like
    the digest of a guess brings no token closer (that would take a SHA-256 preimage), so
    the comparison needs no `hmac.compare_digest` over every entry. Python's dict also
    compares keyed SipHash values before any bytes.

    Thread-safety: immutable after construction; safe from any thread.
    """

    def __init__(self, grants: Iterable[TokenGrant]) -> None:
        self._by_sha256: dict[bytes, TokenGrant] = {}
        for grant in grants:
            digest = bytes.fromhex(grant.sha256)
            if digest in self._by_sha256:
                raise InvalidArgumentError(f"two tokens have the same sha256 ({grant.name!r} and "
                                           f"{self._by_sha256[digest].name!r})")
            self._by_sha256[digest] = grant

    def __len__(self) -> int:
        return len(self._by_sha256)

    def grants(self) -> list[TokenGrant]:
        return list(self._by_sha256.values())

    def authenticate(self, token: str) -> TokenGrant | None:
        """The grant of `token`, or None when no entry has its hash."""
        return self._by_sha256.get(_digest(token))


def parse_grant(entry: Mapping[str, Any], where: str) -> TokenGrant:
    """One ``[[token]]`` table as a grant; InvalidArgumentError names `where` and the bad key.

    Messages never repeat the ``sha256`` value: a token pasted there by mistake must not reach a log.
    """
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown key(s) {', '.join(unknown)}; known: name, sha256, namespaces, "
                                   "roles (the file holds hashes of tokens, never tokens: `ngramcache token-hash`)")
    sha = entry.get("sha256")
    if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha.lower()):
        raise InvalidArgumentError(f"{where}: sha256 must be 64 hex digits, the SHA-256 of the token (the file holds "
                                   "hashes of tokens, never tokens: `ngramcache token-hash`)")
    sha = sha.lower()
    name = entry.get("name", f"sha256:{sha[:12]}")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidArgumentError(f"{where}: name must be 1..64 characters of [A-Za-z0-9_.:@/-]")
    where = f"{where} ({name})"
    roles = entry.get("roles")
    known_roles = {r.value: r for r in Role}
    if not isinstance(roles, list) or not roles or not all(isinstance(r, str) and r in known_roles for r in roles):
        raise InvalidArgumentError(f"{where}: roles must be a non-empty list of {', '.join(known_roles)}, "
                                   f"got {roles!r}")
    namespaces = entry.get("namespaces")
    if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) for n in namespaces):
        raise InvalidArgumentError(f"{where}: namespaces must be a non-empty list of namespace names, or [\"*\"] "
                                   f"for every namespace, got {namespaces!r}")
    if ALL_NAMESPACES in namespaces:
        if len(namespaces) > 1:
            raise InvalidArgumentError(f"{where}: \"*\" means every namespace and stands alone in namespaces")
        allowed = None
    else:
        for ns in namespaces:
            try:
                validate_namespace(ns)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"{where}: {e}") from None
        allowed = frozenset(namespaces)
    return TokenGrant(name=name, sha256=sha, roles=frozenset(known_roles[r] for r in roles), namespaces=allowed)


def load_tokens(path: str) -> TokenTable:
    """Reads a tokens file (module docstring); InvalidArgumentError names ``tokens_file``, the file and the entry."""
    where = f"tokens_file {path}"
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{where}: is a folder, not a TOML file") from None
    except PermissionError:
        raise InvalidArgumentError(f"{where}: not readable (permission denied)") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgumentError(f"{where}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{where}: not a text (TOML) file") from None
    unknown = sorted(set(doc) - {"token"})
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; tokens are [[token]] tables")
    entries = doc.get("token")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise InvalidArgumentError(f"{where}: no [[token]] entries (with none, no call could pass; leave tokens_file "
                                   "unset to turn authentication off)")
    grants = [parse_grant(entry, f"{where}: token #{i}") for i, entry in enumerate(entries, 1)]
    try:
        table = TokenTable(grants)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{where}: {e}") from None
    names = [g.name for g in grants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidArgumentError(f"{where}: token name(s) {', '.join(duplicates)} used more than once")
    return table


def token_toml(sha256: str, *, name: str | None = None, namespaces: Sequence[str] = (ALL_NAMESPACES,),
               roles: Sequence[str] = (Role.DRAFT.value,)) -> str:
    """A ``[[token]]`` entry for a tokens file, checked the way `load_tokens` checks it."""
    entry: dict[str, Any] = {"sha256": sha256, "namespaces": list(namespaces), "roles": list(roles)}
    if name is not None:
        entry["name"] = name
    grant = parse_grant(entry, "token")

    def strings(values: Iterable[str]) -> str:
        return "[" + ", ".join(f'"{v}"' for v in values) + "]"

    lines = ["[[token]]"]
    if name is not None:
        lines.append(f'name = "{grant.name}"')
    lines += [f'sha256 = "{grant.sha256}"', f"namespaces = {strings(namespaces)}", f"roles = {strings(roles)}"]
    return "\n".join(lines) + "\n"


# -- TLS --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of the server's TLS settings (read once, checked by `read_tls_files`)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None  # None: clients need no certificate (TLS, not mutual TLS)


def _read_pem(setting: str, path: str, begin: bytes, what: str) -> bytes:
    """The file's bytes if it holds a PEM block whose BEGIN line matches the regex `begin`."""
    where = f"{setting} {path}"
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InvalidArgumentError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{where}: is a folder, not a PEM file") from None
    except PermissionError:
        raise InvalidArgumentError(f"{where}: not readable (permission denied)") from None
    except OSError as e:
        raise InvalidArgumentError(f"{where}: cannot read: {e.strerror or e}") from None
    if not re.search(rb"-----BEGIN " + begin + rb"-----", data):
        raise InvalidArgumentError(f"{where}: not a PEM file with {what}")
    return data


def read_tls_files(cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
    """The TLS settings' files, checked; None when TLS is off (no cert and no key).

    Checks that both or neither of cert and key are set, that each file is PEM of the
    right kind, the key unencrypted (gRPC takes no passphrase) and matching the
    certificate, and that the client CA parses. Raises InvalidArgumentError naming the
    setting and the file.
    """
    if not cert and not key:
        if client_ca:
            raise InvalidArgumentError(f"tls_client_ca {client_ca}: mutual TLS needs tls_cert and tls_key as well")
        return None
    if not cert or not key:
        missing, given = ("tls_cert", f"tls_key {key}") if not cert else ("tls_key", f"tls_cert {cert}")
        raise InvalidArgumentError(f"{given}: TLS needs both tls_cert and tls_key; {missing} is not set")
    cert_pem = _read_pem("tls_cert", cert, rb"CERTIFICATE", "a certificate (-----BEGIN CERTIFICATE-----)")
    key_pem = _read_pem("tls_key", key, rb"[A-Z ]*PRIVATE KEY", "a private key (-----BEGIN PRIVATE KEY-----)")
    if re.search(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: *4, *ENCRYPTED", key_pem):
        raise InvalidArgumentError(f"tls_key {key}: the key is encrypted; gRPC needs it unencrypted "
                                   "(`openssl pkey -in KEY -out PLAIN`) and protected by file permissions")
    ca_pem = (_read_pem("tls_client_ca", client_ca, rb"CERTIFICATE", "CA certificates (-----BEGIN CERTIFICATE-----)")
              if client_ca else None)
    # The ssl module parses the same PEM gRPC will, and tells whether the key is the certificate's.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: "")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise InvalidArgumentError(f"tls_key {key}: not the private key of tls_cert {cert}") from None
        raise InvalidArgumentError(f"tls_cert {cert} / tls_key {key}: not a usable certificate and key "
                                   f"({e.reason or e})") from None
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as e:
            raise InvalidArgumentError(f"tls_client_ca {client_ca}: not usable CA certificates ({e.reason or e})") from None
    return TlsFiles(cert=cert_pem, key=key_pem, client_ca=ca_pem)


__all__ = ["ALL_NAMESPACES", "Role", "TlsFiles", "TokenGrant", "TokenTable", "load_tokens", "new_token",
           "parse_grant", "read_tls_files", "token_sha256", "token_toml"]
