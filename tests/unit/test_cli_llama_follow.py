"""`ngramcache llama-follow`'s refusals: each mistake is one line naming the flag or argument to fix, exit status 2, before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ngramcache.client.tools import cli

FP = "00" * 32
STAND_IN = str(Path(__file__).resolve().parents[1] / "helpers" / "llama_stand_in.py")


def follow(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str, server: list[str] | None = None,
           lcs: str | None = None) -> tuple[int, str]:
    argv = ["llama-follow", "--server", "127.0.0.1:1", "--namespace", "ns", "--lcs", lcs or str(tmp_path / "s.lcs"),
            "--cache-dir", str(tmp_path / "cache"), *extra, "--",
            *(server if server is not None else [sys.executable, STAND_IN, "--spec-type", "ngram-cache"])]
    if not any(a in extra for a in ("--tokenizer", "--no-identity")):
        argv[1:1] = ["--vocab-size", "64", "--fingerprint", FP]
    argv = [a for a in argv if a != "--no-identity"]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    err = capsys.readouterr().err
    return rc, err


def one_line(err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0] == f"ngramcache llama-follow: error: {expected}", err


def test_help_says_what_it_does():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    text = sub.choices["llama-follow"].format_help()  # type: ignore[attr-defined]
    for needle in ("--switch", "overlap", "restart", "/health", "--lcs", "-- llama-server", "--spec-type ngram-cache"):
        assert needle in text, needle


def test_no_command_is_refused(capsys, tmp_path):
    rc, err = follow(capsys, tmp_path, server=[])
    assert rc == 2
    one_line(err, "give the llama-server command after '--': ngramcache llama-follow ... -- llama-server -m MODEL "
                  "--spec-type ngram-cache")


def test_a_command_without_the_ngram_cache_type_is_refused(capsys, tmp_path):
    rc, err = follow(capsys, tmp_path, server=["llama-server", "-m", "m.gguf", "--spec-type", "ngram-simple"])
    assert rc == 2
    one_line(err, "llama-server drafts from the -lcs file only with --spec-type ngram-cache: add it to the "
                  "llama-server arguments")
    rc, _ = follow(capsys, tmp_path, server=["no-such-llama-server", "--spec-type=ngram-simple,ngram-cache"])
    assert rc == 2  # accepted as a type list, then refused as not found (below)


@pytest.mark.parametrize("flag", ["--port", "--host", "-lcs", "--lookup-cache-static"])
def test_the_flags_llama_follow_sets_are_refused(capsys, tmp_path, flag):
    rc, err = follow(capsys, tmp_path, server=["llama-server", "--spec-type", "ngram-cache", flag, "x"])
    assert rc == 2
    one_line(err, f"llama-server argument {flag}: llama-follow sets it (the server listens on a loopback port of its "
                  "own and reads --lcs); use --listen for the address clients connect to")


def test_a_missing_server_binary_is_refused(capsys, tmp_path):
    rc, err = follow(capsys, tmp_path, server=["no-such-llama-server", "--spec-type", "ngram-cache"])
    assert rc == 2
    one_line(err, "llama-server command 'no-such-llama-server' not found (not on PATH, or not an executable file): "
                  "give its path after '--'")


def test_bad_lcs_and_listen_are_refused(capsys, tmp_path):
    rc, err = follow(capsys, tmp_path, lcs=str(tmp_path / "missing" / "s.lcs"))
    assert rc == 2
    one_line(err, f"--lcs {tmp_path / 'missing' / 's.lcs'}: its folder {tmp_path / 'missing'} does not exist")
    rc, err = follow(capsys, tmp_path, lcs=str(tmp_path))
    assert rc == 2
    one_line(err, f"--lcs {tmp_path} is a folder: give the file to write, e.g. {tmp_path / 'static.lcs'}")
    rc, err = follow(capsys, tmp_path, "--listen", "8080")
    assert rc == 2
    one_line(err, "--listen '8080' is not HOST:PORT (e.g. 0.0.0.0:8080; port 0 picks a free one)")


def test_a_tokenizer_identity_is_required(capsys, tmp_path):
    rc, err = follow(capsys, tmp_path, "--no-identity")
    assert rc == 2
    one_line(err, "give the model's tokenizer: --tokenizer SPEC, or --vocab-size V with --fingerprint HEX (the "
                  "namespace's, as `ngramcache namespace list` shows them)")
