"""The hostile-input tests again under AddressSanitizer and UBSan, the concurrency tests under ThreadSanitizer.

ASan + UBSan: a damaged static file must give an error or "not found", never an out-of-bounds
read. ASan does not see into a mapping, so its build reads static files into a heap block of
exactly their size instead of mapping them (``-DNGC_HEAP_FILES=ON``): a read past a file's last
byte is then a heap-buffer-overflow. The rerun (format, count-table, drafter, match-mode,
builder, llama, rows, replay and draft-view tests, in a child process that loads that build)
refuses to start unless ``StaticCache.open_mode`` says "heap", and native/sanitize/read_past_end
shows that a read one byte past a static file's end is reported.

TSan: the concurrent drafting and count-table tests (drafts and counts compared with a serial
run of the same operations) rerun in a child process that loads a core built with
-fsanitize=thread, the tsan runtime preloaded as the ASan one is. Python itself is not
instrumented, so only the core's accesses are checked, and threads overlap only inside the calls
that release the GIL (drafts, accepts, updates; most do). native/sanitize/concurrency_check adds
what the GIL hides: the same kind of operations (and the match mode's shared history) from
native threads with no GIL between them, compared with a serial run in C++. TSan's deadlock
detector stays on here; it stops with a CHECK failure once a thread holds more than 64 locks,
which the core does when it evicts many sequences at once, so a test that evicts cannot join
this run unless ``detect_deadlocks=0`` is added.

Each build is kept in ``~/.cache/ngramcache/<asan|tsan>/<key>``, the key a hash of every file
of native/, the flags and options, the compiler, Python and nanobind: a rerun on an unchanged
core loads it instead of compiling it again, as the engine builds are cached. Sanitizer reports
go to files (``log_path``), so one that stops the child is still shown in the failure.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ngramcache import UNTAGGED, build_static_from_tokens

ROOT = Path(__file__).resolve().parents[2]

# Loads the sanitized core as ngramcache.client._core before any test imports ngramcache.
PLUGIN = '''
import glob, importlib.util, sys
path = glob.glob("{build}/_core*.so")[0]
spec = importlib.util.spec_from_file_location("ngramcache.client._core", path)
module = importlib.util.module_from_spec(spec)
sys.modules["ngramcache.client._core"] = module
spec.loader.exec_module(module)
'''

# The ASan rerun's claim holds only if static files are heap blocks: checked before any test.
HEAP_CHECK = '''
open_mode = None


def pytest_configure(config):
    global open_mode
    import os, tempfile, numpy, pytest
    path = os.path.join(tempfile.mkdtemp(), "probe.ngc")
    module.build_static_from_tokens([numpy.arange(8, dtype=numpy.int32)], path, vocab_size=8,
                                    fingerprint=module.UNTAGGED)
    open_mode = module.StaticCache.open(path).open_mode
    os.unlink(path)
    if open_mode != "heap":
        raise pytest.UsageError(f"the sanitized core opens static files as {open_mode!r}, not 'heap': ASan "
                                "would not see reads past their end (build it with -DNGC_HEAP_FILES=ON)")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"ngramcache: static files opened as {open_mode}")
'''


def runtime(name: str) -> str:
    return subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()


@dataclass(frozen=True)
class Build:
    """One sanitizer build of native/: the Python module and the drivers of native/sanitize/."""

    name: str  # the cache folder under ~/.cache/ngramcache
    flags: str  # CMAKE_CXX_FLAGS
    options: tuple[str, ...]  # native/CMakeLists.txt's options
    products: tuple[str, ...]  # what is kept, relative to the build folder (globs)


# -O1, as AddressSanitizer's documentation advises for speed: the rerun took 151 s here against 225 s at -O0.
ASAN = Build("asan", "-O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined",
             ("-DNGC_HEAP_FILES=ON", "-DNGC_SANITIZER_DRIVERS=ON"),
             ("bindings/_core*.so", "sanitize/read_past_end", "sanitize/concurrency_check"))
TSAN = Build("tsan", "-O1 -g -fsanitize=thread", ("-DNGC_SANITIZER_DRIVERS=ON",),
             ("bindings/_core*.so", "sanitize/concurrency_check"))


def build_key(build: Build, nanobind_version: str) -> str:
    """What a sanitized build depends on: native/'s files, the flags and options, the compiler, Python
    and nanobind (versions and contents, not paths: another clone of the same code finds the same build)."""
    h = hashlib.sha256()
    for path in sorted(p for p in (ROOT / "native").rglob("*") if p.is_file()):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    h.update("\0".join([build.flags, *build.options, compiler, sys.version, nanobind_version]).encode())
    return h.hexdigest()[:24]


def sanitized_build(build: Build, scratch: Path) -> Path:
    """The folder holding the build's products (_core*.so and the drivers): the cached build, or a
    new one (then cached)."""
    import nanobind

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ngramcache" / build.name
    target = cache / build_key(build, nanobind.__version__)
    if all(list(target.glob(Path(p).name)) for p in build.products):
        return target
    folder = scratch / "build"
    # The test extras install cmake and ninja into the environment running the tests.
    tools = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cmake = shutil.which("cmake", path=tools)
    assert cmake, "cmake is needed (pip install cmake)"
    configure = [
        cmake, "-S", str(ROOT / "native"), "-B", str(folder), "-DNGC_BUILD_PYTHON=ON", "-DCMAKE_BUILD_TYPE=Debug",
        *build.options, f"-DCMAKE_CXX_FLAGS={build.flags}", f"-Dnanobind_DIR={nanobind.cmake_dir()}",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    ninja = shutil.which("ninja", path=tools)
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    subprocess.run(configure, check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(folder), "-j", "2"], check=True, capture_output=True)
    built = [path for p in build.products for path in folder.glob(p)]
    assert len(built) == len(build.products), f"the {build.name} build made {built}, not all of {build.products}"
    try:  # cached whole or not at all: copied to a folder of its own, then renamed into place
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
        for path in built:
            shutil.copy2(path, staging / path.name)
        os.replace(staging, target)
    except OSError:  # a full or read-only cache (or another run's build just renamed in): use this one
        staging = scratch / "products"
        staging.mkdir(exist_ok=True)
        for path in built:
            shutil.copy2(path, staging / path.name)
        return staging
    return target


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory) -> Path:
    return sanitized_build(ASAN, tmp_path_factory.mktemp("asan"))


@pytest.fixture(scope="module")
def tsan_build(tmp_path_factory) -> Path:
    return sanitized_build(TSAN, tmp_path_factory.mktemp("tsan"))


def sanitizer_env(build: Build, logs: Path) -> dict[str, str]:
    """The environment of a child running under `build`'s sanitizer: reports go to files under `logs`."""
    logs.mkdir(exist_ok=True)
    if build is ASAN:
        return dict(os.environ, ASAN_OPTIONS=f"detect_leaks=0:abort_on_error=1:log_path={logs}/asan",
                    UBSAN_OPTIONS=f"print_stacktrace=1:log_path={logs}/ubsan")
    return dict(os.environ, TSAN_OPTIONS=f"halt_on_error=1:second_deadlock_stack=1:log_path={logs}/tsan")


