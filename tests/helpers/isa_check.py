"""Finds instructions outside the x86-64 baseline of this project's machines (AVX-512, AMX, AVX-VNNI) in a built library.

The baseline is x86-64-v3 (AVX, AVX2, FMA, F16C, BMI1/2): every machine of this project's kind
has it, Intel with AMX and AMD without AVX-512 alike. A library loaded unconditionally must use
nothing beyond it; code for newer CPUs is allowed only in runtime-dispatched variants (separate
files chosen after checking the CPU). The scan reads `objdump -d`, so it works on any machine,
one with AVX-512 included, which is what makes it a check that cannot pass by luck.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

BEYOND_BASELINE: dict[str, re.Pattern[str]] = {
    "AVX-512 (zmm registers)": re.compile(r"%zmm\d"),
    "AVX-512 (xmm16-31/ymm16-31 registers)": re.compile(r"%[xy]mm(?:1[6-9]|2\d|3[01])\b"),
    "AVX-512 (opmask registers)": re.compile(r"%k[0-7]\b"),
    "AMX (tile registers or instructions)": re.compile(
        r"%tmm\d|^(?:ldtilecfg|sttilecfg|tileloadd\w*|tilestored|tilezero|tilerelease|tdpb\w+)\b"),
    "AVX-VNNI ({vex} encoded VNNI)": re.compile(r"\{vex\}"),
}


def instructions(path: Path) -> list[str]:
    """The disassembled instructions of `path` (mnemonic and operands, symbols and comments dropped)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("objdump not found (Debian package binutils)")
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) < 2 or not parts[0].strip().endswith(":"):
            continue
        text = re.sub(r"<[^>]*>|#.*$", "", parts[-1]).strip()
        if text:
            found.append(text)
    return found


def beyond_baseline(path: Path) -> dict[str, tuple[int, str]]:
    """For each kind of instruction beyond the baseline found in `path`: how many, and the first one."""
    hits: dict[str, tuple[int, str]] = {}
    for insn in instructions(path):
        for what, pattern in BEYOND_BASELINE.items():
            if pattern.search(insn):
                count, first = hits.get(what, (0, insn))
                hits[what] = (count + 1, first)
    return hits


def is_dispatched_variant(path: Path) -> bool:
    """ggml's runtime-dispatched CPU variants (GGML_BACKEND_DL): libggml-cpu-<variant>.so, loaded only where the CPU has it."""
    return re.fullmatch(r"libggml-cpu-[\w-]+\.so(\.\d+)*", path.name) is not None
