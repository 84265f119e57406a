"""`ngramcache serve` (the console script's entry, a real process) on a port that is taken: one line naming the port and the flag, exit 2, no gRPC log line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ENTRY = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GRPC_", "NGC_"))}
    return subprocess.run([*ENTRY, "serve", "--data-dir", str(tmp_path / "data"), *args], capture_output=True,
                          text=True, timeout=60, env={**environ, **(env or {})})


def test_a_taken_grpc_port_is_one_line_naming_the_flag(tmp_path: Path, taken_port: int) -> None:
    r = serve(tmp_path, "--port", str(taken_port))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"ngramcache serve: error: cannot listen on 127.0.0.1:{taken_port}: port "
                                     f"{taken_port} is in use by another process; choose another --port (--port 0 "
                                     "picks a free one)"], r.stderr


def test_a_taken_metrics_port_is_one_line_naming_the_flag(tmp_path: Path, taken_port: int) -> None:
    r = serve(tmp_path, "--port", "0", "--metrics-port", str(taken_port))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if " INFO " not in line]  # the start's own log lines
    assert lines == [f"ngramcache serve: error: cannot listen on 127.0.0.1:{taken_port}: port {taken_port} is in use "
                     "by another process; choose another --metrics-port (--metrics-port 0 picks a free one)"], r.stderr


def test_a_host_that_is_not_this_machines_names_the_flag(tmp_path: Path) -> None:
    r = serve(tmp_path, "--port", "0", "--host", "192.0.2.1", "--allow-insecure-remote")  # TEST-NET-1: nobody's
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["ngramcache serve: error: cannot listen on 192.0.2.1:0: 192.0.2.1 is not an "
                                     "address of this machine; change --host"], r.stderr


def test_grpc_verbosity_set_by_the_user_brings_grpc_log_lines_back(tmp_path: Path, taken_port: int) -> None:
    r = serve(tmp_path, "--port", str(taken_port), env={"GRPC_VERBOSITY": "ERROR"})
    assert r.returncode == 2
    assert "add_port.cc" in r.stderr and r.stderr.splitlines()[-1].startswith("ngramcache serve: error: cannot listen")