def reports(logs: Path) -> str:
    """Every sanitizer report written under `logs` (empty when none)."""
    return "".join(p.read_text(errors="replace")[:6000] for p in sorted(logs.iterdir()))


def rerun(build: Build, folder: Path, tests: list[str], tmp_path: Path, plugin: str = "") -> subprocess.CompletedProcess:
    """pytest on `tests` in a child process that loads the core of `folder`, its sanitizer's runtime preloaded."""
    (tmp_path / "sanitized_core.py").write_text(PLUGIN.format(build=folder) + plugin)
    preload = [runtime("libasan.so"), runtime("libubsan.so")] if build is ASAN else [runtime("libtsan.so")]
    assert all(map(os.path.exists, preload)), f"g++ ships {preload}"
    env = dict(sanitizer_env(build, tmp_path / "logs"), LD_PRELOAD=":".join(preload), PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "sanitized_core", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_hostile_input_tests_pass_under_asan_and_ubsan(asan_build, tmp_path):
    tests = [str(ROOT / "tests/unit" / name) for name in
             ("test_static_format.py", "test_count_table.py", "test_drafter.py", "test_llama_format.py", "test_builder.py",
              "test_match_mode.py", "test_draft_view.py", "test_replay.py", "test_rows.py")]
    r = rerun(ASAN, asan_build, tests, tmp_path, HEAP_CHECK)
    found = reports(tmp_path / "logs")
    assert r.returncode == 0, found + r.stdout[-4000:] + r.stderr[-4000:]
    assert not found, found
    assert "passed" in r.stdout and "ngramcache: static files opened as heap" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_asan_reports_a_read_past_a_static_files_end(asan_build, tmp_path):
    """What the heap copy buys: read_past_end reads a static file's last byte, then the one after
    it. The last byte must be read; the next must stop the program with ASan's report (a mapped
    file, as a release core has, would let it through unseen)."""
    path = tmp_path / "tiny.ngc"
    build_static_from_tokens([np.arange(50, dtype=np.int32) % 7], path, vocab_size=8, fingerprint=UNTAGGED)
    assert path.stat().st_size % 4096 != 0  # a mapping's last page would hold the byte past the end
    r = subprocess.run([str(asan_build / "read_past_end"), str(path)], capture_output=True, text=True,
                       env=sanitizer_env(ASAN, tmp_path / "logs"))
    found = reports(tmp_path / "logs")
    assert f"open_mode=heap size={path.stat().st_size}" in r.stdout, r.stdout + r.stderr
    assert "last byte:" in r.stdout and "past the end" not in r.stdout, r.stdout
    assert r.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in found and "READ of size 1" in found, found


@pytest.mark.slow
@pytest.mark.parametrize("build", [ASAN, TSAN], ids=lambda b: b.name)
def test_native_concurrency_check_equals_the_serial_run(build, request, tmp_path):
    """native/sanitize/concurrency_check: drafts from native threads while writers change the
    dynamic table and the static cache is swapped, and a count table written by several threads
    while others read it, each compared with a serial run of the same operations."""
    folder = request.getfixturevalue(f"{build.name}_build")
    r = subprocess.run([str(folder / "concurrency_check"), str(tmp_path)], capture_output=True, text=True,
                       env=sanitizer_env(build, tmp_path / "logs"))
    found = reports(tmp_path / "logs")
    assert r.returncode == 0 and not found, found + r.stdout + r.stderr
    assert r.stdout.startswith("ok: ") and "drafted tokens equal to the serial run's" in r.stdout, r.stdout


@pytest.mark.slow
def test_concurrency_tests_pass_under_tsan(tsan_build, tmp_path):
    tests = ["tests/unit/test_drafter.py::test_parallel_drafts_equal_serial_drafts_while_the_mirror_and_static_change",
             "tests/unit/test_count_table.py::test_parallel_writers_and_readers_equal_a_serial_run"]
    r = rerun(TSAN, tsan_build, tests, tmp_path)
    found = reports(tmp_path / "logs")
    assert r.returncode == 0 and not found, found + r.stdout[-4000:] + r.stderr[-4000:]
    assert "2 passed" in r.stdout, r.stdout[-2000:]
