"""security.py and the auth interceptor's pieces: token hashes, the tokens file and its hostile cases, TLS files, the
settings that use them, the access rules, and `ngramcache token-hash`."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from ngramcache.cache_service import cli
from ngramcache.cache_service.interceptors.auth import RULES, bearer_token
from ngramcache.cache_service.security import (
    Role,
    TokenTable,
    load_tokens,
    new_token,
    parse_grant,
    token_sha256,
    token_toml,
)
from ngramcache.cache_service.status import ServiceError
from ngramcache.cache_service.toml_files import tomllib
from ngramcache.client._proto.v1 import admin_pb2, counts_pb2, drafting_pb2, static_files_pb2
from ngramcache.client.kernel.errors import InvalidArgumentError

SECRET = "ngc_this-is-a-secret-token-nobody-may-see"
SHA = token_sha256(SECRET)


def entry(**fields: object) -> dict[str, object]:
    return {"sha256": SHA, "namespaces": ["code"], "roles": ["draft"], **fields}


def tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    return str(path)


# -- TOML on every supported Python ----------------------------------------------------------


# -- hashes and grants ------------------------------------------------------------------


def test_token_sha256_is_the_hex_sha256_of_the_utf8_token() -> None:
    assert token_sha256("abc") == hashlib.sha256(b"abc").hexdigest()
    assert token_sha256("é") == hashlib.sha256("é".encode()).hexdigest()


def test_new_tokens_are_random_prefixed_and_url_safe() -> None:
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    for t in tokens:
        assert t.startswith("ngc_") and len(t) == 47 and t[4:].replace("-", "").replace("_", "").isalnum()


def test_grant_roles_and_namespaces() -> None:
    draft = parse_grant(entry(), "t")
    assert draft.has_role(Role.DRAFT) and not draft.has_role(Role.PUSH) and not draft.has_role(Role.ADMIN)
    assert draft.may_use("code") and not draft.may_use("docs") and not draft.may_use("")
    admin = parse_grant(entry(roles=["admin"], namespaces=["*"]), "t")
    assert all(admin.has_role(r) for r in Role)  # admin includes every role
    assert admin.namespaces is None and admin.may_use("anything")
    both = parse_grant(entry(roles=["draft", "push"], namespaces=["a", "b"]), "t")
    assert both.roles == {Role.DRAFT, Role.PUSH} and both.namespaces == {"a", "b"}
    assert parse_grant(entry(), "t").name == f"sha256:{SHA[:12]}"  # the default name
    assert parse_grant(entry(sha256=SHA.upper()), "t").sha256 == SHA


def test_table_finds_the_grant_of_a_token_by_its_hash() -> None:
    other = new_token()
    table = TokenTable([parse_grant(entry(name="one"), "t"), parse_grant(entry(name="two", sha256=token_sha256(other)), "t")])
    assert len(table) == 2
    assert table.authenticate(SECRET).name == "one"  # type: ignore[union-attr]
    assert table.authenticate(other).name == "two"  # type: ignore[union-attr]
    for wrong in ("", SECRET + " ", SECRET[:-1], SHA, SECRET.upper(), "\ud800"):
        assert table.authenticate(wrong) is None


def test_load_tokens_reads_every_entry(tmp_path: Path) -> None:
    path = tokens_file(tmp_path, f'''
# comments are fine
[[token]]
name = "ci"
sha256 = "{SHA}"
namespaces = ["code", "docs"]
roles = ["draft", "push"]

[[token]]
sha256 = "{token_sha256("another-token-0123456789")}"
namespaces = ["*"]
roles = ["admin"]
''')
    table = load_tokens(path)
    ci, admin = table.grants()
    assert (ci.name, ci.namespaces, ci.roles) == ("ci", {"code", "docs"}, {Role.DRAFT, Role.PUSH})
    assert admin.namespaces is None and admin.roles == {Role.ADMIN} and admin.name.startswith("sha256:")


@pytest.mark.parametrize("text, message", [
    ("", "no [[token]] entries"),
    ("[token]\nsha256 = 'x'\n", "no [[token]] entries"),
    ("tokens = []\n", "unknown top-level key(s) tokens"),
    ("[[token]\n", "not valid TOML"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = ['draft']\ntoken = '{SECRET}'\n",
     "token #1: unknown key(s) token"),
    (f"[[token]]\nsha256 = '{SECRET}'\nnamespaces = ['a']\nroles = ['draft']\n", "sha256 must be 64 hex digits"),
    (f"[[token]]\nsha256 = '{SHA[:-1]}'\nnamespaces = ['a']\nroles = ['draft']\n", "sha256 must be 64 hex digits"),
    (f"[[token]]\nsha256 = '{SHA[:-1]}g'\nnamespaces = ['a']\nroles = ['draft']\n", "sha256 must be 64 hex digits"),
    ("[[token]]\nnamespaces = ['a']\nroles = ['draft']\n", "sha256 must be 64 hex digits"),
    (f"[[token]]\nsha256 = '{SHA}'\nroles = ['draft']\n", "namespaces must be a non-empty list"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = []\nroles = ['draft']\n", "namespaces must be a non-empty list"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = 'a'\nroles = ['draft']\n", "namespaces must be a non-empty list"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['*', 'a']\nroles = ['draft']\n", "stands alone"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a b']\nroles = ['draft']\n", "namespace must be 1..64 characters"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\n", "roles must be a non-empty list of draft, push, admin"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = []\n", "roles must be a non-empty list"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = ['read']\n", "roles must be a non-empty list"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = ['draft']\nname = 'a b'\n", "name must be 1..64"),
    (f"[[token]]\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = ['draft']\n" * 2, "two tokens have the same sha256"),
    (f"[[token]]\nname = 'x'\nsha256 = '{SHA}'\nnamespaces = ['a']\nroles = ['draft']\n"
     f"[[token]]\nname = 'x'\nsha256 = '{'0' * 64}'\nnamespaces = ['a']\nroles = ['draft']\n", "token name(s) x used more than once"),
], ids=["empty", "table-not-array", "unknown-top", "bad-toml", "plaintext-key", "token-as-sha", "short-sha", "non-hex-sha",
        "no-sha", "no-namespaces", "empty-namespaces", "namespaces-string", "star-and-more", "bad-namespace", "no-roles",
        "empty-roles", "unknown-role", "bad-name", "same-sha", "same-name"])
def test_load_tokens_refuses_hostile_files_in_one_line_without_echoing_secrets(tmp_path: Path, text: str,
                                                                              message: str) -> None:
    path = tokens_file(tmp_path, text)
    with pytest.raises(InvalidArgumentError) as caught:
        load_tokens(path)
    text = str(caught.value)
    assert text.startswith(f"tokens_file {path}: ") and message in text and "\n" not in text, text
    assert SECRET not in text and SHA not in text


def test_load_tokens_names_a_missing_or_unusable_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^tokens_file /nonexistent/t\.toml: no such file$"):
        load_tokens("/nonexistent/t.toml")
    with pytest.raises(InvalidArgumentError, match="is a folder"):
        load_tokens(str(tmp_path))


def test_load_tokens_names_an_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tokens_file(tmp_path, "")

    def denied(*args: object, **kwargs: object) -> None:  # what an unprivileged reader of a 0600 file gets
        raise PermissionError(13, "Permission denied", path)

    from ngramcache.cache_service import security

    monkeypatch.setattr(security, "open", denied, raising=False)
    with pytest.raises(InvalidArgumentError, match="not readable"):
        load_tokens(path)


def test_token_toml_round_trips_through_the_loader(tmp_path: Path) -> None:
    text = token_toml(SHA, name="ci", namespaces=["code", "docs"], roles=["push", "draft"])
    assert SECRET not in text
    assert tomllib.loads(text) == {"token": [{"name": "ci", "sha256": SHA, "namespaces": ["code", "docs"],
                                              "roles": ["push", "draft"]}]}
    (grant,) = load_tokens(tokens_file(tmp_path, text)).grants()
    assert grant.name == "ci" and grant.roles == {Role.PUSH, Role.DRAFT}
    assert tomllib.loads(token_toml(SHA))["token"][0] == {"sha256": SHA, "namespaces": ["*"], "roles": ["draft"]}
    with pytest.raises(InvalidArgumentError, match="roles"):
        token_toml(SHA, roles=["root"])


# -- the bearer header and the access rules ---------------------------------------------


@pytest.mark.parametrize("metadata, token", [
    ((("authorization", f"Bearer {SECRET}"),), SECRET),
    ((("authorization", f"bearer {SECRET}"),), SECRET),
    ((("authorization", f"Bearer   {SECRET}  "),), SECRET),
    ((("user-agent", "x"), ("authorization", f"Bearer {SECRET}")), SECRET),
])
def test_bearer_token_reads_the_authorization_metadata(metadata: tuple[tuple[str, str], ...], token: str) -> None:
    assert bearer_token(metadata) == token


@pytest.mark.parametrize("metadata, message", [
    (None, "no bearer token"),
    ((), "no bearer token"),
    ((("authorisation", f"Bearer {SECRET}"),), "no bearer token"),
    ((("authorization", SECRET),), "malformed"),
    ((("authorization", f"Basic {SECRET}"),), "malformed"),
    ((("authorization", "Bearer "),), "malformed"),
    ((("authorization", f"Bearer {SECRET} {SECRET}"),), "malformed"),
    ((("authorization", f"Bearer {SECRET}".encode()),), "malformed"),
    ((("authorization", f"Bearer {SECRET}"), ("authorization", f"Bearer {SECRET}")), "more than one"),
])
def test_bearer_token_refuses_missing_and_malformed_metadata(metadata: object, message: str) -> None:
    with pytest.raises(ServiceError) as caught:
        bearer_token(metadata)
    assert caught.value.code.name == "UNAUTHENTICATED" and message in str(caught.value)
    assert SECRET not in str(caught.value)


def test_every_rpc_of_the_four_services_has_an_access_rule() -> None:
    methods = {f"/{service.full_name}/{method.name}"
               for pb in (drafting_pb2, counts_pb2, static_files_pb2, admin_pb2)
               for service in pb.DESCRIPTOR.services_by_name.values() for method in service.methods}
    assert set(RULES) == methods
    roles = {method.rsplit("/", 1)[1]: rule.role for method, rule in RULES.items()}
    assert {m for m, r in roles.items() if r is Role.ADMIN} == {"Publish", "CreateNamespace", "DropNamespace",
                                                                              "StartRebuild"}
    assert {m for m, r in roles.items() if r is Role.PUSH} == {"Push", "PushHistory"}
    assert {m for m, r in roles.items() if r is None} == {"GetNamespace", "ListNamespaces", "GetServerInfo",
                                                          "GetRebuildStatus"}
    # Every rule that names a namespace finds it in the message that carries it.
    samples = {
        "Session": drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(namespace="n")),
        "Publish": static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(namespace="n")),
    }
    for method, rule in RULES.items():
        name = method.rsplit("/", 1)[1]
        if rule.namespace_of is None:
            assert name in ("ListNamespaces", "GetServerInfo")
            continue
        request_type = _request_type(method)
        sample = samples.get(name) or request_type(**{("name" if "name" in request_type.DESCRIPTOR.fields_by_name
                                                        else "namespace"): "n"})
        assert rule.namespace_of(sample) == "n", method
    assert RULES["/ngramcache.v1.Drafting/Session"].namespace_of(  # type: ignore[misc]
        drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep())) is None


def _request_type(method: str) -> type:
    service_name, rpc = method.strip("/").rsplit("/", 1)
    for pb in (drafting_pb2, counts_pb2, static_files_pb2, admin_pb2):
        for service in pb.DESCRIPTOR.services_by_name.values():
            if service.full_name == service_name:
                desc = service.methods_by_name[rpc].input_type
                return getattr(pb, desc.name)  # type: ignore[no-any-return]
    raise KeyError(method)


# -- TLS files and the settings ---------------------------------------------------------


# -- ngramcache token-hash --------------------------------------------------------------


def test_token_hash_of_a_token_on_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    assert cli.main(["token-hash", "--name", "ci", "--namespace", "code", "--namespace", "docs", "--role", "push"]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert tomllib.loads(out) == {"token": [{"name": "ci", "sha256": SHA, "namespaces": ["code", "docs"],
                                             "roles": ["push"]}]}
    (grant,) = load_tokens(tokens_file(tmp_path, out)).grants()
    assert grant.namespaces == {"code", "docs"} and grant.roles == {Role.PUSH}


def test_token_hash_json_prints_the_entry_as_one_object(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    assert cli.main(["token-hash", "--namespace", "code", "--role", "push", "--json"]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    entry = json.loads(out)
    assert entry == {"sha256": SHA, "name": None, "namespaces": ["code"], "roles": ["push"], "entry": entry["entry"]}
    assert tomllib.loads(entry["entry"]) == {"token": [{"sha256": SHA, "namespaces": ["code"], "roles": ["push"]}]}


def test_token_hash_new_prints_the_token_once_on_stderr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["token-hash", "--new", "--role", "admin"]) == 0
    out, err = capsys.readouterr()
    token = err.strip().rsplit(" ", 1)[-1]
    assert token.startswith("ngc_") and token not in out
    assert tomllib.loads(out)["token"][0] == {"sha256": token_sha256(token), "namespaces": ["*"], "roles": ["admin"]}
    assert load_tokens(tokens_file(tmp_path, out)).authenticate(token) is not None


@pytest.mark.parametrize("stdin", ["tiny-tok\n", "\n", "has a space in it somewhere\n"])
def test_token_hash_refuses_weak_tokens(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                        stdin: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert cli.main(["token-hash"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "at least 16 characters" in err and "--new" in err
    if stdin.strip():
        assert stdin.strip() not in err


def test_token_hash_refuses_a_bad_namespace(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET))
    assert cli.main(["token-hash", "--namespace", "no spaces"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "namespace must be" in err and SECRET not in err


@pytest.mark.parametrize("args, message", [
    (["--tokens-file", "/nonexistent/tokens.toml"], "tokens_file /nonexistent/tokens.toml: no such file"),
    (["--tls-key", "/nonexistent/k.pem"], "tls_key /nonexistent/k.pem: TLS needs both tls_cert and tls_key"),
    (["--tls-client-ca", "/nonexistent/ca.pem"], "tls_client_ca /nonexistent/ca.pem: mutual TLS needs tls_cert"),
    (["--host", "0.0.0.0"], "serving the network needs TLS (tls_cert and tls_key)"),
])
def test_serve_refuses_bad_security_settings_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         args: list[str], message: str) -> None:
    assert cli.main(["serve", "--data-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ngramcache serve: error: ") and message in err and err.count("\n") == 1, err
