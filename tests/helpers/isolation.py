"""Pytest plugin: tests marked `engine` run in a child pytest process, so a native crash fails its test, not the run.

A test that loads a native engine (llama.cpp, a torch model) can die of a signal: an illegal
instruction on a CPU the engine was not built for, a segfault in its kernels. In-process, that ends
pytest with no summary and none of the later tests run. Here the parent hands the marked tests of a
module to one child `python -m pytest` and replays the child's reports as its own (through pytest's
own report serialization, the one pytest-xdist uses). If the child dies, the test it was running is
failed with the signal and the last lines of the child's output, and the module's remaining tests
go to a new child. Tests not marked run in-process as usual.

tests/conftest.py imports the two hooks; the marker is declared in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _pytest.reports import TestReport

MARK = "engine"
CHILD_ENV = "NGC_ENGINE_CHILD_REPORTS"  # set in the child: the file its reports go to
CHILD_TIMEOUT_S = float(os.environ.get("NGC_ENGINE_CHILD_TIMEOUT", "1800"))
TAIL_LINES = 30
_RESULTS = pytest.StashKey[dict[str, list[TestReport]]]()
_CHILD_CONFIG: dict[str, pytest.Config] = {}  # the child's config, for serializing its reports


def _signal_name(returncode: int) -> str:
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def _tail(path: Path) -> str:
    """The child's last lines; when Python's fault handler reported the crash, its report's first lines
    (the innermost frames: the test and the engine call it died in) rather than the runner's frames."""
    lines = path.read_text(errors="replace").rstrip().splitlines()
    fatal = [i for i, line in enumerate(lines) if "Fatal Python error" in line]
    if fatal:
        lines = lines[max(0, fatal[-1] - 5):fatal[-1] + 12]
    else:
        lines = lines[-TAIL_LINES:]
    return "\n".join(lines) or "(no output)"


def _failed(item: pytest.Item, message: str) -> TestReport:
    return TestReport(nodeid=item.nodeid, location=item.location, keywords={}, outcome="failed",
                      longrepr=message, when="call", sections=[], duration=0.0, user_properties=[])


def _run_child(item: pytest.Item, results: dict[str, list[TestReport]]) -> None:
    """Runs `item` and the marked items after it in the same module in one child process."""
    items = item.session.items
    start = items.index(item)
    batch = []
    for other in items[start:]:
        if other.path != item.path or other.get_closest_marker(MARK) is None:
            break
        batch.append(other)
    config = item.config
    with tempfile.TemporaryDirectory(prefix="ngc-engine-") as tmp:
        reports_file, output_file = Path(tmp) / "reports.jsonl", Path(tmp) / "output.txt"
        env = {**os.environ, CHILD_ENV: str(reports_file)}
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--no-header",
               "--rootdir", str(config.rootpath), *(o.nodeid for o in batch)]
        with output_file.open("w") as out:
            try:
                proc = subprocess.run(cmd, cwd=config.rootpath, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=CHILD_TIMEOUT_S)
                returncode: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                returncode = None
        reports: dict[str, list[TestReport]] = {}
        if reports_file.exists():
            for line in reports_file.read_text().splitlines():
                rep = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
                reports.setdefault(rep.nodeid, []).append(rep)
        tail = _tail(output_file)
    finished = [o for o in batch if any(r.when == "teardown" for r in reports.get(o.nodeid, []))]
    for o in finished:
        results[o.nodeid] = reports[o.nodeid]
    if len(finished) == len(batch):
        return
    # The child ended before finishing the batch: the first unfinished test is the one it died in.
    victim = next(o for o in batch if o not in finished)
    if returncode is None:
        why = f"timed out after {CHILD_TIMEOUT_S:.0f} s"
    elif returncode < 0:
        why = f"died of {_signal_name(returncode)}"
    else:
        why = f"exited with status {returncode} before this test finished"
    message = (f"the child process running this test ({MARK!r} tests run in one; tests/helpers/isolation.py) {why}.\n"
               f"Last lines of its output:\n{tail}")
    results[victim.nodeid] = [*reports.get(victim.nodeid, []), _failed(victim, message)]
    if not finished and returncode is not None and returncode >= 0:
        # Nothing ran at all (a usage or collection error): the rest would fail the same way.
        for o in batch[1:]:
            results[o.nodeid] = [_failed(o, message)]
    # Otherwise the tests after the victim go to a new child when their turn comes.


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if os.environ.get(CHILD_ENV) or item.get_closest_marker(MARK) is None:
        return None
    results = item.session.stash.setdefault(_RESULTS, {})
    if item.nodeid not in results:
        _run_child(item, results)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for rep in results.pop(item.nodeid):
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report: TestReport) -> None:
    path = os.environ.get(CHILD_ENV)
    if not path:
        return
    config = _CHILD_CONFIG["config"]
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(path, "a") as f:  # a line per report, flushed at once: what the parent sees if we die
        f.write(json.dumps(data) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    _CHILD_CONFIG["config"] = config
