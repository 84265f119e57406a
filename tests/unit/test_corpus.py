"""Build inputs: sizes, vocabulary checks and what counts as an input (client/kernel/corpus.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ngramcache.client import InvalidArgumentError
from ngramcache.client.kernel.corpus import Skipped, collect_inputs, first_out_of_vocabulary, parse_size, read_texts


@pytest.mark.parametrize(("text", "n"), [
    ("1GiB", 1 << 30), ("256MiB", 256 << 20), ("16 mib", 16 << 20), ("512M", 512_000_000), ("1.5GB", 1_500_000_000),
    ("2TiB", 2 << 40), ("1000000", 1_000_000), ("4096B", 4096), ("1e3", 1000),
])
def test_parse_size_reads_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "infinity", "NaNGiB", "0", "-1GiB", "0.1", "abc", "1XB", "", "GiB"])
def test_parse_size_refuses_what_is_not_a_positive_finite_size(text):
    with pytest.raises(InvalidArgumentError, match="cannot read size"):
        parse_size(text)


def test_first_out_of_vocabulary():
    assert first_out_of_vocabulary(np.array([0, 1, 9], np.int32), 10) is None
    assert first_out_of_vocabulary(np.array([0, 10, -1], np.int32), 10) == 1
    assert first_out_of_vocabulary(np.array([3, -1, 10], np.int32), 10) == 1
    assert first_out_of_vocabulary(np.zeros(0, np.int32), 10) is None


def test_collect_inputs_names_what_it_cannot_read(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        collect_inputs([str(tmp_path / "nope")])
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InvalidArgumentError, match="is not a regular file or a folder"):
        collect_inputs([str(tmp_path / "fifo")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="no input files found"):
        collect_inputs([str(tmp_path / "empty")])


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _names(items, root: Path) -> list[str]:
    return [i.path.relative_to(root).as_posix() for i in items]


def test_folders_leave_out_hidden_entries_and_pycache_by_default(tmp_path: Path):
    root = _tree(tmp_path / "c", {"a.py": b"x", "pkg/b.py": b"y", "pkg/__pycache__/b.cpython-311.pyc": b"\0\1",
                                  ".git/config": b"z", "pkg/.hidden.py": b"h"})
    items = collect_inputs([str(root)])
    assert _names(items, root) == ["a.py", "pkg/b.py"]
    assert all(i.found for i in items)
    # A file named directly is taken, whatever its name.
    named = collect_inputs([str(root / "pkg" / "__pycache__" / "b.cpython-311.pyc")])
    assert len(named) == 1 and not named[0].found


def test_include_and_exclude_globs(tmp_path: Path):
    root = _tree(tmp_path / "c", {"a.py": b"1", "a.txt": b"2", "tests/t.py": b"3", "docs/x.md": b"4",
                                  "docs/sub/y.md": b"5", "lib/z.min.js": b"6", "lib/z.js": b"7"})
    assert _names(collect_inputs([str(root)], include=["*.py"]), root) == ["a.py", "tests/t.py"]
    assert _names(collect_inputs([str(root)], include=["*.py"], exclude=["tests"]), root) == ["a.py"]
    assert _names(collect_inputs([str(root)], exclude=["*.min.js", "docs", "*.txt"]), root) == \
        ["a.py", "lib/z.js", "tests/t.py"]
    # A glob with a '/' matches the path below the folder ('*' crossing '/').
    assert _names(collect_inputs([str(root)], include=["docs/*.md"]), root) == ["docs/sub/y.md", "docs/x.md"]
    assert _names(collect_inputs([str(root)], exclude=["docs/sub/*"]), root) == \
        ["a.py", "a.txt", "docs/x.md", "lib/z.js", "lib/z.min.js", "tests/t.py"]
    with pytest.raises(InvalidArgumentError, match=r"no input files found in .* \(after --include/--exclude\)"):
        collect_inputs([str(root)], include=["*.rs"])


def test_read_texts_skips_binary_files_found_in_folders_and_refuses_named_ones(tmp_path: Path):
    root = _tree(tmp_path / "c", {"a.py": b"print(1)\n", "b.bin.old": b"\xff\xfe\0binary", "c.py": b"x = 2\n",
                                  "d.dat": b"\x80"})
    skipped = Skipped()
    kept, texts = read_texts(collect_inputs([str(root)]), skipped)
    assert _names(kept, root) == ["a.py", "c.py"] and texts == ["print(1)\n", "x = 2\n"]
    assert skipped.count == 2 and skipped.example == str(root / "b.bin.old")
    assert skipped.note() == (f"note: skipped 2 files found in input folders that are neither UTF-8 text nor a token "
                              f"file (e.g. {root / 'b.bin.old'}); --exclude GLOB leaves such files out")
    with pytest.raises(InvalidArgumentError, match=r"b.bin.old: not UTF-8 text \(byte 0\)"):
        read_texts(collect_inputs([str(root / "b.bin.old")]), Skipped())
