"""Build inputs: sizes, vocabulary checks and what counts as an input (client/corpus.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ngramcache.client import InvalidArgumentError
from ngramcache.client.corpus import collect_inputs, first_out_of_vocabulary, parse_size


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
