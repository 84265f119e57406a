"""What makes a test a unit test here: it runs in this process, alone. No child process, no socket
(no server, no connection, not even on loopback), no compiler: those tests live in tests/integration
(real servers and processes) and tests/native (builds of the core). Every unit test runs with the
calls that would break the rule replaced by ones that fail the test, naming what it tried.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio


class NotAUnitTest(AssertionError):
    """A unit test started a process or opened a socket: it belongs in tests/integration."""


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotAUnitTest(f"a unit test {what}: move it to tests/integration (tests/unit/conftest.py says why)")
    return refuse


@contextmanager
def in_process_only() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
        patch.setattr(os, "fork", _refuse("forked"))
        patch.setattr(os, "posix_spawn", _refuse("started a process"))
        for method in ("bind", "connect", "connect_ex"):
            patch.setattr(socket.socket, method, _refuse(f"used a socket ({method})"))
        patch.setattr(grpc, "server", _refuse("started a gRPC server"))
        patch.setattr(aio, "server", _refuse("started a gRPC server"))
        yield
    finally:
        patch.undo()


UNIT = Path(__file__).resolve().parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # pytest calls this hook for every item of the session, wherever the conftest that defines it lies
    if Path(item.path).resolve().is_relative_to(UNIT):
        with in_process_only():
            yield
    else:
        yield
