"""Every benchmark the docs quote runs end to end in its --quick mode, so none rots unnoticed.

README.md and docs/*.md quote figures of the scripts in tests/bench/; each such script is
either a benchmark with a --quick mode, run here in a child process (its figures are not
checked, only that it ran to the end and printed its table), or listed in NOT_BENCHMARKS
with the reason (build tools the test command runs itself, modules other tests cover).
The runs go four at a time in a pool started by the first test, the longest first (much of
their time is waiting on servers, sleeps and child processes); a benchmark whose heavy prerequisite is
missing (a llama-server or llama.cpp tools build of minutes, not part of the test command)
is skipped, saying what to build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tests" / "bench"
TIMEOUT_S = 400  # one quick run, from its start (not its wait in the pool): a hung benchmark fails, it does not stall the run
POOL = 4

pytestmark = pytest.mark.slow


def _have(*modules: str) -> str | None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed (the test command installs it)" if missing else None


def _llama_tools() -> str | None:
    from bench.compare_llama import built_tools

    if built_tools() is None:
        return "llama.cpp's lookup tools are not built (tests/bench/engines/build_llama_server.py, which the test command runs)"
    return None


def _llama_server() -> str | None:
    from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, TARGET, server_dir

    binary = server_dir(DEFAULT_CACHE, SERVER_CMAKE_ARGS) / TARGET
    return None if binary.exists() else f"{binary} is not built (tests/bench/engines/build_llama_server.py, minutes)"


def _vllm_env() -> str | None:
    from bench.bench_vllm import VLLM_PYTHON

    return None if VLLM_PYTHON.is_file() else f"no vLLM virtualenv at {VLLM_PYTHON} (tests/bench/engines/build_vllm_env.py)"


def _portable_wheel() -> str | None:
    from bench.engines.build_llama_cpp import DEFAULT_CACHE, PORTABLE_CMAKE_ARGS, cached_wheel

    if cached_wheel(DEFAULT_CACHE, PORTABLE_CMAKE_ARGS) is None:
        return "the portable llama-cpp-python wheel is not cached (the test command builds it: build_llama_cpp.py --install)"
    return _have("llama_cpp")


@dataclass(frozen=True)
class Quick:
    """How one benchmark's quick run is started and what its output must hold."""

    args: tuple[str, ...]  # after the script's path; "{data}" is the quick corpus folder
    expect: tuple[str, ...]  # regexes its output (stdout and stderr) must match: its table, its last line
    missing: Callable[[], str | None] = lambda: None  # a heavy prerequisite missing: why the run is skipped
    after: str | None = None  # runs once this one has (its data)
    extra: tuple[str, ...] = field(default=())  # more regexes, for what a fix made the report say
    seconds: int = 5  # about how long it runs on an idle 2-core machine: the longest start first
    timeout: int = TIMEOUT_S  # seconds it may take beside the other quick runs before it counts as hung


