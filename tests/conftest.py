"""Shared test set-up: the fixtures every test may ask for (tests/helpers holds what they are built on), and the
hooks that run `engine` tests in a child process."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.corpus import FP, VOCAB
from helpers.isolation import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol
from helpers.service import ServiceThread

__all__ = ["pytest_configure", "pytest_runtest_logreport", "pytest_runtest_protocol", "pytest_terminal_summary"]

# A test command started in the background of a script (`bash .ci/run &`) inherits SIGINT ignored,
# and every process it starts would too: the Ctrl-C tests (of `serve`, of the builder) could never
# see their SIGINT. Here Ctrl-C raises KeyboardInterrupt again; the processes the tests start get
# the default action back at exec, as a terminal would give them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def raw_tokenizer() -> tuple[bytes, int]:
    """(fingerprint, vocab_size) of the raw-token tests: what a namespace or a client is bound to."""
    return FP, VOCAB


@pytest.fixture
def embedded_service(tmp_path: Path) -> Iterator[ServiceThread]:
    """The service in a thread of this process on a free loopback port, the embedded counts store in tmp_path;
    stopped after the test. Its address is ``f"127.0.0.1:{embedded_service.port}"``."""
    with ServiceThread(tmp_path / "service") as svc:
        yield svc


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under tests/run_all.sh: the time of each install step and of the whole command, before pytest's last line."""
    import os
    import time

    started = os.environ.get("NGC_TEST_COMMAND_STARTED")
    if not started or os.environ.get("NGC_ENGINE_CHILD_REPORTS"):
        return
    steps = os.environ.get("NGC_TEST_COMMAND_STEPS", "").rstrip("; ")
    total = time.time() - float(started)
    terminalreporter.write_line(f"test command: {total / 60:.1f} min in all (installs: {steps})")
