"""Writes docs/api.md, the Python API reference, from the docstrings; `--check` fails when the page is stale.

Usage: ``python docs/gen_api.py`` (writes docs/api.md) or ``python docs/gen_api.py --check``
(exit 1 and a one-line reason when docs/api.md differs from what this script would write).

The page covers every name of ``ngramcache.__all__`` (the names of ``ngramcache.client.__all__``
and ``__version__``) and of the engine adapters (``ngramcache.client.adapters`` and its
submodules). It is read from the source files with ``ast``, never by importing them, so the
output is the same on every machine: it does not depend on which extras (torch, llama-cpp-python,
vLLM) are installed, whether the core is built, or the Python version. The compiled core's
names come from its committed stub, client/_core.pyi. Signatures and defaults are the source
text as written; names are sorted; nothing holds an address or a path of this machine.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"
# Installed package prefix -> the repository folder holding its sources (pyproject.toml's wheel.packages).
PACKAGES = {"ngramcache.client": ROOT / "client", "ngramcache.cache_service": ROOT / "cache_service"}
ADAPTERS = "ngramcache.client.adapters"
SECTIONS = ("Args", "Arguments", "Parameters", "Returns", "Yields", "Raises", "Attributes", "Example", "Examples",
            "Note", "Notes", "Warns")
LIST_SECTIONS = ("Args", "Arguments", "Parameters", "Raises", "Attributes", "Warns")
WRAP = 88  # a signature longer than this is written one parameter a line


class GenerationError(Exception):
    """A name cannot be found in the sources (an export that points nowhere)."""


@dataclass(frozen=True)
class Definition:
    """Where an exported name is defined: its module and its ast node."""

    module: str
    node: ast.AST
    source: str


Function = ast.FunctionDef | ast.AsyncFunctionDef  # a def or an async def



_parsed: dict[str, tuple[ast.Module, str]] = {}


def module_file(module: str) -> Path:
    """The source file of an installed module name (a package's __init__.py; the core's stub)."""
    for prefix, folder in PACKAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            base = folder.joinpath(*module[len(prefix):].split(".")[1:])
            for candidate in (base / "__init__.py", base.with_suffix(".py"), base.with_suffix(".pyi")):
                if candidate.is_file():
                    return candidate
    raise GenerationError(f"no source file for module {module}")


def parse(module: str) -> tuple[ast.Module, str]:
    if module not in _parsed:
        source = module_file(module).read_text(encoding="utf-8")
        _parsed[module] = (ast.parse(source), source)
    return _parsed[module]


def is_package(module: str) -> bool:
    return module_file(module).name == "__init__.py"


def top_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module's statements, with those of top-level try/if blocks (the TYPE_CHECKING ones excepted)."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.Try):
            out += top_statements(stmt.body) + [s for h in stmt.handlers for s in top_statements(h.body)]
        elif isinstance(stmt, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                out += top_statements(stmt.body) + top_statements(stmt.orelse)
        else:
            out.append(stmt)
    return out


def resolve_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) ``from X import ...``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_all(module: str) -> list[str]:
    """The module's ``__all__`` (a list or tuple of string literals)."""
    tree, _ = parse(module)
    for stmt in top_statements(tree.body):
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [str(v) for v in ast.literal_eval(stmt.value)]
    raise GenerationError(f"{module} has no __all__")


def find_definition(module: str, name: str, depth: int = 0) -> Definition:
    """Follows re-exports (``from X import name``) to the statement that defines `name`."""
    if depth > 20:
        raise GenerationError(f"import cycle while looking for {name} in {module}")
    tree, source = parse(module)
    for stmt in top_statements(tree.body):
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return Definition(module, stmt, source)
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return Definition(module, stmt, source)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            return Definition(module, stmt, source)
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return find_definition(resolve_from(module, stmt), alias.name, depth + 1)
    raise GenerationError(f"{name} is exported by {module} but defined nowhere in its sources")


def adapter_modules() -> list[str]:
    """``ngramcache.client.adapters`` and its public submodules, sorted."""
    folder = module_file(ADAPTERS).parent
    subs = sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))
    return [ADAPTERS] + [f"{ADAPTERS}.{s}" for s in subs]



