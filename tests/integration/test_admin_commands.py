"""The admin commands (`namespace create|list|delete`, `publish`, `rebuild`) run as a user runs them, against a real service on loopback: `--json` prints one parseable object (a list for `namespace list`), and `--server` defaults to $NGC_SERVER, else 127.0.0.1:50051."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.service import ServiceThread, wait_until

from ngramcache import StaticCache, build_static_from_tokens
from ngramcache.cache_service.cli import main as cli_main
from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import delta_rows_to_bytes

pytestmark = pytest.mark.integration

FP = bytes(range(32))
VOCAB = 100


def cli(*args: object, server: str | None = None) -> subprocess.CompletedProcess[str]:
    """`ngramcache ARGS...` in a process whose only NGC_ variable is NGC_SERVER=`server` (when given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NGC_")}
    if server is not None:
        env["NGC_SERVER"] = server
    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


def ok_json(r: subprocess.CompletedProcess[str]) -> object:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)  # the whole of stdout: one JSON value


def push(address: str, namespace: str) -> None:
    rows = np.array([[2, 5, 6, -1, -1, 7, 3], [2, 6, 7, -1, -1, 8, 2]], dtype=np.int32)
    with grpc.insecure_channel(address) as ch:
        ack = counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
            namespace=namespace, tokenizer_fingerprint=FP, client_id="c", seq=1, rows=delta_rows_to_bytes(rows)),
            timeout=30)
    assert not ack.duplicate


def test_every_admin_command_prints_json_and_finds_the_server_in_ngc_server(tmp_path: Path) -> None:
    gen1 = tmp_path / "g1.ngc"
    build_static_from_tokens([np.arange(300, dtype=np.int32) % 13], str(gen1), vocab_size=VOCAB, fingerprint=FP,
                             generation=1)
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        tokenizer = ("--vocab-size", VOCAB, "--fingerprint", FP.hex())

        # No --server anywhere below: NGC_SERVER names the service.
        created = ok_json(cli("namespace", "create", "ns", *tokenizer, "--json", server=address))
        assert created == {"name": "ns", "created": True, "vocab_size": VOCAB, "fingerprint": FP.hex(),
                           "latest_generation": 0}
        again = ok_json(cli("namespace", "create", "ns", *tokenizer, "--json", server=address))
        assert isinstance(again, dict) and again["created"] is False

        published = ok_json(cli("publish", gen1, "--namespace", "ns", "--json", server=address))
        size = gen1.stat().st_size
        assert isinstance(published, dict) and published == {
            "file": str(gen1), "namespace": "ns", "generation": 1, "size": size, "sha256": published["sha256"],
            "already_published": False}
        assert len(published["sha256"]) == 64
        assert ok_json(cli("publish", gen1, "--namespace", "ns", "--json", server=address)) == {
            **published, "already_published": True}

        push(address, "ns")
        r = cli("rebuild", "--namespace", "ns", "--json", server=address)
        done = ok_json(r)
        assert isinstance(done, dict)
        assert (done["namespace"], done["state"], done["generation"]) == ("ns", "done", 2)
        built = StaticCache.open(str(tmp_path / "data" / "static" / "ns" / f"{2:020d}.ngc"))
        assert done["dynamic_rows"] == 2 and done["seconds"] > 0
        assert (done["n_keys"], done["n_followers"], done["file_bytes"]) == (built.n_keys, built.n_followers,
                                                                            built.file_size)
        assert "rebuilding ns on" in r.stderr  # the progress went to stderr

        started = ok_json(cli("rebuild", "--namespace", "ns", "--no-wait", "--json", server=address))
        assert isinstance(started, dict) and started["namespace"] == "ns" and started["lease_token"] > 0
        assert started["state"] in ("running", "done") and started["holder"]
        third = tmp_path / "data" / "static" / "ns" / f"{3:020d}.ngc"
        wait_until(third.exists, 60, what="the --no-wait rebuild to publish generation 3")
        wait_until(lambda: json.loads(cli("namespace", "list", "--json", server=address).stdout)[0]["latest_generation"]
                   == 3, 30, what="the namespace to list generation 3")

        listed = ok_json(cli("namespace", "list", "--json", server=address))
        assert listed == [{"name": "ns", "vocab_size": VOCAB, "fingerprint": FP.hex(), "latest_generation": 3}]
        assert ok_json(cli("namespace", "delete", "ns", "--yes", "--json", server=address)) == {"name": "ns",
                                                                                                "deleted": True}
        assert ok_json(cli("namespace", "delete", "ns", "--yes", "--json", server=address)) == {"name": "ns",
                                                                                                "deleted": False}
        assert ok_json(cli("namespace", "list", "--json", server=address)) == []

        # --server still wins over NGC_SERVER.
        assert ok_json(cli("namespace", "list", "--json", "--server", address, server="127.0.0.1:1")) == []


