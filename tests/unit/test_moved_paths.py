"""The old module paths of the client (before its wings) still import, as the same module, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

from ngramcache.client import _moved

ROOT = Path(__file__).resolve().parents[2]


# cli.__main__ runs the command line when imported: tests/integration/test_moved_cli.py runs it with `python -m`
@pytest.mark.parametrize(("old", "new"), sorted((o, n) for o, n in _moved.MOVED.items() if not o.endswith("__main__")))
def test_an_old_path_is_the_same_module_and_warns(old: str, new: str) -> None:
    module = importlib.import_module(f"ngramcache.client.{new}")
    sys.modules.pop(f"ngramcache.client.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(f"ngramcache.client.{old}")
    assert alias is module
    assert module.__spec__ is not None and module.__spec__.name == f"ngramcache.client.{new}"  # not the alias's
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"ngramcache.client.{old} moved to ngramcache.client.{new}" in str(caught[0].message)


def test_a_class_is_one_class_under_both_paths() -> None:
    from ngramcache.client.kernel.errors import NgramCacheError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ngramcache.client.errors import NgramCacheError as Old  # type: ignore[import-not-found]
    assert Old is NgramCacheError


def test_every_old_path_is_listed_in_the_docs() -> None:
    section = (ROOT / "docs" / "python.md").read_text().split("## Moved modules")[1]
    for old, new in _moved.MOVED.items():
        if old.startswith("cli.") and old != "cli.llama_follow":
            continue  # the table names the package; its modules keep their names
        leaf = old.rpartition(".")[2]
        assert f".{leaf}" in section or f"ngramcache.client.{old}" in section, old
        assert new.split(".")[0] in section, new


def test_a_renamed_constant_reads_under_its_old_name_with_a_warning() -> None:
    from ngramcache.client.adapters import sequence_feed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sequence_feed.DEAR_MAX_DRAFT == sequence_feed.CAPPED_AUTO_DRAFT
    assert [w.category for w in caught] == [DeprecationWarning]
    with pytest.raises(AttributeError):
        sequence_feed.NO_SUCH_NAME  # noqa: B018
