"""`python -m ngramcache.client.cli`, the command line's path before the client's wings, still runs it."""

from __future__ import annotations

import subprocess
import sys


def test_the_old_module_path_runs_the_command_line() -> None:
    old = subprocess.run([sys.executable, "-m", "ngramcache.client.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    new = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout and "usage: ngramcache" in old.stdout
    assert "Traceback" not in old.stderr
