"""The public API, `import ngramcache`: every error class and every name the documentation imports from it is there."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import ngramcache
from ngramcache.client.kernel import errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").glob("*.md")])
# `ngramcache.v1.Counts` and the like are the wire contract's proto package, not Python.
NOT_PYTHON = {"v1", "v2"}
SUBPACKAGES = {"client", "cache_service"}


def documented_names() -> dict[str, set[str]]:
    """Each name the docs use as ``ngramcache.X`` or ``from ngramcache import X``, with the files using it."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        names = set(re.findall(r"\bngramcache\.([A-Za-z_][A-Za-z0-9_]*)", text))
        groups = re.findall(r"\bfrom ngramcache import \(([^)]*)\)", text)
        groups += re.findall(r"\bfrom ngramcache import ([A-Za-z0-9_, ]+)", text)
        for group in groups:
            names.update(n.split(" as ")[0].strip() for n in group.replace("\n", ",").split(",") if n.strip())
        for name in names - NOT_PYTHON - SUBPACKAGES:
            found.setdefault(name, set()).add(doc.relative_to(ROOT).as_posix())
    return found


def test_the_docs_name_some_top_level_names():
    names = documented_names()
    assert {"NgramClient", "Drafter", "UNTAGGED", "AdminClient", "load_tokenizer"} <= set(names)


@pytest.mark.parametrize("name", sorted(documented_names()))
def test_every_documented_name_imports_from_ngramcache(name):
    assert name == "__all__" or name in ngramcache.__all__, f"{name} (named in {documented_names()[name]})"
    assert getattr(ngramcache, name) is not None
    exec(f"from ngramcache import {name}", {})


def test_every_error_class_is_exported():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.NgramCacheError) and c.__module__ == errors.__name__]
    assert len(classes) > 10
    missing = sorted(c.__name__ for c in classes if c.__name__ not in ngramcache.__all__)
    assert not missing, f"not exported by ngramcache: {missing}"
    for c in classes:
        assert getattr(ngramcache, c.__name__) is c


@pytest.mark.parametrize("name", ["OverloadedError", "DraftLengthPolicy", "VerifyCost"])
def test_names_the_docs_mention_without_a_module(name):
    # docs/protocol.md names OverloadedError among the exceptions; README.md and docs/architecture.md
    # name DraftLengthPolicy and its VerifyCost.
    assert name in ngramcache.__all__
    exec(f"from ngramcache import {name}", {})
