"""The `ngramcache` command line itself: every command and option explained, --version, tokenizer-info, the demo.

The other CLI tests: test_cli_build.py, test_cli_caches.py, test_cli_refusals.py, test_cli_interrupts.py."""

from __future__ import annotations

import argparse
import json
import re
import tempfile

from helpers.cli import TOKENIZER, main, one_line_error, run

from ngramcache import StaticCache
from ngramcache.client.kernel.tokenizer import load_tokenizer
from ngramcache.client.tools import cli


def test_help_explains_every_command():
    out = run("--help").stdout
    for cmd in ["demo", "build", "stats", "inspect", "merge", "import-llama", "export-llama", "export-sglang"]:
        assert cmd in out
        assert "usage:" in run(cmd, "--help").stdout


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


def test_version_prints_the_installed_version_and_exits_0(capsys):
    import importlib.metadata

    rc, out, err = main(capsys, "--version")
    assert rc == 0 and err == ""
    assert out == f"ngramcache {importlib.metadata.version('ngramcache')}\n"
    assert re.fullmatch(r"ngramcache \d+\.\d+\.\d+\S*\n", out), out


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
