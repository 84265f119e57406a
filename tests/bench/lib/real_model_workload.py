"""bench_real_model.py's workload: functions of CPython's standard library quoted in code-editing requests.

Worker A's requests take FUNCS_PER_FILE functions from each of its files; two thirds of worker
B's requests are on A's functions with another instruction than A's (the overlapping requests),
the rest on functions of files of its own. The order is fixed by the seed.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
KINDS = ("repeat", "type hints", "docstring", "rename")
FUNCS_PER_FILE = 3


@dataclass
class Function:
    file: str  # relative to the stdlib folder
    name: str  # qualified name
    code: str  # dedented source, ending with a newline
    rename: tuple[str, str] | None  # (old, new) for a rename request, if the function has a fit variable


@dataclass
class Request:
    worker: str  # "A" or "B"
    function: Function
    kind: str  # one of KINDS
    overlap: bool  # a request of B on a function A had
    ids: list[int] = field(default_factory=list)  # the prompt's token ids

    def message(self) -> str:
        f = self.function
        fence = f"```python\n{f.code}```"
        if self.kind == "repeat":
            return f"Repeat this code exactly:\n{fence}"
        if self.kind == "type hints":
            return f"Add type hints to this function and reply with the whole function:\n{fence}"
        if self.kind == "docstring":
            return f"Write a better docstring for this function and reply with the whole function:\n{fence}"
        assert f.rename is not None
        old, new = f.rename
        return f"Rename the variable `{old}` to `{new}` in this function and reply with the whole function:\n{fence}"


def stdlib_files() -> tuple[Path, list[Path]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(lib).parts))
    return lib, files


def rename_target(node: ast.AST, code: str) -> tuple[str, str] | None:
    """The argument or assigned local used most often in `code` (at least twice), renamed to new_<name>."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg) and sub.arg not in ("self", "cls"):
            names.add(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
    uses = sorted(((len(re.findall(rf"\b{re.escape(n)}\b", code)), n) for n in names if len(n) >= 2), key=lambda t: (-t[0], t[1]))
    if not uses or uses[0][0] < 2 or f"new_{uses[0][1]}" in code:
        return None
    return uses[0][1], f"new_{uses[0][1]}"


def file_functions(lib: Path, path: Path) -> list[Function]:
    """Module-level functions and methods of classes (nested ones excluded) of a fit size."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out: list[Function] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                code = textwrap.dedent("".join(lines[start - 1:node.end_lineno]))
                n_lines = code.count("\n")
                if 500 <= len(code) <= 1200 and n_lines >= 10 and code.isascii():
                    code = code if code.endswith("\n") else code + "\n"
                    out.append(Function(str(path.relative_to(lib)), prefix + node.name, code, rename_target(node, code)))

    visit(tree.body, "")
    return out


def build_workload(n_requests: int, seed: int) -> tuple[list[Request], list[Request], set[str]]:
    """Worker A's and worker B's requests (fixed order) and the files they quote."""
    lib, files = stdlib_files()
    rng = random.Random(seed)
    eligible = [(p, fs) for p in files if len(fs := file_functions(lib, p)) >= FUNCS_PER_FILE]
    rng.shuffle(eligible)
    n_a = (n_requests + 1) // 2
    n_b = n_requests - n_a
    n_overlap = min(n_a, round(n_b * 2 / 3))
    n_own = n_b - n_overlap

    def take(n: int) -> list[Function]:
        chosen: list[Function] = []
        while len(chosen) < n:
            _, funcs = eligible.pop(0)
            chosen += rng.sample(funcs, FUNCS_PER_FILE)[: n - len(chosen)]
        return chosen

    def kind_for(func: Function, k: int) -> str:
        kind = KINDS[k % len(KINDS)]
        return kind if kind != "rename" or func.rename else "repeat"

    a_funcs, b_own = take(n_a), take(n_own)
    offset = rng.randrange(len(KINDS))
    reqs_a = [Request("A", f, kind_for(f, offset + i), False) for i, f in enumerate(a_funcs)]
    reqs_b = []
    for r in rng.sample(reqs_a, n_overlap):
        others = [k for k in KINDS if k != r.kind and (k != "rename" or r.function.rename)]
        reqs_b.append(Request("B", r.function, rng.choice(others), True))
    reqs_b += [Request("B", f, kind_for(f, offset + 1 + i), False) for i, f in enumerate(b_own)]
    rng.shuffle(reqs_a)
    rng.shuffle(reqs_b)
    quoted = {f.file for f in a_funcs + b_own}
    return reqs_a, reqs_b, quoted
