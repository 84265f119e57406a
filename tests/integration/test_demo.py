"""`ngramcache demo` as a user runs it: the installed command, what it prints, what it leaves behind (also on Ctrl-C)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_SCRIPT = Path(sys.executable).parent / "ngramcache"  # the console script pip installed
COMMAND = ([str(_SCRIPT)] if _SCRIPT.exists() else
           [sys.executable, "-c", "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())"])
SMALL = ["--test-files", "4", "--n-ctx", "1024"]  # A replays 4 files, B 4 (2 of them A's); ~14 s in all
ROW = re.compile(r"^\s+([AB])\s+(its own.*?)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", re.MULTILINE)


def environment(tmp: Path) -> dict[str, str]:
    """The demo's temporary folder goes under `tmp` (tempfile honours TMPDIR); output is not block-buffered."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}


def flat(text: str) -> str:
    """The output with its wrapped lines joined (the demo wraps at 110 columns)."""
    return " ".join(text.split())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_pids(out: str) -> list[int]:
    m = re.search(r"A \(pid (\d+)\) and B \(pid (\d+)\)", flat(out))
    return [int(m.group(1)), int(m.group(2))] if m else []


@pytest.mark.slow
def test_two_workers_share_counts_through_the_service(tmp_path):
    tmp = tmp_path / "tmp"
    r = subprocess.run([*COMMAND, "demo", *SMALL, "--probes", "2"], capture_output=True, text=True, timeout=120,
                       env=environment(tmp))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = flat(r.stdout)

    # One node, one download: both clients run generation 1 from the same installed file.
    ready = re.findall(r"([AB]): generation (\d+) of fleet ready in [\d.]+ s: (downloaded it \([^)]*\)|found it installed "
                       r"by [AB]); maps (\S+)", out)
    assert sorted(name for name, *_ in ready) == ["A", "B"], out
    assert {gen for _, gen, _, _ in ready} == {"1"}
    assert sorted(how.split(" (")[0].split(" by ")[0] for _, _, how, _ in ready) == ["downloaded it", "found it installed"]
    assert {mapped for *_, mapped in ready} == {"fleet/1.ngc"}
    assert "1 download of generation 1 of fleet for the node" in out

    # Sharing: the same text, the same code; B's run on fleet has A's counts, its run on solo does not.
    rows = {(name, label): [float(x.replace(",", "")) for x in figures]
            for name, label, *figures in ROW.findall(r.stdout)}
    assert set(rows) == {("A", "its own (fleet)"), ("B", "its own (solo): no sharing"),
                         ("B", "its own + A's (fleet): sharing"), ("A", "its own (fleet-match)"),
                         ("B", "its own (solo-match): no sharing"), ("B", "its own + A's (fleet-match): sharing")}, r.stdout
    _, accepted_solo, _, per_step_solo, _ = rows[("B", "its own (solo): no sharing")]
    _, accepted_fleet, _, per_step_fleet, us = rows[("B", "its own + A's (fleet): sharing")]
    assert accepted_fleet > accepted_solo * 1.03, r.stdout
    assert per_step_fleet > per_step_solo * 1.03, r.stdout
    assert 0 < us < 100
    assert re.search(r"sharing: on the same text B accepts \+[\d.]+% drafted tokens", out)

    # The fleet history: in the match mode B drafts long copies from the sequences A generated.
    _, _, _, history_solo, _ = rows[("B", "its own (solo-match): no sharing")]
    _, _, _, history_fleet, _ = rows[("B", "its own + A's (fleet-match): sharing")]
    assert history_fleet > history_solo * 1.1, r.stdout
    m = re.search(r"fleet history: B's tokens per model step ([\d.]+) -> ([\d.]+) \(([\d.]+)x\).*?A published ([\d,]+) "
                  r"tokens.*?B pulled ([\d,]+) tokens", out)
    assert m and float(m.group(3)) > 1.1 and int(m.group(5).replace(",", "")) > 0, out

    m = re.search(r"push to visible: A accepts a new n-gram .*?, B drafts it ([\d.]+) s later \(p50 of 2 probes", out)
    assert m and 0 < float(m.group(1)) < 10, out
    m = re.search(r"Session on fleet, generation 1, .*?= ([\d.]+) tokens per step", out)
    assert m and float(m.group(1)) > 1.2, out  # the service drafts from the published generation too

    # Nothing left: the workers are gone, the temporary folder removed.
    m = re.search(r"removed (\S+) \(", out)
    assert m and not Path(m.group(1)).exists()
    assert list(tmp.iterdir()) == []
    pids = worker_pids(r.stdout)
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert re.search(r"next: README\.md's quickstarts [^\n]*docs/engines\.md, \"Your model \+ the fleet\"$", out.strip())


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["corpus:", "serving it:", "A replays", "sharing:"])
def test_ctrl_c_stops_everything_and_removes_the_folder(tmp_path, phase):
    """SIGINT once the line starting with `phase` is out: building, workers connecting, replaying, probing."""
    tmp = tmp_path / "tmp"
    p = subprocess.Popen([*COMMAND, "demo", *SMALL, "--probes", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=environment(tmp))
    assert p.stdout is not None
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if line.lstrip().startswith(phase):
                break
        assert p.poll() is None, "".join(seen)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, (err, "".join(seen) + out)
    assert err.splitlines() == ["ngramcache demo: interrupted; nothing was written"], err
    assert list(tmp.iterdir()) == []
    assert not any(alive(pid) for pid in worker_pids("".join(seen) + out))


@pytest.mark.slow
def test_workdir_keeps_what_the_demo_made_and_is_not_mixed_into_another(tmp_path):
    workdir = tmp_path / "demo"
    r = subprocess.run([*COMMAND, "demo", *SMALL, "--probes", "0", "--workdir", str(workdir)], capture_output=True,
                       text=True, timeout=120, env=environment(tmp_path / "tmp"))
    assert r.returncode == 0, r.stderr
    assert "push to visible" not in r.stdout
    assert f"ngramcache serve --data-dir {workdir / 'service'}" in flat(r.stdout)
    for made in ("stdlib.ngc", "service", "node-cache/fleet/1.ngc", "node-cache/solo/1.ngc", "worker-A.log",
                 "worker-B.log"):
        assert (workdir / made).exists(), made
    assert not any(alive(pid) for pid in worker_pids(r.stdout))

    again = subprocess.run([*COMMAND, "demo", "--workdir", str(workdir)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.splitlines() == [f"ngramcache demo: error: --workdir {workdir} holds service/ from an earlier "
                                         "demo (its counts would mix into this one's): remove it or give another folder"]


def test_a_port_in_use_is_one_line_before_any_work(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*COMMAND, "demo", "--port", str(port)], capture_output=True, text=True, timeout=60,
                           env=environment(tmp_path / "tmp"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"ngramcache demo: error: cannot listen on 127.0.0.1:{port}: address already in "
                                     "use (another server on that port? --port 0 picks a free one)"]
