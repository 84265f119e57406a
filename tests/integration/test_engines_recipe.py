"""docs/engines.md's "Your model + the fleet" recipe runs as written against a real `ngramcache serve`.

The block is taken from the page (only the service's address is replaced by the test's), run in a
fresh interpreter in an empty folder, with the real SmolLM2 model through transformers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.service import start_serve, stop_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINES = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def recipe() -> str:
    text = ENGINES.read_text(encoding="utf-8")
    section = text[text.index("### Your model + the fleet"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/engines.md: no python block under 'Your model + the fleet'"
    return m.group(1)


def test_your_model_and_the_fleet_runs_as_written(tmp_path: Path) -> None:
    code = recipe()
    assert 'SERVER = "127.0.0.1:50051"' in code
    proc, port = start_serve(tmp_path / "serve")
    try:
        script = tmp_path / "work" / "recipe.py"
        script.parent.mkdir()
        script.write_text(code.replace('SERVER = "127.0.0.1:50051"', f'SERVER = "127.0.0.1:{port}"'))
        r = subprocess.run([sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True, timeout=600)
    finally:
        stop_serve(proc)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["tokens"] == 64 and stats["accepted"] > 0 and stats["steps"] < 64, stats
    assert (script.parent / "my-model-tokenizer" / "tokenizer.json").is_file()