def test_errors_stay_one_line_on_stderr_with_json(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data") as svc:
        r = cli("rebuild", "--namespace", "no-such-ns", "--json", server=f"127.0.0.1:{svc.port}")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no-such-ns" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["namespace", "list"], ["namespace", "create", "x"], ["namespace", "delete", "x"],
                                     ["publish", "f", "--namespace", "x"], ["rebuild", "--namespace", "x"]])
def test_server_defaults_to_ngc_server_else_the_serve_default(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from ngramcache.cache_service.cli import add_namespace, add_publish, add_rebuild
    from ngramcache.client.tools.cli import build_parser

    def parse() -> str:
        from ngramcache.cache_service.admin_commands import server_of

        args = build_parser([add_namespace, add_publish, add_rebuild]).parse_args(command)
        return server_of(args)[0]

    monkeypatch.delenv("NGC_SERVER", raising=False)
    assert parse() == "127.0.0.1:50051"
    monkeypatch.setenv("NGC_SERVER", "cache.internal:7000")
    assert parse() == "cache.internal:7000"
    with pytest.raises(SystemExit):
        cli_main([*(command[:2] if command[0] == "namespace" else command[:1]), "--help"])
    assert "(default: $NGC_SERVER, else 127.0.0.1:50051)" in " ".join(capsys.readouterr().out.split())


def test_namespace_list_prints_aligned_columns(tmp_path: Path) -> None:
    """Names shorter than the header ("namespace") shifted every column of their rows left."""
    with ServiceThread(tmp_path / "data") as svc:
        address = f"127.0.0.1:{svc.port}"
        for name in ("ns", "code"):
            assert cli("namespace", "create", name, "--vocab-size", VOCAB, "--fingerprint", FP.hex(),
                       server=address).returncode == 0
        r = cli("namespace", "list", server=address)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["namespace", "vocabulary", "fingerprint", "generation"] and len(rows) == 2
    for row in rows:
        name, vocab, fingerprint, generation = row.split()
        assert row.index(vocab) + len(vocab) == header.index("vocabulary") + len("vocabulary")  # right-aligned
        assert row.index(fingerprint) == header.index("fingerprint")  # left-aligned
        assert row.rindex(generation) == header.index("generation")


def test_an_unreachable_server_from_the_environment_is_named_as_such() -> None:
    """An error caused by $NGC_SERVER named --server, which the user never gave; a typo of the variable went unsaid."""
    from helpers.redis_servers import free_port

    port = free_port()
    r = cli("namespace", "list", server=f"127.0.0.1:{port}")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"cannot reach the service at 127.0.0.1:{port}" in r.stderr and "$NGC_SERVER" in r.stderr, r.stderr
    assert "--server" not in r.stderr, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("NGC_")}
    r = subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", "namespace", "list", "--timeout", "2"],
                       capture_output=True, text=True, timeout=120, env={**env, "NGC_SERVR": f"127.0.0.1:{port}"})
    assert r.returncode != 0, r.stderr
    assert "neither --server nor $NGC_SERVER was given" in r.stderr and "$NGC_SERVR is set: a typo of NGC_SERVER?" in r.stderr