def text_of(node: ast.AST | None, source: str) -> str:
    """The source text of a node, whitespace collapsed (the same on every Python version)."""
    if node is None:
        return ""
    segment = ast.get_source_segment(source, node)
    if segment is None:
        segment = ast.unparse(node)
    return re.sub(r"\s+", " ", segment).replace("( ", "(").replace(" )", ")").replace("[ ", "[").replace(" ]", "]")


def decorator_names(node: ast.ClassDef | Function) -> list[str]:
    names = []
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.append(ast.unparse(target).split(".")[-1])
    return names


def parameters(args: ast.arguments, source: str, drop_first: bool) -> list[str]:
    """A function's parameters as written: annotations and defaults are the source text."""
    out: list[str] = []
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if i == 0 and drop_first:
            continue
        out.append(one_parameter(arg, default, source))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            out.append("/")
    if args.vararg is not None:
        out.append("*" + one_parameter(args.vararg, None, source))
    elif args.kwonlyargs:
        out.append("*")
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(one_parameter(arg, kw_default, source))
    if args.kwarg is not None:
        out.append("**" + one_parameter(args.kwarg, None, source))
    if drop_first and out and out[0] == "/":
        out.pop(0)
    return out


def one_parameter(arg: ast.arg, default: ast.expr | None, source: str) -> str:
    text = arg.arg
    if arg.annotation is not None:
        text += ": " + text_of(arg.annotation, source)
    if default is not None:
        text += (" = " if arg.annotation is not None else "=") + text_of(default, source)
    return text


def signature(prefix: str, params: list[str], returns: str) -> str:
    tail = f" -> {returns}" if returns else ""
    one_line = f"{prefix}({', '.join(params)}){tail}"
    if len(one_line) <= WRAP or not params:
        return one_line
    return prefix + "(\n" + "".join(f"    {p},\n" for p in params) + ")" + tail


def dataclass_fields(node: ast.ClassDef, source: str) -> list[str]:
    """The generated ``__init__``'s parameters of a dataclass: its annotated fields, init=False and ClassVar left out."""
    out = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = text_of(stmt.annotation, source)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        text = f"{stmt.target.id}: {annotation}"
        value = stmt.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
            keywords = {k.arg: k.value for k in value.keywords}
            if "init" in keywords and isinstance(keywords["init"], ast.Constant) and keywords["init"].value is False:
                continue
            if "default" in keywords:
                text += " = " + text_of(keywords["default"], source)
            elif "default_factory" in keywords:
                text += " = " + text_of(keywords["default_factory"], source) + "()"
        elif value is not None:
            text += " = " + text_of(value, source)
        out.append(text)
    return out


def docstring_markdown(doc: str | None) -> str:
    """A Google-style docstring as Markdown: sections in bold, Args/Raises/Attributes entries as lists."""
    if not doc:
        return "*(no docstring)*"
    lines = _cleandoc(doc).splitlines()
    out: list[str] = []
    section: str | None = None
    for line in lines:
        stripped = line.strip()
        header = stripped[:-1] if stripped.endswith(":") and not line.startswith(" ") else None
        if header is not None and header.split(" (")[0] in SECTIONS:  # "Raises (from the calls):" too
            section = header
            out += ["", f"**{header}:**", ""]
            continue
        if section is None:
            out.append(line[:-1] if line.endswith("::") else line)  # reST's literal-block marker
            continue
        if not stripped:
            out.append("")
            continue
        if not line.startswith(" "):  # back to prose after a section
            section = None
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip(" "))
        entry = re.match(r"([\w*.][\w*., ()\[\]|\-]*?):(\s|$)", stripped)
        section_kind = section.split(" (")[0]
        if section_kind in LIST_SECTIONS and indent <= 4 and entry:
            rest = stripped[entry.end():].strip()
            out.append(f"- `{entry.group(1)}`: {rest}".rstrip())
        elif section_kind in LIST_SECTIONS and indent <= 4:
            out.append(f"- {stripped}")
        elif out and out[-1].startswith("- ") and section_kind in LIST_SECTIONS:
            out[-1] += " " + stripped
        elif section_kind in ("Returns", "Yields", "Note", "Notes") and indent <= 4:
            if out and out[-1] and not out[-1].startswith("**"):
                out[-1] += " " + stripped
            else:
                out.append(stripped)
        else:
            out.append(line[4:] if line.startswith("    ") else line)
    text = "\n".join(out).strip()
    return re.sub(r"\n{3,}", "\n\n", text)


