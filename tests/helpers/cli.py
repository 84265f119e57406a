"""The `ngramcache` command as the CLI tests run it: a real subprocess (`run`) or main(argv) in this process (`main`),
its one-line errors, and the inputs they share (the `texts` and `files` fixtures, which a test module imports by name)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ngramcache.client.tools import cli

__all__ = ["TOKENIZER", "UNTAGGED_ARGS", "files", "main", "one_line_error", "run", "texts", "write_tokens"]

TOKENIZER = "tiktoken:qwen"
"""The tokenizer of the tests that build from text."""

UNTAGGED_ARGS = ("--vocab-size", "50", "--fingerprint", "untagged")
"""The vocabulary and fingerprint of the `files` fixture's caches (no tokenizer named)."""


def run(*args: object, ok: bool = True) -> subprocess.CompletedProcess:
    """`python -m ngramcache.client.tools.cli ARGS` in a child process; with `ok`, it must exit 0."""
    result = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", *map(str, args)], capture_output=True,
                            text=True, check=False)
    if ok:
        assert result.returncode == 0, result.stderr
    return result


def main(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """cli.main(argv) as the shell sees it: (exit status, stdout, stderr)."""
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's refusals
        rc = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # would stop the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main()")
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *needles: str) -> None:
    """`err` is one line (argparse's usage lines aside), holds every needle and no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith((" ", "usage:"))]  # argparse adds usage
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


def write_tokens(path: Path, tokens) -> Path:
    """`tokens` as a raw token file (little-endian int32) at `path`."""
    np.asarray(tokens, dtype="<i4").tofile(path)
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """Real text nobody here wrote: a few CPython standard library modules."""
    d = tmp_path_factory.mktemp("texts")
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ["bisect.py", "heapq.py", "textwrap.py", "string.py"]:
        (d / name).write_bytes((lib / name).read_bytes())
    return d


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """a.bin (3000 tokens), b.bin (2000), their caches a.ngc and b.ngc, and a.lcs (a.ngc in llama.cpp's format)."""
    d = tmp_path / "files"
    d.mkdir()
    rng = np.random.default_rng(11)
    write_tokens(d / "a.bin", rng.integers(0, 50, 3000))
    write_tokens(d / "b.bin", rng.integers(0, 50, 2000))
    for name in "ab":
        run("build", str(d / f"{name}.bin"), "-o", str(d / f"{name}.ngc"), *UNTAGGED_ARGS, "--quiet")
    run("export-llama", str(d / "a.ngc"), "-o", str(d / "a.lcs"), "--quiet")
    return d
