"""Shared test set-up: makes tests/ importable (reference.py and the helpers) and runs `engine` tests in a child process."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from isolation import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol

__all__ = ["pytest_configure", "pytest_runtest_logreport", "pytest_runtest_protocol", "pytest_terminal_summary"]


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