QUICK: dict[str, Quick] = {
    "bench_client": Quick(("--quick",), (r"## Drafting cost per call", r"## Push to visible.*\n.*p50 \d+ ms"), seconds=10),
    "bench_concurrency": Quick(("--quick",), (r"ratio 2/1", r"p99 during the apply: [\d.]+ us"), seconds=8),
    "bench_counts_store": Quick(("--quick",), (r"changes_since with 1000 changed buckets", r"checksum \(sum of counts"),
                                extra=(r"every row rated in raw delta rows/s",
                                       r"baseline: plain HINCRBY pipelined.*apply_group [\d.]+x",
                                       r"context only: one HINCRBY round trip per entry")),
    "bench_draft_path": Quick(("--quick",), (r"transformers +auto", r"target: the drafting path <= 100 us per step")),
    "bench_transformers_device": Quick(("--device", "cpu", "--requests", "1", "--max-new-tokens", "16", "--setups",
                                        "pld16,auto", "--threads", "2", "--out", "{data}/transformers_device",
                                        "--time-limit", "480"),
                                       (r"\| auto \|", r"auto vs pld16: tokens/forward [\d.]+x"),
                                       missing=lambda: _have("torch", "transformers"), seconds=30,
                                       timeout=900),  # its own --time-limit (480 s) stops it first
    "replay_transformers_drafts": Quick(("{data}/transformers_device/results.json", "--setups", "pld16,auto-gpu-costs"),
                                        (r"auto-gpu-costs: [\d.]+ tokens/forward", r"auto-gpu-costs / pld16: [\d.]+x"),
                                        missing=lambda: _have("torch", "transformers"), after="bench_transformers_device"),
    "bench_drafting_modes": Quick(("--quick", "--data-dir", "{data}"), (r"\| compatible +\| static 2-gram", r"Wall time"),
                                  after="prepare_corpus"),
    "bench_failover": Quick(("--quick",), (r"\| 1 \| [\d,]+ \| [\d,]+ \| [\d.]+ \| [\d.]+ \| \d+ \|",
                                            r"checksum: store == acknowledged, nothing over-counted"),
                            extra=(r"min 1 / min 0 ingest: [\d.]+x rows/s",
                                   r"\| 1 \| \S+ \| \S+ \| \d+ \| [\d,]+ \| [\d,]+ \| 0 \| \d+ \|"), seconds=20),
    "bench_fleet_history": Quick(("--quick",), (r"\| repeated, K=\d", r"total \d+ s"), seconds=10),
    "bench_fleet_history_e2e": Quick(("--quick",), (r"sampled fleet +\d+", r"fleet/siloed tokens per pass"),
                                     missing=lambda: _have("torch", "transformers"), seconds=30),
    "bench_fleet_load": Quick(("--quick",), (r"\| 3x2x16 \| [\d,]+ \| .* \| [\d,]+ / [\d,]+ \|\n",
                                             r"checksum: nothing acknowledged lost .* in 1/1 ramps"),
                              extra=(r"push->draftable p50 \d+ ms, p99 \d+ ms",
                                     r"\| 3x2x16 \| [\d.]+ / [\d.]+ / [\d.]+ \| -?[\d.]+ /"),
                              seconds=15),
    "bench_fleet_history_service": Quick(("--quick", "--ks", "2", "--workloads", "rollout", "--siloed"),
                                         (r"\| rollout, K=2", r"real siloed [\d.]+", r"total \d+ s"), seconds=20),
    "bench_fleet_mirror": Quick(("--quick",), (r"replay of the held-out files", r"from 10 to 20 clients")),
    "bench_history_groups": Quick(("--quick",), (r"\| the service's own \(RemoteDrafter",)),
    "bench_history_lag": Quick(("--quick",), (r"accept on A -> draftable on B: p50", r"checksum [0-9a-f]+")),
    "bench_history_memory": Quick(("--quick",), (r"MEMORY USAGE stream", r"read: [\d,]+ records/s; checksum")),
    "bench_history_partitions": Quick(("--quick",), (r"\| H=3, gathered \| [\d,]+ \|", r"3 vs 1d: [\d.]+x tokens per busy"),
                                      seconds=15),
    "bench_llama_build": Quick(("--quick",), (r"\| portable \|", r"portable / native: prompt"), missing=_portable_wheel,
                               seconds=20),
    "bench_llama_follow": Quick(("--quick",), (r"\| overlap \| 1 \|", r"target: served from the new generation within 3 s"),
                                missing=_llama_server, seconds=40),
    "bench_llama_server": Quick(("--quick",), (r"setup +tok/s", r"best built-in type"), missing=_llama_server),
    "bench_overload": Quick(("--quick",), (r"shedding point: [\d,]+ rows/s", r"checksum: store == acked in 2/2"), seconds=12),
    # llama.cpp, plain and the local drafters: transformers and the service (d, f) and cost-aware (g, h) setups
    # add minutes (the transformers adapter runs in bench_fleet_history_e2e and the integration tests).
    # the README's "1.17x" is transformers' (b) against (c) and (d): both engines, those setups
    "bench_real_model": Quick(("--quick", "--engine", "both", "--setups", "a,b,c,d"),
                              (r"## transformers .*\n(.*\n)*\(d\) ngramcache \+ service .* \d/\d", r"## llama-cpp-python",
                               r"s in all"),
                              missing=lambda: _have("transformers", "llama_cpp"), seconds=150, timeout=1200),
    "bench_rebuild": Quick(("--quick",), (r"replay of the held-out files", r"counts \+ corpus base, decay 0.25")),
    "bench_service": Quick(("--quick",), (r"## Session step", r"Pss sum / file"),
                           extra=(r"service, 8 clients, 2 pushes in flight each: .* [\d.]+x direct apply_group "
                                  r"\(target > 1x",), seconds=20),
    "bench_sglang_sync": Quick(("--quick",), (r"\| gen \| documents \| tokens", r"push-to-listed on every server: "
                                              r"median [\d.]+ s", r"checksum [0-9a-f]+; total")),
    "bench_static": Quick(("--quick", "--data-dir", "{data}"), (r"\| 25mb \|", r"result checksum"), after="prepare_corpus",
                          extra=(r"heap load s / RSS MB \(ngramcache's loader of the llama.cpp file\)",)),
    "bench_token_encoding": Quick(("--quick",), (r"packed / bytes time", r"result checksum \d+")),
    "bench_vllm": Quick(("--quick",), (r"edits, num_speculative_tokens 8\n", r"ngc +[\d.]+ +[\d.]+ .* \d/\d",
                                       r"B with the fleet / alone: [\d.]+x steps"),
                        missing=_vllm_env, seconds=150, timeout=1200),  # 7 engine replicas, each loads a model
    "bench_vllm_proposer": Quick(("--quick", "--speculator"), (r"checksum \(a\) [0-9a-f]+ +\(b\) [0-9a-f]+ +equal",
                                                               r"checksum \(c\) [0-9a-f]+ +\(b\) padded [0-9a-f]+ +equal"),
                                 missing=lambda: _have("torch")),
    "compare_llama": Quick(("--quick", "--data-dir", "{data}"), (r"3\. drafting:", r"\| static \| ngramcache stats"),
                           missing=_llama_tools, after="prepare_corpus"),
    "prepare_corpus": Quick(("--quick", "--data-dir", "{data}"), (r"300mb +\d+", r"tokens/s on \d+ threads")),
    "replay_vllm_drafts": Quick(("--quick",), (r"num_speculative_tokens 8\n", r"oracle +[\d.]+ +[\d.]+  \[\d+, \d+\]"),
                                missing=_vllm_env, seconds=40, timeout=900),  # one engine replica, then the replay
}

