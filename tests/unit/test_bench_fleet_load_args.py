"""bench_fleet_load refuses out-of-range options with one line, before it starts a fleet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_fleet_load.py"


@pytest.mark.parametrize(("args", "message"), [
    (["--client-nice", "25"], "--client-nice takes 0..19 (10 by default), got 25"),
    (["--client-nice", "-1"], "--client-nice takes 0..19 (10 by default), got -1"),
    (["--marker-pause", "-1"], "--marker-pause takes seconds in 0.01..60 (0.5 by default), got -1.0"),
    (["--marker-pause", "nan"], "--marker-pause takes seconds in 0.01..60 (0.5 by default), got nan"),
    (["--serve-args=--mirror-interval '1"], "--serve-args: No closing quotation in \"--mirror-interval '1\""),
])
def test_out_of_range_option_is_one_line(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert "setup " not in done.stdout  # no fleet was started


def test_a_replica_refusing_the_serve_args_ends_the_run_with_its_error() -> None:
    """--serve-args goes to `ngramcache serve` as it is: an option serve does not take ends the run with serve's own
    line (from the replica's log), not a traceback."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--serve-args=--no-such-option"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "bench_fleet_load.py: error: replica 0 did not start" in done.stderr
    assert "unrecognized arguments: --no-such-option" in done.stderr
    assert "Traceback" not in done.stderr
