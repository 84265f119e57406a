"""The `ngramcache` commands end to end, run as a user runs them (a real subprocess)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import reference
from ngramcache import StaticCache
from ngramcache.client.tokenizer import load_tokenizer

TOKENIZER = "tiktoken:qwen"


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "ngramcache.client.cli", *args], capture_output=True, text=True)
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
    for cmd in ["demo", "build", "stats", "inspect", "merge", "import-llama", "export-llama"]:
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
    assert r.returncode == 2 and "token 50 at stream position 2 is outside the vocabulary" in r.stderr
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
