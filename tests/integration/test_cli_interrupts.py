"""Ctrl-C during and after a command: one line, nothing half-written, an old output untouched (main(argv) in this
process, and real subprocesses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress

import numpy as np
from helpers.cli import UNTAGGED_ARGS, main, write_tokens
from helpers.cli import files as files  # a fixture, imported by name so that pytest finds it here

from ngramcache import StaticCache
from ngramcache.client.kernel import build as build_module
from ngramcache.client.kernel import corpus
from ngramcache.client.tools.cli import commands
from ngramcache.client.tools.cli import demo as cli_demo


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
