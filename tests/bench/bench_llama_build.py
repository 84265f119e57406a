"""What the portable llama.cpp build costs: plain decoding tokens/s of SmolLM2-135M with the portable wheel against a native one.

The test command builds llama-cpp-python for the x86-64-v3 baseline (tests/bench/engines/build_llama_cpp.py)
so that one build runs on every machine of this project's kind. This benchmark builds (or reuses
from the same cache) a second wheel with ``-DGGML_NATIVE=ON`` (``-march=native``: the fastest build
that runs on this machine, and only here), unpacks both, and times greedy decoding with each in
alternating child processes, so both see the same machine load.

    python tests/bench/bench_llama_build.py [--rounds 5] [--tokens 128] [--threads 2]
    python tests/bench/bench_llama_build.py --quick    # checks the script: 1 round of 4 tokens (figures meaningless)

With --quick and no native wheel cached yet (its build takes minutes), the portable wheel
stands in for both rows, and the report says so.

Prints, per build and round, prompt and decode tokens/s, then the medians and native/portable
ratios, and a checksum of the generated tokens (the same for both builds is expected but not
required: float rounding may differ).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: bench.engines

from helpers.model import smollm2_gguf  # noqa: E402

from bench.engines.build_llama_cpp import DEFAULT_CACHE, PORTABLE_CMAKE_ARGS, build_wheel, cached_wheel  # noqa: E402

NATIVE_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
    "Explain in three sentences what a hash table is and when to use one.",
    "Convert this list to JSON: name Alice, age 30, city Paris; name Bob, age 25, city Rome.",
]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import llama_cpp
model, n_tokens, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
out = []
for prompt in json.loads(sys.argv[5]):
    llm.reset()
    tokens = llm.tokenize(prompt.encode())
    t0 = time.perf_counter()
    llm.eval(tokens)
    t_prompt = time.perf_counter() - t0
    generated = []
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        token = int(llm.sample(top_k=1, temp=0.0))
        generated.append(token)
        llm.eval([token])
    t_decode = time.perf_counter() - t0
    out.append({"prompt_tps": len(tokens) / t_prompt, "decode_tps": n_tokens / t_decode, "tokens": generated})
print(json.dumps(out))
"""


def unpack(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest


def run_once(site: Path, model: Path, tokens: int, threads: int) -> list[dict[str, object]]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(site), str(model), str(tokens), str(threads),
                        json.dumps(PROMPTS)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"child failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    result: list[dict[str, object]] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per build, alternating (default 5)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheel cache (build_llama_cpp.py's)")
    ap.add_argument("--quick", action="store_true",
                    help="checks the script: 1 round of 4 tokens; the portable wheel stands in for a native one not "
                    "built yet (figures meaningless)")
    args = ap.parse_args()
    builds = {"portable": PORTABLE_CMAKE_ARGS, "native": NATIVE_CMAKE_ARGS}
    if args.quick:
        args.rounds, args.tokens = 1, 4
        if cached_wheel(args.cache, NATIVE_CMAKE_ARGS) is None:
            print("--quick: no native wheel cached (building one takes minutes): the portable wheel stands in for it")
            builds["native"] = PORTABLE_CMAKE_ARGS
    wheels = {name: build_wheel(args.cache, flags) for name, flags in builds.items()}
    model = smollm2_gguf()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in builds}
    checksums: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sites = {name: unpack(wheel, Path(tmp) / name) for name, wheel in wheels.items()}
        for i in range(args.rounds):
            for name in builds:
                runs = run_once(sites[name], model, args.tokens, args.threads)
                prompt_tps = statistics.median(float(r["prompt_tps"]) for r in runs)  # type: ignore[arg-type]
                decode_tps = statistics.median(float(r["decode_tps"]) for r in runs)  # type: ignore[arg-type]
                checksums[name] = zlib.crc32(json.dumps([r["tokens"] for r in runs]).encode())
                results[name].append((prompt_tps, decode_tps))
                print(f"round {i + 1} {name:8s}: prompt {prompt_tps:8.1f} tok/s  decode {decode_tps:6.1f} tok/s", flush=True)
    print()
    print("| build | CMake flags | prompt tok/s (median) | decode tok/s (median) |")
    print("|---|---|---:|---:|")
    med = {}
    for name, flags in builds.items():
        p = statistics.median(x for x, _ in results[name])
        d = statistics.median(y for _, y in results[name])
        med[name] = (p, d)
        print(f"| {name} | `{flags}` | {p:.1f} | {d:.1f} |")
    print(f"\nportable / native: prompt {med['portable'][0] / med['native'][0]:.3f}x, "
          f"decode {med['portable'][1] / med['native'][1]:.3f}x "
          f"({args.rounds} rounds, {len(PROMPTS)} prompts x {args.tokens} tokens, {args.threads} threads)")
    print(f"token checksums: portable {checksums['portable']:08x}, native {checksums['native']:08x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