def _cleandoc(doc: str) -> str:
    lines = doc.expandtabs().splitlines()
    indents = [len(x) - len(x.lstrip()) for x in lines[1:] if x.strip()]
    margin = min(indents) if indents else 0
    if lines[0].strip().endswith(":") and lines[0].strip()[:-1] in SECTIONS:
        margin = max(margin - 4, 0)  # a docstring that opens with its section: keep its entries indented
    body = [lines[0].strip()] + [x[margin:].rstrip() for x in lines[1:]]
    while body and not body[-1]:
        body.pop()
    while body and not body[0]:
        body.pop(0)
    return "\n".join(body)


def anchor(title: str) -> str:
    """GitHub's heading anchor for a heading's text."""
    slug = title.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def is_public(name: str) -> bool:
    return not name.startswith("_")


def render_function(node: Function, source: str, qualname: str, heading: str,
                    method: bool) -> list[str]:
    decorators = decorator_names(node)
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    drop_first = method and "staticmethod" not in decorators
    params = parameters(node.args, source, drop_first)
    returns = text_of(node.returns, source)
    kind = ""
    if "property" in decorators:
        kind = " *(property)*"
        sig = f"{qualname}: {returns}" if returns else qualname
    else:
        if "staticmethod" in decorators:
            kind = " *(static method)*"
        elif "classmethod" in decorators:
            kind = " *(class method)*"
        sig = signature(prefix + qualname, params, returns)
    return [f"{heading} `{qualname}`{kind}", "", "```python", sig, "```", "", docstring_markdown(ast.get_docstring(node)), ""]


def class_members(node: ast.ClassDef) -> tuple[Function | None, list[Function]]:
    """The class's ``__init__`` (None if it has none) and its public methods and properties."""
    init: Function | None = None
    members: list[Function] = []
    seen: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name == "__init__":
                init = stmt
            elif (is_public(stmt.name) or stmt.name == "__call__") \
                    and "setter" not in ast.unparse(stmt.decorator_list[0] if stmt.decorator_list else ast.Constant(0)):
                if stmt.name in seen and "overload" not in decorator_names(stmt):
                    continue
                seen.add(stmt.name)
                members.append(stmt)
    return init, members


def class_attributes(node: ast.ClassDef, source: str, dataclass_like: bool) -> list[str]:
    """Public class-level attributes (not a dataclass's fields, which its signature shows)."""
    out = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_public(stmt.target.id):
            if dataclass_like and not text_of(stmt.annotation, source).startswith(("ClassVar", "typing.ClassVar")):
                continue
            value = f" = {text_of(stmt.value, source)}" if stmt.value is not None else ""
            out.append(f"{stmt.target.id}: {text_of(stmt.annotation, source)}{value}")
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and is_public(target.id):
                    out.append(f"{target.id} = {short_value(stmt.value, source)}")
    return out


def short_value(node: ast.expr | None, source: str) -> str:
    """A value worth printing: a short literal or name; anything computed (a call, say) is ``...``."""
    if node is None:
        return "..."
    text = text_of(node, source)
    try:
        ast.literal_eval(node)
    except ValueError:
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return "..."
    return text if len(text) <= 60 else "..."


def comment_above(node: ast.stmt, source: str) -> str:
    """The ``#`` comment lines right above a statement (a constant's documentation)."""
    lines = source.splitlines()
    out: list[str] = []
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(out)


def render_class(node: ast.ClassDef, source: str, name: str) -> list[str]:
    decorators = decorator_names(node)
    is_dataclass = "dataclass" in decorators
    bases = [text_of(b, source) for b in node.bases]
    bases += [f"{k.arg}={text_of(k.value, source)}" for k in node.keywords if k.arg]
    init, members = class_members(node)
    if is_dataclass and init is None:
        params = dataclass_fields(node, source)
    elif init is not None:
        params = parameters(init.args, source, drop_first=True)
    else:
        params = None
    out = [f"### `{name}`", ""]
    if params is not None:
        out += ["```python", signature(f"class {name}", params, ""), "```", ""]
        if bases:
            out += ["Bases: " + ", ".join(f"`{b}`" for b in bases) + ".", ""]
    else:
        out += ["```python", f"class {name}" + (f"({', '.join(bases)})" if bases else ""), "```", ""]
    if is_dataclass:
        frozen = any(isinstance(d, ast.Call) and any(k.arg == "frozen" and isinstance(k.value, ast.Constant)
                                                     and k.value.value for k in d.keywords) for d in node.decorator_list)
        out += [f"A {'frozen ' if frozen else ''}dataclass.", ""]
    out += [docstring_markdown(ast.get_docstring(node)), ""]
    if init is not None and ast.get_docstring(init):
        out += ["**Constructor:**", "", docstring_markdown(ast.get_docstring(init)), ""]
    attributes = class_attributes(node, source, is_dataclass)
    if attributes:
        out += ["**Class attributes:**", "", "```python", *attributes, "```", ""]
    for member in sorted(members, key=lambda m: m.name):
        out += render_function(member, source, f"{name}.{member.name}", "####", method=True)
    return out


