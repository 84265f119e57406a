"""A reinstall (``pip install '.[extra]'`` after ``pip install .``) reuses the compiled core.

pip builds each install in a new isolated environment, and two things made every install
compile the whole core again (3-4 minutes on 2 cores): nanobind sits at a new path each time,
and scikit-build-core, seeing a new environment, deletes the build folder's CMakeCache.txt and
its top CMakeFiles/ folder. native/CMakeLists.txt compiles against a copy of nanobind at a
fixed path in the build folder (each file rewritten only where its content changed) and
defines its targets in subfolders (src/, bindings/), whose objects that deletion leaves alone.
Here: two configures from two environments, the second after the same deletion, give the
same compile commands, none naming an environment, with every object outside CMakeFiles/,
and leave the copy's headers untouched, so ninja finds everything up to date.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nanobind
import pytest

ROOT = Path(__file__).resolve().parents[2]


def configure(build: Path, site: Path) -> None:
    """CMake's configure of native/ (no compiling) with nanobind found in `site`, as in one pip build environment."""
    tools = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    cmake = shutil.which("cmake", path=tools)
    ninja = shutil.which("ninja", path=tools)
    if cmake is None or ninja is None:
        pytest.fail("cmake and ninja are test dependencies (pip install '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([cmake, "-S", str(ROOT / "native"), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    "-DNGC_BUILD_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}",
                    "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"], check=True, capture_output=True, env=env)


def test_a_build_from_another_environment_compiles_against_the_same_nanobind_copy(tmp_path: Path) -> None:
    package = Path(nanobind.__file__).parent
    sites = [tmp_path / "env-a", tmp_path / "env-b"]
    for site in sites:
        shutil.copytree(package, site / "nanobind")
    build = tmp_path / "build"

    configure(build, sites[0])
    first = json.loads((build / "compile_commands.json").read_text())
    copy = build / "nanobind"
    header = copy / "include" / "nanobind" / "nanobind.h"
    stamp = header.stat().st_mtime_ns if header.exists() else None
    (build / "CMakeCache.txt").unlink()  # what scikit-build-core does for a new isolated environment
    shutil.rmtree(build / "CMakeFiles")
    configure(build, sites[1])
    second = json.loads((build / "compile_commands.json").read_text())

    commands = [entry["command"] for entry in first + second]
    assert not [c for c in commands if str(tmp_path / "env-") in c]  # never against an environment's path
    assert any(str(copy) in c for c in commands)  # the bindings compile against the copy
    assert [e["command"] for e in first] == [e["command"] for e in second]  # so nothing is out of date
    assert all(not Path(e["output"]).parts[0] == "CMakeFiles" for e in first)  # nor deleted
    assert header.stat().st_mtime_ns == stamp  # nor is any header of the copy
