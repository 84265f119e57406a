"""The hostile-input tests again, against a core built with AddressSanitizer and UBSan.

A damaged static file must give an error or "not found", never an out-of-bounds read: this
builds native/ with -fsanitize=address,undefined into a scratch directory and reruns the
format, count-table and drafter tests in a child process that loads that build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
import glob, importlib.util, sys
path = glob.glob("{build}/_core*.so")[0]
spec = importlib.util.spec_from_file_location("ngramcache.client._core", path)
module = importlib.util.module_from_spec(spec)
sys.modules["ngramcache.client._core"] = module
spec.loader.exec_module(module)
'''


def runtime(name: str) -> str:
    return subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
def test_hostile_input_tests_pass_under_asan_and_ubsan(tmp_path):
    import nanobind

    asan, ubsan = runtime("libasan.so"), runtime("libubsan.so")
    assert os.path.exists(asan) and os.path.exists(ubsan), "g++ ships libasan and libubsan"
    build = tmp_path / "build"
    # The test extras install cmake and ninja into the environment running the tests.
    tools = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cmake = shutil.which("cmake", path=tools)
    assert cmake, "cmake is needed (pip install cmake)"
    configure = [
        cmake, "-S", str(ROOT / "native"), "-B", str(build), "-DNGC_BUILD_PYTHON=ON", "-DCMAKE_BUILD_TYPE=Debug",
        "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined",
        f"-Dnanobind_DIR={nanobind.cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}",
    ]
    ninja = shutil.which("ninja", path=tools)
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    subprocess.run(configure, check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(build), "-j", "2"], check=True, capture_output=True)
    (tmp_path / "asan_core.py").write_text(PLUGIN.format(build=build))
    env = dict(os.environ, LD_PRELOAD=f"{asan}:{ubsan}", ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1", PYTHONPATH=str(tmp_path))
    tests = [ROOT / "tests/unit" / name for name in
             ("test_static_format.py", "test_count_table.py", "test_drafter.py", "test_llama_format.py", "test_builder.py",
              "test_match_mode.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "asan_core", "-p", "no:cacheprovider", *map(str, tests)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "passed" in r.stdout and "ERROR: AddressSanitizer" not in r.stderr
