"""The libFuzzer targets of native/fuzz/ (ASan + UBSan): a short run each, and the saved crashes.

tests/bench/fuzz_static.py is the long run (10M executions a target) and the driver used
here: it builds the targets (kept in ``~/.cache/ngramcache/fuzz/<key>``, the key a hash of
native/'s files and clang's version, so an unchanged core is not compiled again) and writes
their seeds. clang and its libFuzzer runtime are required, not optional: tests/run_all.sh
installs them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS_PER_TARGET = 15

_spec = importlib.util.spec_from_file_location("fuzz_static", ROOT / "tests" / "bench" / "fuzz_static.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # dataclasses look their module up
_spec.loader.exec_module(fuzz)

CRASHES = sorted(p for p in (ROOT / "native" / "fuzz" / "crashes").glob("*/*") if p.is_file())


@pytest.fixture(scope="module")
def build_dir() -> Path:
    try:
        return fuzz.cached_build()
    except fuzz.FuzzSetupError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(fuzz.TARGETS))
def test_short_fuzz_run_is_clean(target, build_dir, tmp_path):
    r = fuzz.run(target, build_dir, tmp_path / "corpus", max_time=SECONDS_PER_TARGET)
    assert r.clean, r.describe()
    assert r.runs and r.runs > 0, r.describe()
    assert r.cov and r.cov > 0, r.describe()


@pytest.mark.slow
@pytest.mark.parametrize("crash", CRASHES, ids=[f"{p.parent.name}/{p.name}" for p in CRASHES])
def test_saved_crash_no_longer_crashes(crash, build_dir):
    # native/fuzz/crashes/<target>/<input>: every input a fuzzer once crashed on.
    r = subprocess.run([str(build_dir / crash.parent.name), str(crash)], capture_output=True, text=True)
    report = [line for line in r.stderr.splitlines()
              if "ERROR" in line or "SUMMARY" in line or "invariant" in line or line.lstrip().startswith(("#0 ", "#1 ", "#2 "))]
    assert r.returncode == 0, f"{crash} still crashes {crash.parent.name}:\n" + "\n".join(report[:12])
