"""The benchmarks: each `bench_*.py` / `replay_*.py` here is a program (`python tests/bench/NAME.py --help`) that
prints figures and ratios against a baseline measured in the same run; `test_*.py` beside them are their tests.

- `lib/`: what the benchmarks share (workloads, the fleet simulator, peers' drafters, engine replicas).
- `engines/`: builders of the engines the tests and benchmarks run against (llama.cpp, llama-server,
  SuffixDecoding, the vLLM environment); the test command runs them.
- `data/`: recorded workloads.

Imported as the package `bench` (tests/ is on the path: pytest's, and each program puts it there
itself), never as top-level names.
"""
