"""Builds SuffixDecoding (arctic-inference's suffix tree) for the drafting benchmark's peers.

SuffixDecoding's reference implementation ships in arctic-inference's source distribution:
a C++ suffix tree (csrc/suffix_decoding, bound with nanobind as
`arctic_inference.suffix_decoding._C`) and the Python wrapper vLLM's "suffix" method calls
(`arctic_inference/suffix_decoding/cache.py`, `SuffixDecodingCache`). This script fetches that
sdist with pip, unpacks only those parts and builds just that one extension module with CMake
(nice'd, one job), against the nanobind installed in this Python. Nothing of it is committed:
everything lives in the cache folder (default .bench-data/peers/, gitignored).

    python tests/bench/engines/build_suffix_decoding.py [--dest DIR] [--sdist FILE] [--force]

It prints one line on stdout: the folder to put on sys.path so that
`from arctic_inference.suffix_decoding import SuffixDecodingCache` works
(tests/bench/lib/peer_drafters.py looks there by default). Progress goes to stderr. A rerun with
the module already built does nothing but print that folder. pip's metadata step imports torch
(arctic-inference's setup.py does), so torch must be installed in this Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DEST = ROOT / ".bench-data" / "peers"
PACKAGE = "arctic-inference"
VERSION = "0.3.0"
SDIST_NAME = f"arctic_inference-{VERSION}"
# The parts of the sdist we use: the wrapper package and the extension's sources.
KEEP_PREFIXES = (
    "LICENSE",
    "arctic_inference/__init__.py",
    "arctic_inference/suffix_decoding/",
    "csrc/suffix_decoding/",
)


class BuildError(Exception):
    """A step failed; the message says which and why (printed without a traceback)."""


def lib_dir(dest: Path) -> Path:
    """The folder to add to sys.path: the unpacked sdist, holding the `arctic_inference` package."""
    return dest / SDIST_NAME


def module_path(dest: Path) -> Path:
    """Where the built extension lands, named for this interpreter (e.g. _C.cpython-311-x86_64-linux-gnu.so)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return lib_dir(dest) / "arctic_inference" / "suffix_decoding" / f"_C{suffix}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], what: str, log_file: Path, hint: str = "", hint_if: str = "") -> None:
    """Runs `cmd`, appending its output to log_file; a failure raises BuildError with its last lines
    (and `hint`, when the output mentions `hint_if` or hint_if is empty)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {e}") from None
    with log_file.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        extra = f"\n{hint}" if hint and hint_if in r.stdout + r.stderr else ""
        raise BuildError(f"{what} failed (exit {r.returncode}); last lines of its output:\n{tail}\n(full log: {log_file}){extra}")


def niced(cmd: list[str]) -> list[str]:
    nice = shutil.which("nice")
    return [nice, "-n", "10", *cmd] if nice else cmd


def find_tool(name: str) -> str | None:
    """The tool beside this Python (a venv's pip-installed cmake/ninja) first, then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def download_sdist(dest: Path, log_file: Path) -> Path:
    found = sorted(dest.glob(f"{SDIST_NAME}.tar.gz"))
    if found:
        return found[0]
    log(f"downloading {PACKAGE}=={VERSION}'s source distribution with pip...")
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
         "-d", str(dest), f"{PACKAGE}=={VERSION}"],
        "pip download", log_file,
        hint="(pip reads the sdist's metadata by running its setup.py, which imports torch: torch must be installed here)",
        hint_if="torch")
    found = sorted(dest.glob(f"{SDIST_NAME}.tar.gz"))
    if not found:
        raise BuildError(f"pip download succeeded but {dest / (SDIST_NAME + '.tar.gz')} is not there")
    return found[0]


def unpack(sdist: Path, dest: Path) -> None:
    """Extracts the wrapper package and the extension's sources into lib_dir(dest)."""
    top = f"{SDIST_NAME}/"
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(top):] if m.name.startswith(top) else ""
                if not rel or not rel.startswith(KEEP_PREFIXES):
                    continue
                if m.name.startswith("/") or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                    raise BuildError(f"{sdist}: unexpected member {m.name!r}")
                members.append(m)
            if not any(m.name.endswith("csrc/suffix_decoding/CMakeLists.txt") for m in members):
                raise BuildError(f"{sdist} has no csrc/suffix_decoding/CMakeLists.txt: not the expected sdist")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:  # Python < 3.10.12: members were checked above
                tar.extractall(dest, members=members)
    except (tarfile.TarError, OSError) as e:
        raise BuildError(f"cannot unpack {sdist}: {e}") from None


def build(dest: Path, log_file: Path) -> None:
    src = lib_dir(dest) / "csrc" / "suffix_decoding"
    out = module_path(dest).parent
    build_dir = lib_dir(dest) / "build"
    cmake = find_tool("cmake")
    if cmake is None:
        raise BuildError("cmake not found (neither beside this Python nor on PATH): `pip install cmake`")
    r = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"nanobind is not importable from {sys.executable}: `pip install nanobind`\n{r.stderr.strip()}")
    ninja = find_tool("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    log(f"building SuffixDecoding's extension from {src} (nice'd, one job)...")
    run(niced([cmake, "-S", str(src), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
               f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"]),
        "cmake configure", log_file,
        hint="(needs a C++20 compiler, Python's development headers and nanobind)")
    run(niced([cmake, "--build", str(build_dir), "-j", "1"]), "cmake build (compiler)", log_file)
    if not module_path(dest).exists():
        built = sorted(p.name for p in out.glob("_C*"))
        raise BuildError(f"the build finished but {module_path(dest)} is missing (found: {built or 'nothing'})")


def check_import(dest: Path, log_file: Path) -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from arctic_inference.suffix_decoding import SuffixDecodingCache; "
            "c = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10); c.start_request(0, [1, 2, 1]); "
            "assert c.speculate(0, [1, 2, 1], max_spec_tokens=2).token_ids == [2]")
    run([sys.executable, "-c", code, str(lib_dir(dest))], "importing the built module", log_file)


def ensure_built(dest: Path = DEFAULT_DEST, sdist: Path | None = None, force: bool = False) -> Path:
    """Downloads, unpacks and builds unless already built; returns the folder to add to sys.path."""
    if module_path(dest).exists() and not force:
        return lib_dir(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {dest}: {e}") from None
    log_file = dest / "build.log"
    if sdist is None:
        sdist = download_sdist(dest, log_file)
    elif not sdist.is_file():
        raise BuildError(f"--sdist {sdist}: no such file")
    if force and lib_dir(dest).exists():
        shutil.rmtree(lib_dir(dest))
    unpack(sdist, dest)
    build(dest, log_file)
    check_import(dest, log_file)
    log(f"built {module_path(dest)}")
    return lib_dir(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"cache folder (default {DEFAULT_DEST})")
    ap.add_argument("--sdist", type=Path, help=f"use this {SDIST_NAME}.tar.gz instead of downloading it")
    ap.add_argument("--force", action="store_true", help="unpack and build again even if the module is there")
    args = ap.parse_args(argv)
    try:
        folder = ensure_built(args.dest.resolve(), args.sdist, args.force)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(folder)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
