"""The README's Python snippets run as written, in a fresh interpreter, from an empty folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_snippet_runs_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no Python snippet"
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "' - b\\n'"
    assert (tmp_path / "corpus.ngc").exists()



def test_readme_match_mode_snippet_runs_after_the_first(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    r = subprocess.run([sys.executable, "-c", blocks[0] + blocks[1]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == ["' - b\\n'", "[' -', ' b', '\\n', ' +', ' b', '\\n'] [-1, 0, 1, -1, 3, 4]"]
    assert (tmp_path / "indexed.ngc").exists()
