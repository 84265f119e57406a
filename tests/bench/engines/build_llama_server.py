"""Builds llama.cpp's `llama-server` and lookup tools portably from the llama-cpp-python sdist, cached by version and flags.

The llama.cpp vendored by llama-cpp-python 0.3.36 (the sdist build_llama_cpp.py already downloads
and caches) has the server with every n-gram drafting type (`--spec-type ngram-simple,
ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache` and `-lcs/-lcd`). This script compiles the
`llama-server` target and llama.cpp's lookup tools (`llama-lookup-create`, `-stats`, `-merge` and
`llama-tokenize`, which compare_llama.py runs), CPU only, with the same x86-64-v3 baseline flags as
the wheel (GGML_NATIVE=OFF, no AVX-512, AVX-VNNI or AMX), statically linked against llama.cpp's own
libraries, into `<cache>/llama-server-<version>-<key>/`, where the key hashes the version, the
recipe, the CMake flags, the platform and the compiler. A rerun finds them there; the test command
runs it (about 8-10 minutes the first time on 2 cores).

    python tests/bench/engines/build_llama_server.py [--cmake-args "..."] [--cache DIR] [--jobs 2] [--force]

Prints the binary's path on stdout; progress goes to stderr. About 6-8 minutes on 2 cores; run it
under `flock /tmp/ngc-heavy.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, wherever both are (the Docker image has them side by side)
from build_llama_cpp import (
    DEFAULT_CACHE,
    PORTABLE_CMAKE_ARGS,
    VERSION,
    BuildError,
    compiler_id,
    download_sdist,
    log,
    run_logged,
)

# Bump when the recipe below changes the binary without changing the flags.
RECIPE = 2  # 2: the lookup tools beside the server
TARGET = "llama-server"
LOOKUP_TOOLS = ("llama-lookup-create", "llama-lookup-stats", "llama-lookup-merge", "llama-tokenize")
# The wheel's portable CPU flags (LLAVA_BUILD is the wheel's own option, meaningless here), a static
# binary that can be copied into a container as one file, and nothing the benchmark does not use:
# no tests, HTTPS or libcurl (LLAMA_CURL is deprecated in this llama.cpp; OFF says so); examples on, for the
# lookup tools' targets (only the targets named are compiled).
SERVER_CMAKE_ARGS = " ".join(
    [a for a in PORTABLE_CMAKE_ARGS.split() if not a.startswith("-DLLAVA_BUILD")]
    + ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
       "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON"])


def cache_key(cmake_args: str, compiler: str, platform: str) -> str:
    """Hashes everything that changes the built binary (the flags as a list: spacing does not count)."""
    what = {"target": TARGET, "version": VERSION, "recipe": RECIPE, "cmake_args": cmake_args.split(),
            "platform": platform, "compiler": compiler}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def server_dir(cache: Path, cmake_args: str) -> Path:
    return cache / f"{TARGET}-{VERSION}-{cache_key(cmake_args, compiler_id(), sysconfig.get_platform())}"


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extracts the sdist's vendor/llama.cpp into `dest`; returns its root."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        if not members:
            raise BuildError(f"{sdist} holds no vendor/llama.cpp")
        tar.extractall(dest, members=members, filter="data")
    return next(dest.glob("*/vendor/llama.cpp"))


def build_server(cache: Path, cmake_args: str, jobs: int, force: bool = False) -> Path:
    """Returns the cached llama-server for these flags, building it first if there is none (or if force)."""
    target = server_dir(cache, cmake_args)
    binary = target / TARGET
    if all((target / t).is_file() for t in (TARGET, *LOOKUP_TOOLS)) and not force:
        return binary
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not on PATH (pip install cmake, or the system package)")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {cache}: {e}") from None
    log_file = cache / "build-server.log"
    sdist = download_sdist(cache, log_file)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-server-") as tmp:
        root = extract_llama_cpp(sdist, Path(tmp) / "src")
        build = Path(tmp) / "build"
        log(f"configuring llama.cpp ({root.name} of {sdist.name}) with {cmake_args!r}...")
        run_logged(["cmake", "-S", str(root), "-B", str(build), *gen, *cmake_args.split()], "cmake configure", log_file)
        log(f"compiling {TARGET} and {', '.join(LOOKUP_TOOLS)} with {jobs} jobs (about 8-10 min on 2 cores)...")
        run_logged(["cmake", "--build", str(build), "-j", str(jobs), "--target", TARGET, *LOOKUP_TOOLS],
                   f"building {TARGET} and the lookup tools", log_file)
        staging = Path(tmp) / "out"
        staging.mkdir()
        for name in (TARGET, *LOOKUP_TOOLS):
            built = build / "bin" / name
            if not built.is_file():
                raise BuildError(f"the build finished but {built} is not there")
            shutil.copy2(built, staging / name)
        (staging / "build-flags.json").write_text(json.dumps({"cmake_args": cmake_args, "version": VERSION,
                                                              "compiler": compiler_id()}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # the folder appears whole or not at all
    log(f"built {binary}")
    return binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE})")
    ap.add_argument("--cmake-args", default=SERVER_CMAKE_ARGS, help="CMake flags (default: portable x86-64-v3, static)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    ap.add_argument("--force", action="store_true", help="build again even if a binary for these flags is cached")
    args = ap.parse_args(argv)
    try:
        binary = build_server(args.cache.expanduser().resolve(), args.cmake_args, args.jobs, args.force)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
