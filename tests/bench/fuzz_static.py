"""Coverage-guided fuzzing of the static cache reader and the llama.cpp reader.

Builds the libFuzzer targets of native/fuzz/ (clang, ASan + UBSan) into build/fuzz, writes
their seed corpora with the core's own writers, then runs each target, one at a time on one
core, until it has executed --runs inputs (10M by default) or --max-time seconds have
passed. Prints per target: executions, exec/s, coverage (cov: edges, ft: features), corpus
size, peak RSS, wall time, and any crash with the path of the input that caused it. The
corpus a run grows is kept in build/fuzz/corpus/<target> and seeds the next run.

    nice -n 10 python tests/bench/fuzz_static.py                    # 10M executions a target
    python tests/bench/fuzz_static.py --runs 200000 --target fuzz_llama_reader

Exits 1 when a target crashed; native/fuzz/README.md says how to reproduce and keep it.
tests/native/test_fuzz.py runs the same targets for a few seconds each.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FUZZ_SRC = ROOT / "native" / "fuzz"
BUILD_DIR = ROOT / "build" / "fuzz"
# Builds kept for the tests, one folder per key (native/'s files and the compiler): a clean clone
# of an unchanged core runs the targets built before instead of compiling them again.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ngramcache" / "fuzz"
# target -> (seed corpus written by make_seeds, dictionary in native/fuzz)
TARGETS = {
    "fuzz_static_cache": ("static", "static.dict"),
    "fuzz_llama_reader": ("llama", "llama.dict"),
}
MAX_LEN = 4096  # bytes; the seeds are at most 1.5 KB
INSTALL_HINT = ("tests/run_all.sh installs them as root (apt-get install clang libclang-rt-<version>-dev); "
                "or install them yourself")


class FuzzSetupError(RuntimeError):
    """The fuzz targets cannot be built here (no clang, no libFuzzer runtime, a build error)."""


@dataclass
class FuzzRun:
    """What one libFuzzer run reported."""

    target: str
    returncode: int
    runs: int | None        # executions ("Done N runs", or the final stats)
    exec_per_s: int | None  # libFuzzer's average over the run
    cov: int | None         # edges covered, at the last status line
    ft: int | None          # features (edges x hit-count buckets, ...)
    corpus: int | None      # inputs in the corpus at the end
    peak_rss_mb: int | None
    seconds: float          # wall time, start-up included
    crash: str | None       # the saved input that crashed, if any
    summary: str | None     # the sanitizer's or libFuzzer's one-line verdict
    log: Path               # libFuzzer's full output

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and self.crash is None

    def describe(self) -> str:
        head = (f"{self.target}: exit {self.returncode}, {self.runs} runs, {self.exec_per_s} exec/s, "
                f"cov {self.cov} ft {self.ft}, corpus {self.corpus}, {self.seconds:.0f} s")
        if self.clean:
            return head
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        return f"{head}\ncrash input: {self.crash}\n{self.summary}\n--- last lines of {self.log} ---\n{tail}"


def _tool(name: str) -> str | None:
    # cmake and ninja come with the test extras, in the environment running this script.
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def build(build_dir: Path = BUILD_DIR) -> Path:
    """Configures and builds the targets and tools, rewrites the seed corpora; returns build_dir.

    Raises FuzzSetupError with what to install when clang or its libFuzzer runtime is missing.
    """
    clang = shutil.which("clang++")
    if clang is None:
        raise FuzzSetupError(f"clang++ is not installed: the fuzz targets need clang with libFuzzer. {INSTALL_HINT}.")
    runtime = subprocess.run([clang, "-print-runtime-dir"], capture_output=True, text=True).stdout.strip()
    if not list(Path(runtime).glob("libclang_rt.fuzzer*.a")):
        raise FuzzSetupError(f"clang's libFuzzer runtime is missing from {runtime or 'its runtime directory'}. "
                             f"{INSTALL_HINT}.")
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if cmake is None:
        raise FuzzSetupError("cmake is needed (the test extras install it: pip install -e '.[test]')")
    configure = [cmake, "-S", str(FUZZ_SRC), "-B", str(build_dir), f"-DCMAKE_CXX_COMPILER={clang}"]
    if ninja and not (build_dir / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    for step in (configure, [cmake, "--build", str(build_dir), "-j", "2"]):
        r = subprocess.run(step, capture_output=True, text=True)
        if r.returncode != 0:
            raise FuzzSetupError(f"{' '.join(step)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    write_seeds(build_dir)
    return build_dir


def cached_build(cache_dir: Path = CACHE_DIR) -> Path:
    """build() into cache_dir/<key>, the key a hash of native/'s files and clang's version: a build
    made before from the same sources is reused (its seeds rewritten), a missing or unfinished one is
    made anew. Returns the build folder."""
    clang = shutil.which("clang++")
    if clang is None:
        return build()  # raises FuzzSetupError with what to install
    h = hashlib.sha256(subprocess.run([clang, "--version"], capture_output=True, text=True).stdout.encode())
    for path in sorted(p for p in (ROOT / "native").rglob("*") if p.is_file()):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    build_dir = cache_dir / h.hexdigest()[:24]
    done = build_dir / ".complete"
    if done.exists():
        write_seeds(build_dir)
        return build_dir
    shutil.rmtree(build_dir, ignore_errors=True)  # an unfinished build, maybe configured by another clone
    build(build_dir)
    done.touch()
    return build_dir


def write_seeds(build_dir: Path) -> None:
    """Rewrites the seed corpora of build_dir/seeds with the built make_seeds."""
    seeds = build_dir / "seeds"
    shutil.rmtree(seeds, ignore_errors=True)
    subprocess.run([str(build_dir / "make_seeds"), str(seeds / "static"), str(seeds / "llama")],
                   check=True, capture_output=True)


def _last_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def run(target: str, build_dir: Path, corpus_dir: Path, *, runs: int | None = None, max_time: int | None = None,
        seed: int = 1) -> FuzzRun:
    """Runs `target` on one core until `runs` executions or `max_time` seconds, whichever first.

    New inputs go to `corpus_dir`; the seeds in build_dir are read, never written. A crash
    input is saved under build_dir/artifacts/<target>/.
    """
    seeds_name, dictionary = TARGETS[target]
    corpus_dir.mkdir(parents=True, exist_ok=True)
    artifacts = build_dir / "artifacts" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    log = corpus_dir.parent / f"{target}.log"
    cmd = [str(build_dir / target), f"-seed={seed}", f"-max_len={MAX_LEN}", f"-dict={FUZZ_SRC / dictionary}",
           f"-artifact_prefix={artifacts}/", "-print_final_stats=1", "-timeout=10"]
    if runs is not None:
        cmd.append(f"-runs={runs}")
    if max_time is not None:
        cmd.append(f"-max_total_time={max_time}")
    cmd += [str(corpus_dir), str(build_dir / "seeds" / seeds_name)]
    env = dict(os.environ, UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    crash = re.findall(r"Test unit written to (\S+)", text)
    summary = re.findall(r"^(SUMMARY: .*|==\d+== ERROR: libFuzzer: .*|fuzz invariant violated: .*)$", text, re.M)
    status = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)/", text)
    return FuzzRun(
        target=target,
        returncode=rc,
        runs=_last_int(r"Done (\d+) runs", text) or _last_int(r"stat::number_of_executed_units:\s+(\d+)", text),
        exec_per_s=_last_int(r"stat::average_exec_per_sec:\s+(\d+)", text),
        cov=int(status[-1][0]) if status else None,
        ft=int(status[-1][1]) if status else None,
        corpus=int(status[-1][2]) if status else None,
        peak_rss_mb=_last_int(r"stat::peak_rss_mb:\s+(\d+)", text),
        seconds=seconds,
        crash=crash[-1] if crash else None,
        summary=summary[0] if summary else None,
        log=log,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000_000, help="executions per target (default 10M)")
    ap.add_argument("--max-time", type=int, default=None, help="seconds per target at most (default: no limit)")
    ap.add_argument("--target", choices=sorted(TARGETS), action="append", help="only this target (repeatable)")
    ap.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed (default 1)")
    ap.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    args = ap.parse_args()
    try:
        build_dir = build(args.build_dir)
    except FuzzSetupError as e:
        print(e, file=sys.stderr)
        return 2
    clang = subprocess.run(["clang++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"{clang}; -fsanitize=fuzzer,address,undefined; seed {args.seed}; one job, one worker\n")
    results = []
    for target in args.target or list(TARGETS):
        print(f"running {target} ({args.runs} runs{f', at most {args.max_time} s' if args.max_time else ''})...",
              flush=True)
        r = run(target, build_dir, build_dir / "corpus" / target, runs=args.runs, max_time=args.max_time,
                seed=args.seed)
        results.append(r)
        print(r.describe(), flush=True)
    print("\n| target | executions | exec/s | cov | ft | corpus | peak RSS MB | seconds | result |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        verdict = "clean" if r.clean else f"CRASH {r.crash} ({r.summary})"
        print(f"| {r.target} | {r.runs} | {r.exec_per_s} | {r.cov} | {r.ft} | {r.corpus} | {r.peak_rss_mb} | "
              f"{r.seconds:.0f} | {verdict} |")
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