def render_value(node: ast.Assign | ast.AnnAssign, source: str, name: str) -> list[str]:
    annotation = f": {text_of(node.annotation, source)}" if isinstance(node, ast.AnnAssign) else ""
    value = node.value
    shown = "" if value is None or (isinstance(value, ast.Constant) and value.value is Ellipsis) \
        else f" = {short_value(value, source)}"
    if shown == " = ...":
        shown = ""
    comment = comment_above(node, source)
    return [f"### `{name}`", "", "```python", f"{name}{annotation}{shown}", "```", ""] + ([comment, ""] if comment else [])


def render_definition(definition: Definition, name: str) -> list[str]:
    node = definition.node
    if isinstance(node, ast.ClassDef):
        body = render_class(node, definition.source, name)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = render_function(node, definition.source, name, "###", method=False)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        body = render_value(node, definition.source, name)
    else:  # pragma: no cover - find_definition returns only the kinds above
        raise GenerationError(f"cannot document {name}")
    where = f"*Defined in `{definition.module}`.*"
    return [*body[:2], where, "", *body[2:]]


def module_summary(module: str) -> str:
    tree, _ = parse(module)
    doc = ast.get_docstring(tree)
    return docstring_markdown(doc) if doc else ""


def render() -> str:
    """The whole page."""
    out = [
        "# Python API reference",
        "",
        "<!-- GENERATED by `python docs/gen_api.py` from the docstrings; do not edit. -->",
        "",
        "Generated by `python docs/gen_api.py` from the docstrings of the sources (never by importing",
        "them); `python docs/gen_api.py --check` fails while this page is stale (the test command runs",
        "it). It covers every name of `ngramcache` (`ngramcache.__all__`) and of the engine adapters",
        "(`ngramcache.client.adapters` and its modules); names are sorted. Signatures and defaults are",
        "the source text; the compiled core's names (`CountTable`, `Drafter`, `StaticCache`, ...) come",
        "from its stub, `client/_core.pyi`. How to use them: [python.md](python.md) and",
        "[engines.md](engines.md).",
        "",
    ]
    top_names = sorted({*module_all("ngramcache.client"), "__version__"}, key=lambda n: (n.startswith("_"), n))
    modules = adapter_modules()
    out += ["## Contents", "", "- [`ngramcache`](#ngramcache)"]
    out += [f"- [`{m}`](#{anchor(m)})" for m in modules]
    out += [""]

    out += ["## `ngramcache`", "",
            "`import ngramcache` is the public API: the names of `ngramcache.client`, imported on first use,",
            "and `__version__`, the installed distribution's version.", ""]
    out += [", ".join(f"[`{n}`](#{anchor(n)})" for n in top_names), ""]
    documented: dict[str, str] = {}
    for name in top_names:
        definition = find_definition("ngramcache.client", name)
        out += render_definition(definition, name)
        documented[f"{definition.module}.{name}"] = name

    for module in modules:
        out += [f"## `{module}`", "", module_summary(module), ""]
        for name in sorted(module_all(module)):
            definition = find_definition(module, name)
            key = f"{definition.module}.{name}"
            if key in documented:
                out += [f"### `{module}.{name}`", "", f"The same object as [`{documented[key]}`](#{anchor(documented[key])}).", ""]
                continue
            documented[key] = f"{module}.{name}"
            body = render_definition(definition, name)
            body[0] = body[0].replace(f"`{name}`", f"`{module}.{name}`", 1)
            out += body
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the docstrings, or check it is current.")
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when docs/api.md is stale")
    args = parser.parse_args(argv)
    try:
        text = render()
    except GenerationError as e:
        print(f"gen_api: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run `python docs/gen_api.py` and commit the result",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines()):,} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
