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


def test_ctrl_c_stops_the_fleet_with_one_line() -> None:
    """A terminal's Ctrl-C reaches the whole process group (Redis, replicas, client processes): the run says so in one
    line and exits 130, no traceback from it or its client processes."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--quick"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("setup "):  # the fleet is up
            line = proc.stdout.readline()
        assert line.startswith("setup "), line
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "bench_fleet_load.py: interrupted; the Redis Cluster, replicas and clients it started are stopped" in err
    assert "Traceback" not in err, err
