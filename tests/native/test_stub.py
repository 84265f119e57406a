"""The committed typed stub of the compiled core matches what the bindings generate."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_stub_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "native" / "stubgen.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