# Scripts the docs name that are not benchmarks of their own, and what keeps them from rotting.
NOT_BENCHMARKS = {
    "engines/build_llama_cpp": "the test command runs it (its llama-cpp-python build); tests/native/test_portability.py checks the result",
    "engines/build_suffix_decoding": "the test command runs it; tests/native/test_portability.py checks the result",
    "engines/build_vllm_env": "the test command runs it (.venv-vllm); tests/integration/test_vllm_engine.py uses the result",
    "lib/vllm_replica": "one engine replica of bench_vllm and tests/integration/test_vllm_engine.py, which run it",
    "engines/build_llama_server": "the test command runs it (llama-server and the lookup tools); tests/bench/test_llama_server.py",
    "lib/peer_drafters": "a module of bench_drafting_modes; tests/bench/test_peer_drafters.py",
    "lib/fleet_counts": "a module of bench_fleet_history; tests/bench/test_fleet_sim.py",
    "lib/fleet_sim": "a module of bench_fleet_history; tests/bench/test_fleet_sim.py",
    "record_workloads": "records (once, with the model) the workloads the fleet benchmarks replay; its output is committed",
}


def quoted_scripts() -> set[str]:
    """The tests/bench scripts README.md and docs/*.md name (their tests aside)."""
    names: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        names |= set(re.findall(r"tests/bench/((?:\w+/)?\w+)\.py", doc.read_text(encoding="utf-8")))
    return {n for n in names if not n.startswith("test_")}  # the benchmarks' own tests are no scripts


def test_every_benchmark_the_docs_quote_has_a_quick_run() -> None:
    quoted = quoted_scripts()
    assert quoted, "no tests/bench/ script quoted in README.md or docs/*.md: the scan is broken"
    unknown = sorted(quoted - set(QUICK) - set(NOT_BENCHMARKS))
    assert not unknown, (f"quoted in the docs but never run by the test command: {unknown}; give each a --quick mode "
                         "and an entry in QUICK (or, if it is no benchmark, in NOT_BENCHMARKS with the reason)")
    for name in [*QUICK, *NOT_BENCHMARKS]:
        assert (BENCH / f"{name}.py").is_file(), f"tests/bench/{name}.py is listed here but does not exist"


class QuickRuns:
    """Starts every quick run at once in a pool (a run with an `after` waits for that one); results by name."""

    def __init__(self, data: Path, names: set[str]) -> None:
        self.data = data
        self.pool = ThreadPoolExecutor(POOL, thread_name_prefix="bench-quick")
        self.futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        names |= {QUICK[n].after for n in names if QUICK[n].after is not None}  # type: ignore[misc]
        # Producers of data first, then the longest: four runs end about together.
        ordered = sorted(names, key=lambda n: (QUICK[n].after is not None, -QUICK[n].seconds))
        for name in ordered:
            if QUICK[name].missing() is None:
                self.futures[name] = self.pool.submit(self._run, name)

    def _run(self, name: str) -> subprocess.CompletedProcess[str]:
        quick = QUICK[name]
        if quick.after is not None and quick.after in self.futures:
            self.futures[quick.after].result()
        args = [a.replace("{data}", str(self.data)) for a in quick.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=quick.timeout)

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        # No clock of its own: every run is bounded by its own `timeout` (the subprocess is killed
        # at it), so waiting for a queued run is bounded by the runs ahead of it, however loaded
        # the machine is; a guess here failed runs that were merely queued behind long ones.
        return self.futures[name].result()


@pytest.fixture(scope="module")
def quick_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRuns]:
    data = tmp_path_factory.mktemp("bench-quick-data")
    # Built once by the test command (SuffixDecoding) or a full compare_llama run (llama.cpp's tools): the quick
    # corpus folder gets them where the scripts look, beside their data.
    for sub in ("peers", "llama"):
        if (ROOT / ".bench-data" / sub).is_dir():
            (data / sub).symlink_to(ROOT / ".bench-data" / sub)
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_quick_run" and hasattr(item, "callspec")}
    runs = QuickRuns(data, selected)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_run(name: str, quick_runs: QuickRuns) -> None:
    quick = QUICK[name]
    why = quick.missing()
    if why is not None:
        pytest.skip(f"{name} --quick not run: {why}")
    r = quick_runs.result(name)
    out = r.stdout + r.stderr
    tail = "\n".join(out.splitlines()[-25:])
    assert r.returncode == 0, f"tests/bench/{name}.py {' '.join(map(str, r.args[2:]))} exited {r.returncode}:\n{tail}"
    for pattern in (*quick.expect, *quick.extra):
        assert re.search(pattern, out), f"tests/bench/{name}.py --quick printed no {pattern!r}:\n{tail}"
