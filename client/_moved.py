"""Old import paths of modules that moved into the client's wings, kept working with a DeprecationWarning.

`import ngramcache.client.errors` gives the very module `ngramcache.client.kernel.errors` (one
module object under two names, so classes and `isinstance` agree), and `python -m
ngramcache.client.cli` still runs the command line. docs/python.md lists the old paths; they
go in a later major version.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

_PREFIX = "ngramcache.client."

MOVED: dict[str, str] = {
    "address": "wire.address",
    "admin": "sync.admin",
    "build": "kernel.build",
    "cli": "tools.cli",
    "cli.__main__": "tools.cli.__main__",
    "cli.arguments": "tools.cli.arguments",
    "cli.commands": "tools.cli.commands",
    "cli.demo": "tools.cli.demo",
    "cli.guards": "tools.cli.guards",
    "cli.llama_follow": "tools.cli.llama",
    "cli.parser": "tools.cli.parser",
    "cli.run": "tools.cli.run",
    "cli.sglang": "tools.cli.sglang",
    "cli.tokens": "tools.cli.tokens",
    "corpus": "kernel.corpus",
    "diagnose": "wire.diagnose",
    "errors": "kernel.errors",
    "files": "kernel.files",
    "http_proxy": "tools.http_proxy",
    "llama_follow": "tools.llama_follow",
    "progress": "kernel.progress",
    "_proto.codec": "wire.codec",
    "remote": "sync.remote",
    "rows": "kernel.rows",
    "sglang_corpus": "kernel.sglang_corpus",
    "sglang_http": "tools.sglang_http",
    "sglang_sync": "tools.sglang_sync",
    "static_files": "kernel.static_files",
    "sync.history_sources": "kernel.history_sources",
    "tasks": "kernel.tasks",
    "token_files": "kernel.token_files",
    "tokenizer": "kernel.tokenizer",
    "transport": "wire.transport",
    "wire_errors": "wire.rpc_errors",
}
"""Old name under ``ngramcache.client.`` -> its name now."""


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module under its new name (imported once, shared)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved to {self.new}; the old name goes in a later major version",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its new name); the import system set `__spec__` to the alias's: put it back."""
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code: what `python -m OLD` runs (runpy asks the loader for it)."""
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self.new) if get_code is not None else None


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX):] not in MOVED:
            return None
        new = _PREFIX + MOVED[fullname[len(_PREFIX):]]
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new), origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


def install() -> None:
    """Puts the finder in front of the import system (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
