"""`ngramcache build` and `tokenize` end to end, run as a user runs them: a cache from text is the cache from its tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
from helpers import reference
from helpers.cli import TOKENIZER, UNTAGGED_ARGS, main, one_line_error, run
from helpers.cli import files as files  # fixtures, imported by name so that pytest finds them here
from helpers.cli import texts as texts

from ngramcache import StaticCache
from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.tokenizer import load_tokenizer


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
