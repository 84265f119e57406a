"""Builds llama-cpp-python's wheel portably, cached in a folder keyed by its version and build flags.

llama-cpp-python ships only a source distribution: pip compiles llama.cpp at install time, for
whatever CMAKE_ARGS say, and caches the wheel by package version alone, so a wheel built with other
flags (or natively, on another CPU) is silently reused. This script builds the wheel itself into
`<cache>/llama-cpp-python-<version>-<key>/`, where the key hashes everything that changes the
binary (version, CMake flags, Python tag, platform, compiler), and installs that wheel.

The default flags are the x86-64 baseline every machine of this project's kind has: AVX, AVX2,
FMA, F16C, BMI2 (x86-64-v3), with AVX-512, AVX-VNNI and AMX off and no -march=native. Why not
llama.cpp's runtime-dispatched CPU variants (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS): they need
the caller to load the backends (llama-cpp-python 0.3.36 never calls ggml_backend_load_all), they
compile the CPU backend about ten times, and on an Intel CPU with AMX the dispatcher would pick the
variant whose AMX kernels crash here. docs/architecture.md ("Portability") has the measured cost.

    python tests/bench/engines/build_llama_cpp.py [--install] [--cmake-args "..."] [--cache DIR] [--force]

Prints the wheel's path on stdout; progress goes to stderr. A rerun with the wheel cached builds
nothing. --install puts it into this Python unless that exact wheel is already installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
# Bump when the recipe below changes the binary without changing the flags.
RECIPE = 1
PORTABLE_CMAKE_ARGS = " ".join([
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DGGML_BACKEND_DL=OFF",
    # The multimodal library (mtmd) is not used by the adapters: not compiling it saves build time.
    "-DLLAVA_BUILD=OFF",
])
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ngramcache" / "engines"


class BuildError(Exception):
    """A step failed; the message says which and why (printed without a traceback)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compiler_id() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or "cc"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "none"
    return out.splitlines()[0] if out else "unknown"


def cache_key(cmake_args: str) -> str:
    """Hashes everything that changes the built binary."""
    what = {"package": PACKAGE, "version": VERSION, "recipe": RECIPE, "cmake_args": cmake_args.split(),
            "python": sys.implementation.cache_tag, "platform": sysconfig.get_platform(), "compiler": compiler_id()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def wheel_dir(cache: Path, cmake_args: str) -> Path:
    return cache / f"{PACKAGE}-{VERSION}-{cache_key(cmake_args)}"


def cached_wheel(cache: Path, cmake_args: str) -> Path | None:
    found = sorted(wheel_dir(cache, cmake_args).glob("*.whl"))
    return found[0] if found else None


def run_logged(cmd: list[str], what: str, log_file: Path, env: dict[str, str] | None = None) -> None:
    """Runs `cmd` with its output in log_file, saying every minute that it still runs."""
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(60):
            log(f"  ... {what}: {time.monotonic() - start:.0f} s")

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        with log_file.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    except OSError as e:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {e}") from None
    finally:
        done.set()
    if r.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").strip().splitlines()[-25:])
        raise BuildError(f"{what} failed (exit {r.returncode}); last lines of its output:\n{tail}\n(full log: {log_file})")


def download_sdist(cache: Path, log_file: Path) -> Path:
    folder = cache / "sdists"
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    if (folder / name).is_file():
        return folder / name
    folder.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE}=={VERSION}'s source distribution (76 MB) with pip...")
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
                "--disable-pip-version-check", "-d", str(folder), f"{PACKAGE}=={VERSION}"], "pip download", log_file)
    if not (folder / name).is_file():
        raise BuildError(f"pip download succeeded but {folder / name} is not there")
    return folder / name


def build_wheel(cache: Path, cmake_args: str, force: bool = False) -> Path:
    """Returns the cached wheel for these flags, building it first if there is none (or if force)."""
    wheel = cached_wheel(cache, cmake_args)
    if wheel is not None and not force:
        return wheel
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {cache}: {e}") from None
    log_file = cache / "build.log"
    sdist = download_sdist(cache, log_file)
    target = wheel_dir(cache, cmake_args)
    jobs = str(os.cpu_count() or 1)
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": jobs}
    log(f"compiling {PACKAGE} {VERSION} with CMAKE_ARGS={cmake_args!r} ({jobs} jobs; about 3-4 min on 2 cores)...")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-") as tmp:
        # --no-cache-dir: pip's wheel cache is keyed by version only, never reuse or fill it here.
        run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
                    "-w", tmp, str(sdist)], f"building {PACKAGE}", log_file, env=env)
        built = sorted(Path(tmp).glob("*.whl"))
        if len(built) != 1:
            raise BuildError(f"pip wheel finished but left {len(built)} wheels in {tmp}")
        staging = Path(tmp) / "out"
        staging.mkdir()
        shutil.move(str(built[0]), staging / built[0].name)
        (staging / "build-flags.json").write_text(json.dumps({"cmake_args": cmake_args, "version": VERSION}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # the folder appears whole or not at all
    wheel = cached_wheel(cache, cmake_args)
    assert wheel is not None
    log(f"built {wheel}")
    return wheel


def installed_from() -> str | None:
    """The file the installed llama-cpp-python came from (pip's direct_url.json), or None."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    url = json.loads(text).get("url", "")
    return url.removeprefix("file://") if url.startswith("file://") else None


def install(wheel: Path) -> bool:
    """Installs `wheel` into this Python unless it is what is installed; True if it installed."""
    if installed_from() == str(wheel.resolve()):
        return False
    log(f"installing {wheel.name} (replacing any {PACKAGE} built with other flags)...")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for extra in (["--force-reinstall", "--no-deps"], []):  # this wheel, then its dependencies
        r = subprocess.run([*pip, *extra, str(wheel)])
        if r.returncode != 0:
            raise BuildError(f"pip install {wheel} failed (exit {r.returncode})")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE})")
    ap.add_argument("--cmake-args", default=PORTABLE_CMAKE_ARGS,
                    help="CMake flags of the build (default: the portable x86-64-v3 baseline; see the module docstring)")
    ap.add_argument("--install", action="store_true", help="install the wheel into this Python")
    ap.add_argument("--force", action="store_true", help="build again even if a wheel for these flags is cached")
    args = ap.parse_args(argv)
    try:
        wheel = build_wheel(args.cache.expanduser().resolve(), args.cmake_args, args.force)
        if args.install:
            install(wheel)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
