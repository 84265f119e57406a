"""tests/helpers/isolation.py: a test marked `engine` that dies of a signal fails with the signal and its child's last output; the run goes on and counts every test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def make_project(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    engine: runs in a child process\naddopts = --strict-markers\n")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from helpers.isolation import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol
    """))
    (tmp_path / "test_engine.py").write_text(textwrap.dedent("""
        import os, signal, sys
        import pytest

        pytestmark = pytest.mark.engine

        @pytest.fixture(scope="module")
        def pid():
            return os.getpid()

        def test_before(pid):
            assert pid == os.getpid()

        def test_illegal_instruction(pid):
            print("loading the engine", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGILL)

        def test_after(pid):
            assert pid != int(os.environ.get("PARENT_PID", "0"))

        def test_plain_failure():
            assert 1 + 1 == 3

        @pytest.mark.parametrize("n", [1, 2])
        def test_segfault_then_more(n):
            if n == 1:
                os.kill(os.getpid(), signal.SIGSEGV)
    """))
    (tmp_path / "test_inprocess.py").write_text("import os\n\ndef test_in_process():\n"
                                                "    assert int(os.environ['PARENT_PID']) > 0\n")
    return tmp_path


def test_signal_in_an_engine_test_fails_that_test_and_the_run_goes_on(tmp_path):
    project = make_project(tmp_path)
    code = "import os, sys, pytest; os.environ['PARENT_PID'] = str(os.getpid()); sys.exit(pytest.main(['-q', '-rf', '-p', 'no:cacheprovider']))"
    r = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "3 failed, 4 passed" in out, out
    assert "died of signal SIGILL" in out and "died of signal SIGSEGV" in out, out
    # the child's output: Python's fault handler naming the crash and the test it happened in
    assert "Fatal Python error: Illegal instruction" in out and "in test_illegal_instruction" in out, out
    assert "FAILED test_engine.py::test_illegal_instruction" in out
    assert "FAILED test_engine.py::test_segfault_then_more[1]" in out
    assert "FAILED test_engine.py::test_plain_failure" in out and "assert (1 + 1) == 3" in out, out


def test_collecting_the_engine_tests_imports_no_engine_in_pytest_s_own_process():
    # llama-cpp-python opens two /dev/null files at import and never closes them: imported in the
    # parent, they ended the test command with two "ResourceWarning: unclosed file" lines. The
    # engine tests run in child processes, so only those may import it.
    code = ("import sys, pytest\n"
            "rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/integration/test_adapter_llama_cpp.py'])\n"
            "assert rc == 0, rc\n"
            "print('engines imported:', sorted({'llama_cpp'} & set(sys.modules)))\n")
    r = subprocess.run([sys.executable, "-X", "dev", "-c", code], cwd=TESTS.parent, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engines imported: []" in r.stdout, r.stdout
    assert "ResourceWarning" not in r.stderr, r.stderr
