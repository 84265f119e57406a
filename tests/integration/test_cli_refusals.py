"""The CLI never loses data and never shows a traceback: an output that would destroy an input, a bad value, a damaged
or unreadable input, a write that fails midway are each refused in one line (most tests run main(argv) in this
process: fast, and a test can stand in for the builder)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import TOKENIZER, UNTAGGED_ARGS, main, one_line_error, write_tokens
from helpers.cli import files as files  # fixtures, imported by name so that pytest finds them here
from helpers.cli import texts as texts

from ngramcache import StaticCache
from ngramcache.client.kernel import build as build_module
from ngramcache.client.tools.cli import commands
from ngramcache.client.tools.cli import parser as cli_parser


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


def test_stats_refuses_an_input_not_longer_than_n_ctx(capsys, tmp_path):
    test = write_tokens(tmp_path / "t.bin", [1, 2, 3] * 6 + [9])  # 19 tokens
    for n_ctx in ("19", "4096"):
        rc, out, err = main(capsys, "stats", "--input", test, "--n-ctx", n_ctx)
        assert rc == 2 and out == ""
        one_line_error(err, f"{test} holds 19 tokens", f"--n-ctx {n_ctx}")
    rc, out, _ = main(capsys, "stats", "--input", test, "--n-ctx", "18", "--json")
    assert rc == 0 and json.loads(out)["n_draft_calls"] > 0


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
