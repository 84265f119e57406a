"""The `ngramcache` commands end to end, run as a user runs them (a real subprocess, or main(argv) in this process)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
from helpers import reference

from ngramcache import StaticCache
from ngramcache.client.kernel import build as build_module
from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.tools import cli
from ngramcache.client.tools.cli import commands
from ngramcache.client.tools.cli import demo as cli_demo
from ngramcache.client.tools.cli import parser as cli_parser

TOKENIZER = "tiktoken:qwen"


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", *args], capture_output=True, text=True,
                            check=False)
    if ok:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """Real text nobody here wrote: a few CPython standard library modules."""
    d = tmp_path_factory.mktemp("texts")
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ["bisect.py", "heapq.py", "textwrap.py", "string.py"]:
        (d / name).write_bytes((lib / name).read_bytes())
    return d


def test_help_explains_every_command():
    out = run("--help").stdout
    for cmd in ["demo", "build", "stats", "inspect", "merge", "import-llama", "export-llama", "export-sglang"]:
        assert cmd in out
        assert "usage:" in run(cmd, "--help").stdout


def test_build_from_text_equals_build_from_tokens(tmp_path, texts):
    tok = load_tokenizer(TOKENIZER)
    run("build", str(texts), "-o", str(tmp_path / "text.ngc"), "--tokenizer", TOKENIZER, "--quiet")
    # The same files as token files: raw .bin for two, one .npy with stream offsets for the rest.
    files = sorted(texts.iterdir())
    arrays = [tok.encode(f.read_text()) for f in files]
    tokdir = tmp_path / "tokens"
    tokdir.mkdir()
    arrays[0].astype("<i4").tofile(tokdir / "a.bin")
    arrays[1].astype("<i4").tofile(tokdir / "b.tokens")
    np.save(tokdir / "c.npy", np.concatenate(arrays[2:]).astype(np.int32))
    np.save(tokdir / "c.offsets.npy", np.array([0, len(arrays[2])], dtype=np.int64))
    run("build", str(tokdir), "-o", str(tmp_path / "tokens.ngc"), "--tokenizer", TOKENIZER, "--quiet")
    assert (tmp_path / "text.ngc").read_bytes() == (tmp_path / "tokens.ngc").read_bytes()
    c = StaticCache.open(str(tmp_path / "text.ngc"))
    assert c.fingerprint == tok.fingerprint and c.vocab_size == tok.vocab_size
    assert reference.rows_to_table(c.to_rows()) == reference.count_static(arrays)


def test_build_writes_generation_1_by_default_so_publish_takes_it_into_a_new_namespace(tmp_path, files):
    assert StaticCache.open(str(files / "a.ngc")).generation == 1  # a service never publishes generation 0
    run("build", str(files / "a.bin"), "-o", str(tmp_path / "g7.ngc"), *UNTAGGED_ARGS, "--quiet", "--generation", "7")
    assert StaticCache.open(str(tmp_path / "g7.ngc")).generation == 7


def test_build_with_a_small_budget_gives_the_same_file(tmp_path):
    rng = np.random.default_rng(3)
    np.save(tmp_path / "big.npy", (np.minimum(rng.zipf(1.2, 3_000_000), 20_000) - 1).astype(np.int32))
    fp = "ab" * 32
    r1 = run("build", str(tmp_path / "big.npy"), "-o", str(tmp_path / "a.ngc"), "--vocab-size", "20000", "--fingerprint", fp, "--json")
    r2 = run("build", str(tmp_path / "big.npy"), "-o", str(tmp_path / "b.ngc"), "--vocab-size", "20000", "--fingerprint", fp,
             "--memory-budget", "16MiB", "--json")
    a, b = json.loads(r1.stdout), json.loads(r2.stdout)
    assert a["runs_spilled"] == 0 and b["runs_spilled"] >= 2
    assert (tmp_path / "a.ngc").read_bytes() == (tmp_path / "b.ngc").read_bytes()


def test_build_refuses_bad_input(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x00")
    r = run("build", str(tmp_path / "odd.bin"), "-o", str(tmp_path / "x.ngc"), "--vocab-size", "10", "--fingerprint", "00" * 32, ok=False)
    assert r.returncode == 2 and "not a whole number of int32 tokens" in r.stderr
    np.array([1, 2, 50], dtype="<i4").tofile(tmp_path / "oov.bin")
    r = run("build", str(tmp_path / "oov.bin"), "-o", str(tmp_path / "x.ngc"), "--vocab-size", "10", "--fingerprint", "00" * 32, ok=False)
    assert r.returncode == 2 and "oov.bin: token 50 at position 2 is outside the vocabulary [0, 10)" in r.stderr
    r = run("build", str(tmp_path / "oov.bin"), "-o", str(tmp_path / "x.ngc"), ok=False)
    assert r.returncode == 2 and "--tokenizer SPEC, or both --vocab-size and --fingerprint" in r.stderr
    r = run("build", str(tmp_path / "nope"), "-o", str(tmp_path / "x.ngc"), "--vocab-size", "10", "--fingerprint", "00" * 32, ok=False)
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "x.ngc").exists()


def write_tokens(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype="<i4").tofile(path)
    return path


def test_stats_matches_a_hand_checked_replay(tmp_path):
    # See tests/unit/test_replay.py for the reasoning: two chunks of "1 2 3 1 2 3" teach the
    # dynamic table nothing drafting can use yet; a third chunk drafts 3 1 2 3 in one call.
    test = write_tokens(tmp_path / "t.bin", [1, 2, 3] * 6 + [9])
    r = json.loads(run("stats", "--input", str(test), "--n-ctx", "6", "--n-draft", "4", "--json",
                       "--dump-drafts", str(tmp_path / "d.txt")).stdout)
    assert r["n_input"] == 19 and r["n_ctx"] == 6 and r["n_draft"] == 4
    # chunk 1: 5 calls, nothing; chunk 2: 5 calls, nothing (strict thresholds); chunk 3: [] then [3 1 2 3].
    assert (r["n_draft_calls"], r["n_drafted"], r["n_accept"], r["accept_pct"]) == (12, 4, 4, 100.0)
    assert (tmp_path / "d.txt").read_text().split("\n")[:-1] == [""] * 11 + ["3 1 2 3"]
    for key in ["t_load_ms", "t_draft_ms", "us_per_drafted", "us_per_drafted_draft_only", "peak_rss_mb"]:
        assert key in r


def test_stats_with_static_and_dynamic(tmp_path):
    rng = np.random.default_rng(4)
    corpus = write_tokens(tmp_path / "c.bin", rng.integers(0, 20, 5000))
    run("build", str(corpus), "-o", str(tmp_path / "s.ngc"), "--vocab-size", "20", "--fingerprint", "00" * 32)
    test = rng.integers(0, 20, 600)
    write_tokens(tmp_path / "t.bin", test)
    dyn = struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 3, 7)
    (tmp_path / "dyn.bin").write_bytes(dyn)
    r = json.loads(run("stats", "--input", str(tmp_path / "t.bin"), "--static", str(tmp_path / "s.ngc"),
                       "--dynamic", str(tmp_path / "dyn.bin"), "--n-ctx", "100", "--json").stdout)
    ref_static = reference.count_static([np.fromfile(tmp_path / "c.bin", dtype="<i4")])
    ref_dyn = reference.new_table()
    ref_dyn[(1, 2)][3] += 7
    n_drafted, n_accept, calls, _ = reference.replay(test, 100, 8, ref_static, 2, ref_dyn)
    assert (r["n_drafted"], r["n_accept"], r["n_draft_calls"]) == (n_drafted, n_accept, len(calls))
    assert r["t_load_ms"] > 0


def test_stats_refuses_another_tokenizers_cache(tmp_path, texts):
    run("build", str(texts), "-o", str(tmp_path / "q.ngc"), "--tokenizer", TOKENIZER, "--quiet")
    r = run("stats", "--input", str(texts / "bisect.py"), "--static", str(tmp_path / "q.ngc"),
            "--tokenizer", "tiktoken:cl100k_base", ok=False)
    assert r.returncode == 2 and "fingerprint" in r.stderr


def test_inspect(tmp_path):
    rng = np.random.default_rng(1)
    write_tokens(tmp_path / "c.bin", rng.integers(0, 30, 3000))
    run("build", str(tmp_path / "c.bin"), "-o", str(tmp_path / "c.ngc"), "--vocab-size", "30", "--fingerprint", "12" * 32,
        "--generation", "7")
    info = json.loads(run("inspect", str(tmp_path / "c.ngc"), "--verify", "--json").stdout)
    c = StaticCache.open(str(tmp_path / "c.ngc"))
    assert info["generation"] == 7 and info["fingerprint"] == "12" * 32 and info["verified"]
    assert info["n_keys"] == c.n_keys and sum(info["followers_per_key"].values()) == c.n_keys
    assert [s["name"] for s in info["sections"]] == ["ROWS", "KEYS", "STARTS", "TOTALS", "FOLLOWERS", "OVERFLOW"]
    assert "followers/key" in run("inspect", str(tmp_path / "c.ngc")).stdout
    (tmp_path / "bad.ngc").write_bytes(b"garbage" * 100)
    r = run("inspect", str(tmp_path / "bad.ngc"), ok=False)
    assert r.returncode == 2 and "bad magic" in r.stderr


def test_merge_sums_and_refuses_mismatches(tmp_path):
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 15, 2000), rng.integers(0, 15, 2000)
    write_tokens(tmp_path / "a.bin", a)
    write_tokens(tmp_path / "b.bin", b)
    for name in "ab":
        run("build", str(tmp_path / f"{name}.bin"), "-o", str(tmp_path / f"{name}.ngc"), "--vocab-size", "15",
            "--fingerprint", "33" * 32, "--generation", "2" if name == "a" else "5")
    run("merge", str(tmp_path / "a.ngc"), str(tmp_path / "b.ngc"), "-o", str(tmp_path / "m.ngc"))
    m = StaticCache.open(str(tmp_path / "m.ngc"))
    assert reference.rows_to_table(m.to_rows()) == reference.count_static([a, b])
    assert m.generation == 5
    run("build", str(tmp_path / "a.bin"), "-o", str(tmp_path / "other.ngc"), "--vocab-size", "15", "--fingerprint", "44" * 32)
    r = run("merge", str(tmp_path / "a.ngc"), str(tmp_path / "other.ngc"), "-o", str(tmp_path / "x.ngc"), ok=False)
    assert r.returncode == 2 and "fingerprint 3333" in r.stderr and "4444" in r.stderr
    run("build", str(tmp_path / "a.bin"), "-o", str(tmp_path / "k3.ngc"), "--vocab-size", "15", "--fingerprint", "33" * 32,
        "--ngram-size", "3")
    r = run("merge", str(tmp_path / "a.ngc"), str(tmp_path / "k3.ngc"), "-o", str(tmp_path / "x.ngc"), ok=False)
    assert r.returncode == 2 and "has ngram_size 2" in r.stderr and "k3.ngc has 3" in r.stderr
    assert not (tmp_path / "x.ngc").exists()


def test_llama_round_trip_and_hostile_file(tmp_path):
    rng = np.random.default_rng(8)
    write_tokens(tmp_path / "c.bin", rng.integers(0, 25, 4000))
    run("build", str(tmp_path / "c.bin"), "-o", str(tmp_path / "c.ngc"), "--vocab-size", "25", "--fingerprint", "55" * 32)
    run("export-llama", str(tmp_path / "c.ngc"), "-o", str(tmp_path / "c.lcs"))
    run("import-llama", str(tmp_path / "c.lcs"), "-o", str(tmp_path / "back.ngc"), "--vocab-size", "25", "--fingerprint", "55" * 32)
    a, b = StaticCache.open(str(tmp_path / "c.ngc")), StaticCache.open(str(tmp_path / "back.ngc"))
    assert (a.to_rows() == b.to_rows()).all()
    assert [s["checksum"] for s in a.sections] == [s["checksum"] for s in b.sections]  # same sections, byte for byte
    assert (a.fingerprint, a.vocab_size, a.file_size) == (b.fingerprint, b.vocab_size, b.file_size)
    assert b.n_tokens == 0  # llama.cpp's format does not record how many tokens were counted
    data = (tmp_path / "c.lcs").read_bytes()
    (tmp_path / "cut.lcs").write_bytes(data[:-6])
    r = run("import-llama", str(tmp_path / "cut.lcs"), "-o", str(tmp_path / "x.ngc"), "--vocab-size", "25",
            "--fingerprint", "55" * 32, ok=False)
    assert r.returncode == 2 and "byte" in r.stderr and "missing" in r.stderr
    r = run("import-llama", str(tmp_path / "c.lcs"), "-o", str(tmp_path / "x.ngc"), "--vocab-size", "10",
            "--fingerprint", "55" * 32, ok=False)
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
    assert not (tmp_path / "x.ngc").exists()


# --- The CLI never loses data and never shows a traceback -------------------------------------
# Most of these run main(argv) in this process (fast, and lets a test stand in for the builder);
# Ctrl-C is also tested on a real subprocess.

UNTAGGED_ARGS = ("--vocab-size", "50", "--fingerprint", "untagged")


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
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith((" ", "usage:"))]  # argparse adds usage
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


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


def listing(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.parametrize("spelling", ["same", "symlink", "hardlink", "dotdot"])
@pytest.mark.parametrize("command", ["build", "export-llama", "merge", "import-llama"])
def test_an_output_that_is_an_input_is_refused(capsys, files, command, spelling):
    victim = {"build": "a.bin", "export-llama": "a.ngc", "merge": "a.ngc", "import-llama": "a.lcs"}[command]
    out = {"same": files / victim, "dotdot": files / ".." / files.name / victim}.get(spelling, files / f"alias-{victim}")
    if spelling == "symlink":
        out.symlink_to(files / victim)
    elif spelling == "hardlink":
        os.link(files / victim, out)
    before = listing(files)
    argv = {
        "build": ["build", files / "a.bin", "-o", out, *UNTAGGED_ARGS],
        "export-llama": ["export-llama", files / "a.ngc", "-o", out],
        "merge": ["merge", files / "a.ngc", files / "b.ngc", "-o", out],
        "import-llama": ["import-llama", files / "a.lcs", "-o", out, *UNTAGGED_ARGS],
    }[command]
    rc, _, err = main(capsys, *argv)
    assert rc == 2
    one_line_error(err, f"-o {out} is the input", "would destroy the input")
    assert listing(files) == before  # nothing written, nothing replaced, no temporary files


def test_an_output_onto_a_token_files_offsets_is_refused(capsys, tmp_path):
    """`build small.npy -o small.offsets.npy` read the offsets and then overwrote them (exit 0): the
    next build of small.npy failed on a file that was now a cache. The offsets are an input too."""
    np.save(tmp_path / "small.npy", np.arange(40, dtype=np.int32) % 7)
    np.save(tmp_path / "small.offsets.npy", np.array([0, 20], dtype=np.int64))
    before = listing(tmp_path)
    out = tmp_path / "small.offsets.npy"
    rc, _, err = main(capsys, "build", tmp_path / "small.npy", "-o", out, *UNTAGGED_ARGS)
    assert rc == 2, err
    one_line_error(err, f"-o {out} is the input {out}", "would destroy the input")
    assert listing(tmp_path) == before
    assert np.load(out).tolist() == [0, 20]


@pytest.mark.parametrize("command", ["build", "import-llama", "stats"])
def test_an_output_onto_the_tokenizer_file_is_refused(capsys, files, command):
    """Every file a command reads is an input: the --tokenizer file too, for -o and --dump-drafts alike."""
    spec = files / "tok.json"
    spec.write_text('{"a tokenizer.json": "stand-in"}')
    argv, flag = {
        "build": (["build", files / "a.bin", "-o", spec, "--tokenizer", spec], "-o"),
        "import-llama": (["import-llama", files / "a.lcs", "-o", spec, "--tokenizer", spec], "-o"),
        "stats": (["stats", "--input", files / "a.bin", "--static", files / "a.ngc", "--tokenizer", spec,
                   "--dump-drafts", spec], "--dump-drafts"),
    }[command]
    before = listing(files)
    rc, _, err = main(capsys, *argv)
    assert rc == 2, err
    one_line_error(err, f"{flag} {spec} is the input", "would destroy the input")
    assert listing(files) == before  # the tokenizer file is untouched


def test_an_output_inside_an_input_folder_is_refused(capsys, files, tmp_path):
    (files / "sub").mkdir()
    rc, _, err = main(capsys, "build", files, "-o", files / "sub" / ".." / "all.ngc", *UNTAGGED_ARGS)
    assert rc == 2
    one_line_error(err, "lies inside the input folder", str(files))
    (tmp_path / "link").symlink_to(files)  # the same folder under another name
    rc, _, err = main(capsys, "build", tmp_path / "link", "-o", files / "all.ngc", *UNTAGGED_ARGS)
    assert rc == 2 and "lies inside the input folder" in err
    assert not (files / "all.ngc").exists()


def test_unwritable_outputs_are_refused_before_any_work(capsys, files, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the command started work before checking its output")

    monkeypatch.setattr(build_module, "StaticBuilder", no_work)
    monkeypatch.setattr(commands, "StaticBuilder", no_work)
    monkeypatch.setattr(commands, "export_llama", no_work)
    (tmp_path / "plain").write_text("x")
    cases = [
        (["build", files / "a.bin", "-o", tmp_path, *UNTAGGED_ARGS], f"-o {tmp_path} is a directory"),
        (["build", files / "a.bin", "-o", tmp_path / "nonexistent" / "x.ngc", *UNTAGGED_ARGS],
         f"the folder {tmp_path / 'nonexistent'} does not exist"),
        (["build", files / "a.bin", "-o", tmp_path / "plain" / "x.ngc", *UNTAGGED_ARGS], "is not a folder"),
        (["build", files / "a.bin", "-o", tmp_path / "x.ngc", "--scratch-dir", tmp_path / "nope", *UNTAGGED_ARGS],
         f"--scratch-dir {tmp_path / 'nope'} does not exist"),
        (["build", files / "a.bin", "-o", tmp_path / "x.ngc", "--scratch-dir", tmp_path / "plain", *UNTAGGED_ARGS],
         "--scratch-dir", ),
        (["export-llama", files / "a.ngc", "-o", tmp_path], "is a directory"),
        (["merge", files / "a.ngc", files / "b.ngc", "-o", "/nonexistent/m.ngc"], "the folder /nonexistent does not exist"),
        (["import-llama", files / "a.lcs", "-o", tmp_path / "nonexistent" / "x", *UNTAGGED_ARGS], "does not exist"),
        (["stats", "--input", files / "a.bin", "--dump-drafts", tmp_path], "--dump-drafts"),
    ]
    for argv, needle in cases:
        rc, _, err = main(capsys, *argv)
        assert rc == 2, (argv, err)
        one_line_error(err, needle)
        assert ".tmp." not in err and "scratch file" not in err
    assert not (tmp_path / "x.ngc").exists()


def _more_than_this_machine() -> str:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "100GiB" if physical < 100 << 30 else str(2 * physical)


@pytest.mark.parametrize(("argv", "flag"), [
    (["build", "A", "-o", "OUT", "--generation", "-1"], "--generation"),
    (["build", "A", "-o", "OUT", "--memory-budget", _more_than_this_machine()], "--memory-budget"),
    (["build", "A", "-o", "OUT", "--memory-budget", "nan"], "--memory-budget"),
    (["build", "A", "-o", "OUT", "--memory-budget", "inf"], "--memory-budget"),
    (["build", "A", "-o", "OUT", "--memory-budget", "1MiB"], "--memory-budget"),
    (["build", "A", "-o", "OUT", "--memory-budget", "-5GiB"], "--memory-budget"),
    (["build", "A", "-o", "OUT", "--threads", "-1"], "--threads"),
    (["build", "A", "-o", "OUT", "--ngram-size", "5"], "--ngram-size"),
    (["build", "A", "-o", "OUT", "--vocab-size", "0"], "--vocab-size"),
    (["build", "A", "-o", "OUT", "--fingerprint", "abc"], "--fingerprint"),
    (["merge", "A", "-o", "OUT", "--generation", "x"], "--generation"),
    (["import-llama", "A", "-o", "OUT", "--memory-budget", "nan"], "--memory-budget"),
    (["demo", "--test-files", "0"], "--test-files"),
    (["demo", "--n-ctx", "0"], "--n-ctx"),
    (["stats", "--input", "A", "--n-draft", "0"], "--n-draft"),
    (["stats", "--input", "A", "--n-draft", "300"], "--n-draft"),
    (["stats", "--input", "A", "--n-ctx", "1"], "--n-ctx"),
    (["stats", "--input", "A", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min 3 is above --ngram-max 2"),
])
def test_bad_values_are_refused_in_one_line_naming_the_flag(capsys, files, tmp_path, argv, flag):
    argv = [str(files / "a.bin") if a == "A" else str(tmp_path / "out.ngc") if a == "OUT" else a for a in argv]
    if argv[0] in ("build", "import-llama") and "--vocab-size" not in argv and "--fingerprint" not in argv:
        argv += UNTAGGED_ARGS
    if argv[0] == "import-llama":
        argv[1] = str(files / "a.lcs")
    rc, _, err = main(capsys, *argv)
    assert rc == 2
    one_line_error(err, flag)
    assert not (tmp_path / "out.ngc").exists()


def test_out_of_memory_and_unexpected_errors_are_one_line(capsys, files, tmp_path, monkeypatch):
    def bad_alloc(*args, **kwargs):
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(build_module, "StaticBuilder", bad_alloc)
    rc, _, err = main(capsys, "build", files / "a.bin", "-o", tmp_path / "x.ngc", *UNTAGGED_ARGS)
    assert rc == 2
    one_line_error(err, "out of memory", "--memory-budget")

    def bug(args):
        raise TypeError("something nobody expected")

    monkeypatch.setattr(cli_parser, "cmd_inspect", bug)
    rc, _, err = main(capsys, "inspect", files / "a.ngc")
    assert rc == 1
    one_line_error(err, "unexpected error: TypeError: something nobody expected", "NGRAMCACHE_TRACEBACK=1")
    monkeypatch.setenv("NGRAMCACHE_TRACEBACK", "1")
    assert "Traceback" in main(capsys, "inspect", files / "a.ngc")[2]


def test_ctrl_c_stops_a_build_in_one_line_and_leaves_nothing(tmp_path):
    # 400 MB of zero tokens (a sparse file: no disk used) takes seconds to count; the signal
    # is sent once the build has opened the input, i.e. while it is counting.
    big = tmp_path / "in" / "zeros.bin"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(400 << 20)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["build", str(big), "-o", str(out / "zeros.ngc"), "--vocab-size", "10", "--fingerprint", "untagged",
            "--memory-budget", "64MiB"]
    # `python -m ngramcache.client.tools.cli ARGV`, with Ctrl-C handled even if this test runs with SIGINT ignored (nohup).
    launcher = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "sys.argv[0] = 'ngramcache'; runpy.run_module('ngramcache.client.tools.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", launcher, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while str(big) not in _open_files(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the build never opened its input"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines() == ["ngramcache build: interrupted; nothing was written"]
    assert stdout == ""
    assert list(out.iterdir()) == []  # no output, no temporary file, no scratch file


def _open_files(pid: int) -> set[str]:
    names = set()
    with suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with suppress(OSError):
                names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return names


def test_ctrl_c_after_the_output_is_written_says_it_is_complete(capsys, files, tmp_path, monkeypatch):
    real = build_module.StaticBuilder

    class InterruptedAfterFinish:
        def __init__(self, *args, **kwargs):
            self._builder = real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._builder, name)

        def finish(self):
            self._builder.finish()
            raise KeyboardInterrupt  # Ctrl-C while the core was writing: seen once it returns

    monkeypatch.setattr(build_module, "StaticBuilder", InterruptedAfterFinish)
    out = tmp_path / "a.ngc"
    rc, _, err = main(capsys, "build", files / "a.bin", "-o", out, *UNTAGGED_ARGS, "--quiet")
    assert rc == 130
    assert err.splitlines() == [f"ngramcache build: interrupted after writing {out}; it is complete"]
    assert StaticCache.open(str(out)).n_tokens == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ngc", "files"]


def test_ctrl_c_while_reading_leaves_an_old_output_untouched(capsys, files, tmp_path, monkeypatch):
    out = tmp_path / "old.ngc"
    out.write_bytes((files / "b.ngc").read_bytes())

    def interrupted(item):
        yield iter([np.zeros(10, np.int32)])
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "token_streams", interrupted)
    rc, _, err = main(capsys, "build", files / "a.bin", "-o", out, *UNTAGGED_ARGS)
    assert rc == 130
    assert err.splitlines() == ["ngramcache build: interrupted; nothing was written"]
    assert out.read_bytes() == (files / "b.ngc").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files", "old.ngc"]


def test_ctrl_c_while_writing_drafts_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
    test = write_tokens(tmp_path / "t.bin", [1, 2, 3] * 6 + [9])
    real_lines = commands._draft_lines

    def interrupted(drafts):
        lines = real_lines(drafts)
        yield next(lines)
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "_draft_lines", interrupted)
    rc, _, err = main(capsys, "stats", "--input", test, "--n-ctx", "6", "--dump-drafts", tmp_path / "d.txt")
    assert rc == 130
    assert err.splitlines() == ["ngramcache stats: interrupted; nothing was written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]


def test_ctrl_c_in_the_demo_removes_its_empty_folder(capsys, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_demo, "build_static_from_tokens", interrupted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc, _, err = main(capsys, "demo", "--test-files", "2", "--n-ctx", "512")
    assert rc == 130
    assert err.splitlines() == ["ngramcache demo: interrupted; nothing was written"]
    assert list(tmp_path.iterdir()) == []


def test_the_demo_removes_its_temporary_folder_and_keeps_a_workdir(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rc, out, err = main(capsys, "demo", "--test-files", "2", "--n-ctx", "512")
    assert rc == 0, err
    assert "context + dynamic + static" in out and "removed" in out.splitlines()[-1]
    assert list((tmp_path / "tmp").iterdir()) == []
    rc, out, err = main(capsys, "demo", "--test-files", "2", "--n-ctx", "512", "--workdir", tmp_path / "kept")
    assert rc == 0, err
    assert StaticCache.open(tmp_path / "kept" / "stdlib.ngc").generation == 1
    assert out.splitlines()[-1].startswith("the cache stays at")


def test_the_demo_refuses_a_workdir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    rc, _, err = main(capsys, "demo", "--workdir", tmp_path / "f")
    assert rc == 2
    one_line_error(err, f"--workdir {tmp_path / 'f'} is not a folder")


def test_stats_refuses_an_input_not_longer_than_n_ctx(capsys, tmp_path):
    test = write_tokens(tmp_path / "t.bin", [1, 2, 3] * 6 + [9])  # 19 tokens
    for n_ctx in ("19", "4096"):
        rc, out, err = main(capsys, "stats", "--input", test, "--n-ctx", n_ctx)
        assert rc == 2 and out == ""
        one_line_error(err, f"{test} holds 19 tokens", f"--n-ctx {n_ctx}")
    rc, out, _ = main(capsys, "stats", "--input", test, "--n-ctx", "18", "--json")
    assert rc == 0 and json.loads(out)["n_draft_calls"] > 0


def test_merge_sums_n_tokens_and_inspect_says_what_is_unknown(capsys, files, tmp_path):
    run("merge", str(files / "a.ngc"), str(files / "b.ngc"), "-o", str(tmp_path / "m.ngc"))
    assert StaticCache.open(str(tmp_path / "m.ngc")).n_tokens == 3000 + 2000
    info = json.loads(run("inspect", str(tmp_path / "m.ngc"), "--json").stdout)
    assert info["n_tokens"] == 5000 and info["fingerprint"] == "untagged"
    text = run("inspect", str(tmp_path / "m.ngc")).stdout
    assert "fingerprint: untagged" in text and "n_tokens: 5000" in text
    # llama.cpp's format does not record how many tokens were counted: unknown, not 0.
    run("import-llama", str(files / "a.lcs"), "-o", str(tmp_path / "i.ngc"), *UNTAGGED_ARGS)
    assert "n_tokens: unknown" in run("inspect", str(tmp_path / "i.ngc")).stdout
    assert json.loads(run("inspect", str(tmp_path / "i.ngc"), "--json").stdout)["n_tokens"] is None
    # Merged with a file of unknown count, the sum is unknown too (not a misleading partial sum).
    r = run("merge", str(files / "a.ngc"), str(tmp_path / "i.ngc"), "-o", str(tmp_path / "mi.ngc"))
    assert StaticCache.open(str(tmp_path / "mi.ngc")).n_tokens == 0
    assert "an unknown number of tokens" in r.stdout and "so the merged file's is too" in r.stderr
    run("build", str(files / "a.bin"), "-o", str(tmp_path / "t.ngc"), "--vocab-size", "50", "--fingerprint", "12" * 32)
    assert f"fingerprint: {'12' * 32}" in run("inspect", str(tmp_path / "t.ngc")).stdout


def test_token_errors_name_the_file_and_the_position(capsys, tmp_path):
    write_tokens(tmp_path / "oov.bin", [1, 2, 300000, 4])
    rc, _, err = main(capsys, "build", tmp_path / "oov.bin", "-o", tmp_path / "x.ngc", "--vocab-size", "1000",
                      "--fingerprint", "untagged")
    assert rc == 2
    one_line_error(err, "oov.bin: token 300000 at position 2 is outside the vocabulary [0, 1000)", "--vocab-size 1000")
    # In a .npy of several streams the position counts from the start of the file.
    np.save(tmp_path / "s.npy", np.array([1, 2, 3, 4, 5, -7, 6], dtype=np.int32))
    np.save(tmp_path / "s.offsets.npy", np.array([0, 3], dtype=np.int64))
    rc, _, err = main(capsys, "build", tmp_path / "s.npy", "-o", tmp_path / "x.ngc", "--vocab-size", "1000",
                      "--fingerprint", "untagged")
    assert rc == 2 and "s.npy: token -7 at position 5" in err
    rc, _, err = main(capsys, "stats", "--input", tmp_path / "oov.bin", "--n-ctx", "2", "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "oov.bin: token 300000 at position 2 is outside the vocabulary", f"--tokenizer {TOKENIZER}")
    assert not (tmp_path / "x.ngc").exists()


def test_damaged_inputs_are_named_with_a_way_to_check_them(capsys, files, tmp_path):
    flipped = bytearray((files / "a.ngc").read_bytes())
    keys = next(s for s in StaticCache.open(str(files / "a.ngc")).sections if s["name"] == "KEYS")
    flipped[keys["offset"] + 8: keys["offset"] + 10] = b"\xff\xff"
    (tmp_path / "flip.ngc").write_bytes(bytes(flipped))
    rc, _, err = main(capsys, "merge", files / "b.ngc", tmp_path / "flip.ngc", "-o", tmp_path / "m.ngc")
    assert rc == 2
    one_line_error(err, "flip.ngc", f"ngramcache inspect --verify {tmp_path / 'flip.ngc'}")
    assert not (tmp_path / "m.ngc").exists()
    (tmp_path / "cut.ngc").write_bytes((files / "a.ngc").read_bytes()[:3000])
    rc, _, err = main(capsys, "stats", "--input", files / "b.bin", "--static", tmp_path / "cut.ngc", "--n-ctx", "100")
    assert rc == 2
    one_line_error(err, "cut.ngc: truncated", f"ngramcache inspect --verify {tmp_path / 'cut.ngc'}")
    (tmp_path / "cut.lcs").write_bytes((files / "a.lcs").read_bytes()[:-6])
    rc, _, err = main(capsys, "stats", "--input", files / "b.bin", "--dynamic", tmp_path / "cut.lcs", "--n-ctx", "100")
    assert rc == 2
    one_line_error(err, f"--dynamic {tmp_path / 'cut.lcs'}", "byte")
    rc, _, err = main(capsys, "stats", "--input", files / "b.bin", "--dynamic", files / "a.ngc", "--n-ctx", "100")
    assert rc == 2 and "is a static cache: pass it as --static" in err


def test_os_errors_are_sentences(capsys, files, tmp_path, monkeypatch):
    rc, _, err = main(capsys, "inspect", tmp_path)
    assert rc == 2
    one_line_error(err, f"{tmp_path} is a directory")
    rc, _, err = main(capsys, "stats", "--input", files / "a.bin", "--static", tmp_path / "nope.ngc")
    assert rc == 2
    one_line_error(err, f"--static {tmp_path / 'nope.ngc'} does not exist")
    os.mkfifo(tmp_path / "fifo")
    rc, _, err = main(capsys, "build", tmp_path / "fifo", "-o", tmp_path / "x.ngc", *UNTAGGED_ARGS)
    assert rc == 2 and "is not a regular file or a folder" in err
    for code, text in [(errno.EISDIR, "x is a directory"), (errno.EACCES, "x: permission denied"),
                       (errno.ENOENT, "x does not exist"), (errno.ENOSPC, "x: no space left on the device")]:
        def fail(args, code=code):
            raise OSError(code, os.strerror(code), "x")

        monkeypatch.setattr(cli_parser, "cmd_inspect", fail)
        rc, _, err = main(capsys, "inspect", files / "a.ngc")
        assert rc == 2
        one_line_error(err, f"ngramcache inspect: error: {text}")
        assert "Errno" not in err


def test_permission_denied_is_checked_first_even_as_root(capsys, files, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as an unprivileged user sees a locked folder
    rc, _, err = main(capsys, "build", files / "a.bin", "-o", tmp_path / "x.ngc", *UNTAGGED_ARGS)
    assert rc == 2
    one_line_error(err, f"-o {tmp_path / 'x.ngc'}: cannot write in the folder {tmp_path}: permission denied")
    rc, _, err = main(capsys, "inspect", files / "a.ngc")
    assert rc == 2
    one_line_error(err, "a.ngc: permission denied")


def test_every_option_is_explained():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"demo", "build", "stats", "inspect", "merge", "import-llama", "export-llama", "export-sglang",
                             "sglang-sync", "llama-follow", "tokenize", "tokenizer-info"}
    for name, sub in commands.items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = "/".join(action.option_strings) or action.dest
            assert action.help and len(action.help) > 15, (name, flag)
            if action.default not in (None, False) and action.required is False:
                assert "default" in action.help, (name, flag)
        text = run(name, "--help").stdout
        assert "usage:" in text and "Traceback" not in text
    assert "(default 1GiB)" in run("build", "--help").stdout


@pytest.mark.parametrize("command", ["build", "import-llama"])
def test_an_empty_input_is_refused_not_written_as_an_empty_cache(capsys, tmp_path, command):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    out = tmp_path / "out.ngc"
    rc, _, err = main(capsys, command, empty, "-o", out, *UNTAGGED_ARGS)
    assert rc == 2, err
    one_line_error(err, "nothing to build" if command == "build" else "is empty", "was not written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.bin"]  # no output, no temporary file


def _run_file_size_limited(limit: int, *args: object) -> subprocess.CompletedProcess:
    """The CLI with writes past `limit` bytes failing (RLIMIT_FSIZE, SIGXFSZ ignored): what a full disk does to a write."""
    import resource
    import signal

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "ngramcache.client.tools.cli", *map(str, args)], capture_output=True,
                          text=True, preexec_fn=limit_writes, timeout=120)


def test_a_write_that_fails_midway_names_the_file(files, tmp_path):
    out = tmp_path / "out" / "drafts.txt"
    out.parent.mkdir()
    r = _run_file_size_limited(4096, "stats", "--input", files / "a.bin", "--static", files / "a.ngc", "--n-ctx", "64",
                               "--dump-drafts", out)
    assert r.returncode == 2, r.stderr
    one_line_error(r.stderr, str(out))
    assert list(out.parent.iterdir()) == []  # no partial output, no temporary file
    big = tmp_path / "big"
    big.mkdir()
    write_tokens(big / "t.bin", np.random.default_rng(3).integers(0, 50, 200_000))
    r = _run_file_size_limited(64 << 10, "build", big / "t.bin", "-o", tmp_path / "out" / "t.ngc", *UNTAGGED_ARGS,
                               "--quiet")
    assert r.returncode == 2, r.stderr
    one_line_error(r.stderr, str(tmp_path / "out"))
    assert list(out.parent.iterdir()) == []


# --- The command line's surface: --version and --json -----------------------------------------


def test_version_prints_the_installed_version_and_exits_0(capsys):
    import importlib.metadata

    rc, out, err = main(capsys, "--version")
    assert rc == 0 and err == ""
    assert out == f"ngramcache {importlib.metadata.version('ngramcache')}\n"
    assert re.fullmatch(r"ngramcache \d+\.\d+\.\d+\S*\n", out), out


def test_merge_import_and_export_print_one_json_object_with_json(capsys, files, tmp_path):
    a, b = StaticCache.open(str(files / "a.ngc")), StaticCache.open(str(files / "b.ngc"))
    rc, out, err = main(capsys, "merge", files / "a.ngc", files / "b.ngc", "-o", tmp_path / "m.ngc", "--json")
    assert rc == 0, err
    merged = json.loads(out)
    m = StaticCache.open(str(tmp_path / "m.ngc"))
    assert merged == {"output": str(tmp_path / "m.ngc"), "inputs": [str(files / "a.ngc"), str(files / "b.ngc")],
                      "n_keys": m.n_keys, "n_followers": m.n_followers, "n_tokens": a.n_tokens + b.n_tokens,
                      "n_pairs": merged["n_pairs"], "generation": max(a.generation, b.generation),
                      "file_bytes": m.file_size}
    assert merged["n_pairs"] > 0 and m.n_tokens == 5000

    rc, out, err = main(capsys, "export-llama", files / "a.ngc", "-o", tmp_path / "a.lcs", "--json")
    assert rc == 0, err
    assert json.loads(out) == {"input": str(files / "a.ngc"), "output": str(tmp_path / "a.lcs"), "format": "llama.cpp",
                               "n_keys": a.n_keys, "file_bytes": (tmp_path / "a.lcs").stat().st_size}

    rc, out, err = main(capsys, "import-llama", tmp_path / "a.lcs", "-o", tmp_path / "back.ngc", *UNTAGGED_ARGS, "--json")
    assert rc == 0, err
    back = StaticCache.open(str(tmp_path / "back.ngc"))
    assert json.loads(out) == {"input": str(tmp_path / "a.lcs"), "output": str(tmp_path / "back.ngc"),
                               "n_keys": a.n_keys, "n_followers": a.n_followers, "n_tokens": None,
                               "file_bytes": back.file_size}

    # An imported input's token count is unknown, so the merge's is too: null, and the note stays on stderr.
    rc, out, err = main(capsys, "merge", tmp_path / "back.ngc", files / "b.ngc", "-o", tmp_path / "m2.ngc", "--json")
    assert rc == 0, err
    assert json.loads(out)["n_tokens"] is None


def test_json_goes_to_stdout_even_with_quiet_and_errors_stay_one_line_on_stderr(capsys, files, tmp_path):
    rc, out, _ = main(capsys, "export-llama", files / "a.ngc", "-o", tmp_path / "q.lcs", "--json", "--quiet")
    assert rc == 0 and json.loads(out)["output"] == str(tmp_path / "q.lcs")
    rc, out, err = main(capsys, "merge", files / "a.ngc", files / "missing.ngc", "-o", tmp_path / "x.ngc", "--json")
    assert rc == 2 and out == ""
    one_line_error(err, "missing.ngc does not exist")


def test_tokenizer_info_prints_the_fingerprint_errors_show(capsys):
    tok = load_tokenizer(TOKENIZER)
    rc, out, err = main(capsys, "tokenizer-info", TOKENIZER)
    assert rc == 0, err
    assert out.splitlines() == [f"       spec: {TOKENIZER}", "       kind: tiktoken", f" vocab_size: {tok.vocab_size}",
                                f"fingerprint: {tok.fingerprint.hex()}"]
    rc, out, err = main(capsys, "tokenizer-info", TOKENIZER, "--json")
    assert rc == 0, err
    assert json.loads(out) == {"spec": TOKENIZER, "kind": "tiktoken", "vocab_size": tok.vocab_size,
                               "fingerprint": tok.fingerprint.hex()}
    rc, out, err = main(capsys, "tokenizer-info", "Qwen/Qwen2.5-0.5B")
    assert rc == 2 and out == ""
    one_line_error(err, "ngramcache tokenizer-info: error: tokenizer 'Qwen/Qwen2.5-0.5B' is not a file here and looks "
                        "like a Hugging Face hub id: hub ids are never fetched")


def test_an_input_folder_given_as_output_gets_a_suggestion_that_works(capsys, texts, tmp_path, monkeypatch):
    corpus_dir = tmp_path / "corpus"
    shutil.copytree(texts, corpus_dir)
    for output in ("corpus", "corpus/", "."):
        workdir = corpus_dir if output == "." else tmp_path
        monkeypatch.chdir(workdir)
        source = "." if output == "." else "corpus"
        rc, _, err = main(capsys, "build", source, "-o", output, "--tokenizer", TOKENIZER)
        assert rc == 2
        expected = "../corpus.ngc" if output == "." else "corpus.ngc"
        one_line_error(err, f"-o {output} is a directory: give the file to write, e.g. {expected}")
        rc, _, err = main(capsys, "build", source, "-o", expected, "--tokenizer", TOKENIZER, "--quiet")
        assert rc == 0, err
        (workdir / expected).unlink()
    # A folder that is no input still gets NAME inside it.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    rc, _, err = main(capsys, "build", "corpus", "-o", "out", "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "-o out is a directory: give the file to write, e.g. out/NAME")


def test_build_skips_binary_files_in_folders_with_a_note(capsys, texts, tmp_path):
    corpus_dir = tmp_path / "corpus"
    shutil.copytree(texts, corpus_dir)
    (corpus_dir / "__pycache__").mkdir()
    (corpus_dir / "__pycache__" / "bisect.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0")  # left out quietly
    (corpus_dir / "old").mkdir()
    (corpus_dir / "old" / "heapq.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0")  # skipped with a note
    (corpus_dir / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    rc, out, err = main(capsys, "build", corpus_dir, "-o", tmp_path / "all.ngc", "--tokenizer", TOKENIZER, "--json")
    assert rc == 0, err
    assert err.splitlines()[-1] == (f"note: skipped 2 files found in input folders that are neither UTF-8 text nor a token "
                           f"file (e.g. {corpus_dir / 'logo.png'}); --exclude GLOB leaves such files out")
    assert json.loads(out)["inputs"] == 4 and json.loads(out)["skipped"] == 2
    rc, _, err = main(capsys, "build", corpus_dir, "-o", tmp_path / "text.ngc", "--tokenizer", TOKENIZER, "--quiet",
                      "--exclude", "*.pyc", "--exclude", "*.png")
    assert rc == 0 and err == ""
    rc, _, err = main(capsys, "build", texts, "-o", tmp_path / "plain.ngc", "--tokenizer", TOKENIZER, "--quiet")
    assert rc == 0, err
    assert (tmp_path / "text.ngc").read_bytes() == (tmp_path / "plain.ngc").read_bytes() == \
        (tmp_path / "all.ngc").read_bytes()
    # Only the files --include names.
    rc, out, err = main(capsys, "build", corpus_dir, "-o", tmp_path / "two.ngc", "--tokenizer", TOKENIZER, "--json",
                        "--include", "b*.py", "--include", "h*.py")
    assert rc == 0 and "note:" not in err and json.loads(out)["inputs"] == 2
    # A binary file named directly is refused.
    rc, _, err = main(capsys, "build", corpus_dir / "logo.png", "-o", tmp_path / "x.ngc", "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "logo.png: not UTF-8 text (byte 0)")


def test_tokenize_writes_the_streams_build_reads(capsys, texts, tmp_path):
    tok = load_tokenizer(TOKENIZER)
    corpus_dir = tmp_path / "corpus"
    shutil.copytree(texts, corpus_dir)
    (corpus_dir / "empty.txt").write_text("")
    (corpus_dir / "blob.dat").write_bytes(b"\xff\0")
    rc, out, err = main(capsys, "tokenize", corpus_dir, "-o", tmp_path / "c.npy", "--tokenizer", TOKENIZER)
    assert rc == 0, err
    files = sorted(p for p in corpus_dir.iterdir() if p.name != "blob.dat")
    arrays = [tok.encode(f.read_text()) for f in files]
    n = sum(len(a) for a in arrays)
    assert out.strip() == (f"wrote {tmp_path / 'c.npy'} ({n:,} tokens of {TOKENIZER}) and "
                           f"{tmp_path / 'c.offsets.npy'} ({len(files)} streams, one per file)")
    assert "note: skipped 1 file found in input folders that is neither UTF-8 text nor a token file" in err
    tokens = np.load(tmp_path / "c.npy")
    assert tokens.dtype == np.dtype("<i4") and np.array_equal(tokens, np.concatenate(arrays))
    assert np.load(tmp_path / "c.offsets.npy").tolist() == list(np.cumsum([0] + [len(a) for a in arrays[:-1]]))
    streams = [np.concatenate(list(s) or [np.zeros(0, np.int32)])
               for s in corpus.token_streams(corpus.collect_inputs([str(tmp_path / "c.npy")])[0])]
    assert [s.tolist() for s in streams] == [a.tolist() for a in arrays]
    # build reads the pair as it reads the text.
    rc, _, err = main(capsys, "build", corpus_dir, "--exclude", "*.dat", "-o", tmp_path / "text.ngc",
                      "--tokenizer", TOKENIZER, "--quiet")
    assert rc == 0, err
    rc, _, err = main(capsys, "build", tmp_path / "c.npy", "-o", tmp_path / "tokens.ngc", "--tokenizer", TOKENIZER,
                      "--quiet")
    assert rc == 0, err
    assert (tmp_path / "text.ngc").read_bytes() == (tmp_path / "tokens.ngc").read_bytes()
    # Run again over fewer files: both files replaced, no temporary left behind.
    rc, _, err = main(capsys, "tokenize", corpus_dir / "heapq.py", "-o", tmp_path / "c.npy", "--tokenizer", TOKENIZER,
                      "--quiet")
    assert rc == 0 and err == ""
    assert np.load(tmp_path / "c.offsets.npy").tolist() == [0]
    assert np.array_equal(np.load(tmp_path / "c.npy"), tok.encode((corpus_dir / "heapq.py").read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy", "c.offsets.npy", "corpus", "text.ngc", "tokens.ngc"]


def test_tokenize_refuses_what_it_cannot_write(capsys, texts, tmp_path):
    cases = [
        (["-o", tmp_path / "c.bin"], "the token file must end in .npy (not .offsets.npy)"),
        (["-o", tmp_path / "c.offsets.npy"], "the token file must end in .npy (not .offsets.npy)"),
        (["-o", texts / "c.npy"], f"-o {texts / 'c.npy'} lies inside the input folder {texts}"),
        (["-o", tmp_path], f"-o {tmp_path} is a directory"),
    ]
    for extra, needle in cases:
        rc, _, err = main(capsys, "tokenize", texts, "--tokenizer", TOKENIZER, *extra)
        assert rc == 2, (extra, err)
        one_line_error(err, needle)
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    rc, _, err = main(capsys, "tokenize", tmp_path / "t.npy", "-o", tmp_path / "u.npy", "--tokenizer", TOKENIZER)
    assert rc == 2
    one_line_error(err, "t.npy is a token file already: tokenize takes text files")
    assert not (tmp_path / "u.npy").exists()


def test_ctrl_c_after_the_command_finished_prints_no_traceback():
    """A Ctrl-C that lands once the command is done (during the interpreter's shutdown) has nothing to stop: the
    console script ignores it, so Python prints no "Exception ignored in threading._shutdown" traceback."""
    code = ("import os, signal, sys, time; from ngramcache.cache_service.entry import main; "
            "sys.argv = ['ngramcache', 'tokenizer-info', 'tiktoken:cl100k_base']; "
            "signal.signal(signal.SIGINT, signal.default_int_handler); status = main(); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); print('exit', status); sys.exit(status)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "exit 0" and "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
