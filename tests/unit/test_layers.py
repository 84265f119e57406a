"""The import rule: the folders of client/ are layers, and nothing imports a layer above its own.

    kernel   errors, rows, files, tokenizer, static files, history records: no network (no grpc)
    wire     transport, codec, rpc errors, addresses: kernel + the generated protos
    sync     NgramClient, RemoteDrafter, AdminClient: kernel + wire
    adapters the engines' drafters: kernel + wire + sync
    tools    the command line and the programs it runs: any wing of the client

cache_service (the server) imports only kernel, wire, the generated protos and the compiled core; its
command line, admin commands and demo also the client's sync and tools. Read from the sources with
`ast`: nothing is imported, so this test needs no build.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = "ngramcache.client"
# package of the installed name -> its folder (pyproject.toml's wheel.packages)
FOLDERS = {"ngramcache.client": ROOT / "client", "ngramcache.cache_service": ROOT / "cache_service"}

# wing -> the client wings it may import ("_core": the compiled core; "_proto": the generated protos)
CLIENT_RULES: dict[str, set[str]] = {
    "kernel": {"kernel", "_core"},
    "wire": {"kernel", "wire", "_proto", "_core"},
    "sync": {"kernel", "wire", "sync", "_proto", "_core"},
    "adapters": {"kernel", "wire", "sync", "adapters", "_core"},
    "tools": {"kernel", "wire", "sync", "adapters", "tools", "_proto", "_core"},  # never the service: it adds its commands
    "_proto": {"_proto"},
}
SERVICE_ALLOWED = {"kernel", "wire", "_proto", "_core"}
# the service's operator programs: they run the client's command line and talk to a service as a client does
SERVICE_PROGRAMS = ("cli.py", "entry.py", "admin_commands.py", "demo/")
SERVICE_PROGRAMS_ALLOWED = SERVICE_ALLOWED | {"sync", "tools"}
# the package's faces: they hand the public names on (and install the old import paths), importing any wing
FACES = {"__init__.py", "_toplevel.py", "_moved.py"}
NO_NETWORK = {"kernel": ("grpc",)}  # third-party packages a wing must not import


def module_name(path: Path) -> str:
    for package, folder in FOLDERS.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from ngramcache.client import errors` imports the module errors: name each imported name
            found += [(node.lineno, f"{base}.{alias.name}" if base in (CLIENT, f"{CLIENT}.tools") else base)
                      for alias in node.names]
    return found


def wing_of(module: str) -> str | None:
    """The client wing an imported module belongs to, "cache_service", or None (stdlib, third party)."""
    if module.startswith("ngramcache.cache_service"):
        return "cache_service"
    if module == CLIENT or not module.startswith(CLIENT + "."):
        return "client face" if module == CLIENT else None
    first = module[len(CLIENT) + 1:].split(".")[0]
    return first if first in CLIENT_RULES or first == "_core" else "client face"


def violations(root: Path = ROOT) -> list[str]:
    found: list[str] = []
    for path in sorted((root / "client").rglob("*.py")):
        rel = path.relative_to(root / "client")
        if len(rel.parts) == 1 or "_pb2" in path.name:
            if len(rel.parts) == 1 and rel.name not in FACES:
                found.append(f"client/{rel}: a module at the top of client/; put it in a wing")
            continue
        wing = rel.parts[0]
        allowed = CLIENT_RULES.get(wing)
        if allowed is None:
            found.append(f"client/{rel}: in client/{wing}/, a folder that is no wing of the rule")
            continue
        for line, module in imports_of(path):
            target = wing_of(module)
            if target is not None and target not in allowed:
                found.append(f"client/{rel}:{line}: {wing} imports {module} ({target})")
            if module.split(".")[0] in NO_NETWORK.get(wing, ()):
                found.append(f"client/{rel}:{line}: {wing} imports {module} (no network in the {wing})")
    for path in sorted((root / "cache_service").rglob("*.py")):
        rel = path.relative_to(root / "cache_service").as_posix()
        allowed = SERVICE_PROGRAMS_ALLOWED if rel.startswith(SERVICE_PROGRAMS) else SERVICE_ALLOWED
        for line, module in imports_of(path):
            target = wing_of(module)
            if target is not None and target != "cache_service" and target not in allowed:
                found.append(f"cache_service/{rel}:{line}: the service imports {module} ({target})")
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert violations() == []


def test_every_wing_of_the_rule_is_a_folder() -> None:
    assert sorted(p.name for p in (ROOT / "client").iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted(CLIENT_RULES)


@pytest.mark.parametrize(("where", "line", "why"), [
    ("client/kernel/bad.py", "import grpc", "no network in the kernel"),
    ("client/kernel/bad.py", "from ngramcache.client.wire.transport import Channel", "kernel imports"),
    ("client/wire/bad.py", "from ngramcache.client.sync import NgramClient", "wire imports"),
    ("client/sync/bad.py", "from ngramcache.client.tools import cli", "sync imports"),
    ("client/sync/bad.py", "from ngramcache.client import NgramClient", "(client face)"),
    ("client/sync/bad.py", "from ..tools.cli import main", "sync imports ngramcache.client.tools.cli"),
    ("client/tools/bad.py", "from ngramcache.cache_service import cli", "tools imports ngramcache.cache_service"),
    ("cache_service/bad.py", "from ngramcache.client.sync.admin import AdminClient", "the service imports"),
    ("cache_service/bad.py", "from ngramcache.client import errors", "(client face)"),
    ("client/stray.py", "x = 1", "a module at the top of client/"),
])
def test_a_violation_is_found(tmp_path: Path, where: str, line: str, why: str) -> None:
    """The checker itself: a tree with one bad import is reported, with the file and the reason."""
    for folder in ("client/kernel", "client/wire", "client/sync", "client/adapters", "client/tools", "client/_proto",
                   "cache_service"):
        (tmp_path / folder).mkdir(parents=True)
    bad = tmp_path / where
    bad.write_text(line + "\n")
    saved = dict(FOLDERS)
    FOLDERS.update({"ngramcache.client": tmp_path / "client", "ngramcache.cache_service": tmp_path / "cache_service"})
    try:
        found = violations(tmp_path)
    finally:
        FOLDERS.update(saved)
    assert len(found) == 1 and found[0].startswith(where) and why in found[0], found


def wing_graph(root: Path = ROOT) -> dict[tuple[str, str], int]:
    """(from, to) -> how many imports, between the client's wings, the core, the protos and the service."""
    edges: dict[tuple[str, str], int] = {}
    seen: set[tuple[Path, int, str]] = set()  # an import statement counts once, whatever names it takes
    for folder, name in (("client", None), ("cache_service", "cache_service")):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder)
            if "_pb2" in path.name or (name is None and len(rel.parts) == 1):
                continue
            source = name or rel.parts[0]
            for line, module in imports_of(path):
                target = wing_of(module)
                if target is not None and target != source and (path, line, target) not in seen:
                    seen.add((path, line, target))
                    edges[source, target] = edges.get((source, target), 0) + 1
    return edges


if __name__ == "__main__":  # python tests/unit/test_layers.py: the layers as the imports draw them
    for (source, target), n in sorted(wing_graph().items()):
        print(f"{source:>13} -> {target:<13} {n:4d} imports")
    found = violations()
    print(f"{len(found)} imports against the rule", *found, sep="\n")
