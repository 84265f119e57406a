"""Docstrings name only parameters that exist: every Google-style ``Args:`` entry is a parameter of its function.

A function's ``Args:`` are checked against its own parameters, a class's against its
``__init__`` (or, without one, its annotated fields: a dataclass's). An entry may name several
parameters (``tls_cert, tls_key: ...``); ``*args`` and ``**kwargs`` are documented as such. A
function that passes its ``**kwargs`` on (``g(**kwargs)``) may also document the keyword names it
passes. Read from the sources with `ast`: nothing is imported, so this test needs no build.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("client", "cache_service")
# One entry of an Args section: ``name: ...``, ``name (type): ...``, ``a, b: ...``, ``*args: ...``, ``**kwargs: ...``.
ENTRY = re.compile(r"(?P<names>\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?\s*:(?:\s|$)")
SECTION = re.compile(r"(Args|Arguments):\s*$")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def documented(docstring: str) -> Iterator[tuple[int, str]]:
    """(line within the docstring, name as written, stars included) of every ``Args:`` entry."""
    lines = docstring.splitlines()
    i = 0
    while i < len(lines):
        if not SECTION.fullmatch(lines[i].strip()):
            i += 1
            continue
        section_indent = len(lines[i]) - len(lines[i].lstrip())
        entry_indent: int | None = None
        i += 1
        while i < len(lines):
            line = lines[i]
            if line.strip():
                indent = len(line) - len(line.lstrip())
                if indent <= section_indent:
                    break  # the next section (Returns:, Raises:) or the prose after it
                if entry_indent is None:
                    entry_indent = indent
                if indent == entry_indent:
                    match = ENTRY.match(line.strip())
                    names = match.group("names") if match else line.strip()
                    for name in names.split(","):
                        yield i, name.strip()
            i += 1


@dataclass(frozen=True)
class Parameters:
    named: set[str]
    varargs: str | None = None  # the *args name
    kwargs: str | None = None  # the **kwargs name
    passes_kwargs_on: bool = False  # the body calls something with **kwargs: it may document their names


def parameters(node: Function) -> Parameters:
    a = node.args
    kwargs = a.kwarg.arg if a.kwarg else None
    passes_on = kwargs is not None and any(
        isinstance(k, ast.keyword) and k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwargs
        for k in ast.walk(node))
    return Parameters({p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}, a.vararg.arg if a.vararg else None,
                      kwargs, passes_on)


def class_parameters(node: ast.ClassDef) -> Parameters | None:
    """A class's constructor parameters: its ``__init__``'s, else its annotated fields (None: neither)."""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
            return parameters(item)
    fields = {item.target.id for item in node.body
              if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return Parameters(fields) if fields else None


def problems(name: str, docstring: str, params: Parameters) -> Iterator[str]:
    for line, written in documented(docstring):
        bare = written.lstrip("*")
        stars = len(written) - len(bare)
        if (stars == 1 and bare == params.varargs) or (stars == 2 and bare == params.kwargs):
            continue
        if stars == 0 and (bare in params.named or params.passes_kwargs_on):
            continue
        if not re.fullmatch(r"\w+", bare):
            yield f"{name}: Args entry {written!r} (docstring line {line + 1}) is no parameter name"
        else:
            yield f"{name}: documents {written!r} (docstring line {line + 1}), which it does not take"


def findings_in(path: Path, shown: str) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))

    def visit(body: list[ast.stmt], scope: str) -> Iterator[str]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{scope}{node.name}"
                docstring = ast.get_docstring(node)
                if docstring:
                    yield from (f"{shown}:{node.lineno}: {p}" for p in problems(name, docstring, parameters(node)))
                yield from visit(node.body, f"{name}.")
            elif isinstance(node, ast.ClassDef):
                name = f"{scope}{node.name}"
                docstring = ast.get_docstring(node)
                params = class_parameters(node)
                if docstring and params is not None:
                    yield from (f"{shown}:{node.lineno}: {p}" for p in problems(name, docstring, params))
                yield from visit(node.body, f"{name}.")

    yield from visit(tree.body, "")


def findings(root: Path = ROOT) -> list[str]:
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue  # generated
            found += findings_in(path, path.relative_to(root).as_posix())
    return found


def test_every_documented_argument_is_a_parameter() -> None:
    assert findings() == []


GOOD = '''
def f(a, b, *rest, c=1, **options):
    """F.

    Args:
        a: the first.
        b (int): the second,
            over two lines: c: is no entry.
        *rest: more.
        c, d: passed on through **options.
        **options: the others.

    Returns:
        e: not an argument.
    """
    return g(**options)


class K:
    """K.

    Args:
        x: one.
    """

    def __init__(self, x):
        pass


class Fields:
    """Fields (a dataclass).

    Args:
        y: one.
    """

    y: int
'''


@pytest.mark.parametrize(("source", "why"), [
    ('def f(a):\n    """F.\n\n    Args:\n        a: one.\n        b: gone.\n    """\n', "f: documents 'b'"),
    ('def f(a, *args):\n    """F.\n\n    Args:\n        **kwargs: none.\n    """\n', "f: documents '**kwargs'"),
    ('def f(**kw):\n    """F.\n\n    Args:\n        b: not passed on.\n    """\n    return dict(kw)\n', "f: documents 'b'"),
    ('class K:\n    """K.\n\n    Args:\n        x: gone.\n    """\n\n    def __init__(self, state):\n        pass\n',
     "K: documents 'x'"),
    ('class K:\n    def m(self, a):\n        """M.\n\n        Args:\n            a, b: two.\n        """\n',
     "K.m: documents 'b'"),
    ('async def f(a):\n    """F.\n\n    Args:\n        a: one.\n        see above\n    """\n', "is no parameter name"),
])
def test_a_stale_argument_is_found(tmp_path: Path, source: str, why: str) -> None:
    """The checker itself: a docstring naming one parameter too many is reported, with its function."""
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    found = list(findings_in(bad, "bad.py"))
    assert len(found) == 1 and found[0].startswith("bad.py:") and why in found[0], found


def test_documented_parameters_pass(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(GOOD)
    assert list(findings_in(good, "good.py")) == []
