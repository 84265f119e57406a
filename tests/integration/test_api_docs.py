"""docs/api.md, the Python API reference, is what docs/gen_api.py writes from the docstrings, and covers every export."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ngramcache

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "docs" / "gen_api.py"
API = ROOT / "docs" / "api.md"


def gen(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(cwd / "docs" / "gen_api.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_api_md_is_current():
    r = gen("--check")
    assert r.returncode == 0, r.stderr


@pytest.fixture
def tree_copy(tmp_path):
    """The sources the generator reads, copied, so a test may change a docstring without touching the checkout."""
    for folder in ("client", "cache_service"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("_proto", "__pycache__", "*.so"))
    (tmp_path / "docs").mkdir()
    shutil.copy(GEN, tmp_path / "docs" / "gen_api.py")
    shutil.copy(API, tmp_path / "docs" / "api.md")
    return tmp_path


def test_check_fails_when_a_docstring_changes(tree_copy):
    assert gen("--check", cwd=tree_copy).returncode == 0
    errors = tree_copy / "client" / "kernel" / "errors.py"
    errors.write_text(errors.read_text().replace('"""Base class of every ngramcache error.',
                                                 '"""Base class of every ngramcache error (reworded).', 1))
    r = gen("--check", cwd=tree_copy)
    assert r.returncode == 1
    assert r.stderr.strip() == "docs/api.md is stale: run `python docs/gen_api.py` and commit the result"
    r = gen(cwd=tree_copy)
    assert r.returncode == 0, r.stderr
    assert "Base class of every ngramcache error (reworded)." in (tree_copy / "docs" / "api.md").read_text()
    assert gen("--check", cwd=tree_copy).returncode == 0


def test_an_export_defined_nowhere_is_an_error(tree_copy):
    init = tree_copy / "client" / "__init__.py"
    init.write_text(init.read_text().replace("__all__ = [", '__all__ = [\n    "NoSuchName",', 1))
    r = gen("--check", cwd=tree_copy)
    assert r.returncode == 2
    assert r.stderr.strip() == "gen_api: NoSuchName is exported by ngramcache.client but defined nowhere in its sources"


def headings(text: str) -> set[str]:
    return set(re.findall(r"^#{2,3} `([^`]+)`", text, re.M))


def test_every_export_has_its_section():
    text = API.read_text()
    names = headings(text)
    for name in ngramcache.__all__:
        assert name in names, f"docs/api.md lacks ngramcache.{name}"
    modules = ["ngramcache.client.adapters", *(f"ngramcache.client.adapters.{p.stem}"
               for p in sorted((ROOT / "client" / "adapters").glob("*.py")) if not p.name.startswith("_"))]
    for module in modules:
        assert module in names, f"docs/api.md lacks the module {module}"
    # The package imports no engine; its submodules need the engines' extras, so only its own names are checked here.
    from ngramcache.client import adapters
    for name in adapters.__all__:
        assert f"ngramcache.client.adapters.{name}" in names
    for name in ("vllm.NgramCacheProposer", "llama_cpp.NgramDraftModel", "transformers.generate",
                 "draft_length.DraftLengthPolicy", "batch_rows.BatchRows"):
        assert f"ngramcache.client.adapters.{name}" in names


def test_a_documented_function_shows_its_signature_and_docstring_sections():
    text = API.read_text()
    section = text.split("### `AdminClient`", 1)[1].split("\n### ", 1)[0]
    assert "class AdminClient(\n    address: str,\n    *,\n    token: str | None = None," in section
    assert "#### `AdminClient.publish`" in section
    assert "**Raises:**\n\n- `CacheFormatError`: the file is not a valid static cache (checked here first)." in section


def test_output_holds_no_address_or_local_path():
    text = API.read_text()
    assert not re.search(r"0x[0-9a-f]{6,}", text), "an object address leaked into docs/api.md"
    assert str(ROOT) not in text
    assert "/home/" not in text and "/root/" not in text
