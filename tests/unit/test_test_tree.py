"""The test tree keeps its own rules: tests only in the folders that say what they run, and no fixture
redefined under the name a conftest.py gives it (one name, one meaning, wherever a test asks for it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {"unit", "integration", "native", "bench"}


def fixtures(path: Path) -> set[str]:
    """The names of the module-level functions of `path` decorated as pytest fixtures."""
    tree = ast.parse(path.read_text(), str(path))
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any("fixture" in ast.unparse(d) for d in node.decorator_list)}


def shadowed(root: Path = TESTS) -> list[str]:
    found = []
    for conftest in sorted(root.rglob("conftest.py")):
        given = fixtures(conftest)
        for module in sorted(conftest.parent.rglob("*.py")):
            if module == conftest:
                continue
            for name in sorted(fixtures(module) & given):
                found.append(f"{module.relative_to(root)} redefines the fixture {name} of {conftest.relative_to(root)}")
    return found


def test_no_fixture_is_redefined_under_a_conftest_name() -> None:
    assert shadowed() == []


def test_a_redefined_fixture_is_found(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef service():\n    return 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_x.py").write_text("import pytest\n\n@pytest.fixture(scope='module')\ndef service():\n    return 2\n")
    assert shadowed(tmp_path) == ["sub/test_x.py redefines the fixture service of conftest.py"]


def test_every_test_lives_in_a_folder_that_says_what_it_runs() -> None:
    stray = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
             if p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert stray == []


def test_a_unit_test_can_start_no_process_and_open_no_socket() -> None:
    """tests/unit/conftest.py holds this very test to its rule."""
    import socket
    import subprocess
    import sys

    import grpc
    import pytest

    with pytest.raises(AssertionError, match="a unit test started a process: move it to tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with socket.socket() as s, pytest.raises(AssertionError, match=r"used a socket \(connect\)"):
        s.connect(("127.0.0.1", 9))
    with pytest.raises(AssertionError, match="started a gRPC server"):
        grpc.server(None)
