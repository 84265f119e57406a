"""The commands over cache files end to end: stats, inspect, merge, import-llama and export-llama, and their --json."""

from __future__ import annotations

import json
import struct

import numpy as np
from helpers import reference
from helpers.cli import TOKENIZER, UNTAGGED_ARGS, main, one_line_error, run, write_tokens
from helpers.cli import files as files  # fixtures, imported by name so that pytest finds them here
from helpers.cli import texts as texts

from ngramcache import StaticCache


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
