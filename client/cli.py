"""The `ngramcache` command line: one entry point, one subcommand per task."""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from client import CountTable, Drafter, NgramCacheError, StaticCache, build_static_from_tokens
from client._core import replay


def _byte_tokens(path: Path) -> np.ndarray:
    """A file's bytes as tokens (vocabulary 256): the demo needs no tokenizer download."""
    return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)


def cmd_demo(args: argparse.Namespace) -> int:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 2000)
    if len(files) < 50:
        print(f"error: found only {len(files)} Python files under {lib}; the demo needs a standard library", file=sys.stderr)
        return 1
    held_out, corpus = files[::20][: args.test_files], [f for i, f in enumerate(files) if i % 20]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ngramcache-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "stdlib.ngc"

    print(f"corpus: {len(corpus)} files of CPython's standard library ({lib}), byte tokens (vocabulary 256)")
    t0 = time.perf_counter()
    streams = [_byte_tokens(p) for p in corpus]
    build_static_from_tokens(streams, str(out), vocab_size=256, ngram_size=2)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = StaticCache.open(str(out))
    t_open = (time.perf_counter() - t0) * 1e3
    n_tokens = sum(len(s) for s in streams)
    print(f"built {out}: {cache.n_keys:,} keys, {cache.n_followers:,} followers from {n_tokens:,} tokens "
          f"in {t_build:.2f} s; {cache.file_size / 1e6:.2f} MB; opened in {t_open:.3f} ms")

    test = np.concatenate([_byte_tokens(p) for p in held_out])
    print(f"replaying {len(test):,} held-out tokens ({len(held_out)} files) as llama-lookup-stats does "
          f"(n_ctx={args.n_ctx}, n_draft={args.n_draft}):")
    print(f"  {'tables':<26}{'drafted':>10}{'accepted':>10}{'accept %':>10}{'us/drafted':>12}")
    for label, static in (("context + dynamic", None), ("context + dynamic + static", cache)):
        r = replay(test, args.n_ctx, args.n_draft, 1, 4, static, CountTable())
        pct = 100.0 * r["n_accept"] / max(r["n_drafted"], 1)
        us = r["t_draft_ns"] / 1e3 / max(r["n_drafted"], 1)
        print(f"  {label:<26}{r['n_drafted']:>10,}{r['n_accept']:>10,}{pct:>10.1f}{us:>12.3f}")

    drafter = Drafter(static=cache)
    prompt = b"    def __init__(self"
    tokens = np.frombuffer(prompt, dtype=np.uint8).astype(np.int32)
    drafted = drafter.draft(0, tokens, 16)
    print(f"draft after {prompt.decode()!r}: {bytes(drafted.astype(np.uint8).tolist()).decode(errors='replace')!r}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    cache = StaticCache.open(args.file)
    if args.verify:
        cache.verify()
    info = {
        "path": cache.path,
        "format_version": cache.format_version,
        "ngram_size": cache.ngram_size,
        "vocab_size": cache.vocab_size,
        "fingerprint": cache.fingerprint.hex(),
        "generation": cache.generation,
        "n_keys": cache.n_keys,
        "n_followers": cache.n_followers,
        "n_tokens": cache.n_tokens,
        "n_overflow": cache.n_overflow,
        "file_size": cache.file_size,
        "sections": cache.sections,
        "verified": bool(args.verify),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if key != "sections":
                print(f"{key:>15}: {value}")
        for s in info["sections"]:
            print(f"{'section':>15}: {s['name']:<10} offset {s['offset']:>12,}  length {s['length']:>12,}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngramcache",
        description="A shared n-gram cache for speculative decoding (prompt lookup / llama.cpp's ngram cache).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="build a static cache from a real corpus and draft from it",
        description="Builds a static cache from CPython's standard library (byte tokens), opens it, and "
        "replays held-out files through the drafter as llama-lookup-stats does, with and without the cache.",
    )
    demo.add_argument("--workdir", help="where to write the cache (default: a new temporary directory)")
    demo.add_argument("--n-ctx", type=int, default=4096, help="replay chunk size in tokens (default 4096)")
    demo.add_argument("--n-draft", type=int, default=8, help="tokens drafted per call at most (default 8)")
    demo.add_argument("--test-files", type=int, default=20, help="held-out files replayed (default 20)")
    demo.set_defaults(func=cmd_demo)

    inspect = sub.add_parser(
        "inspect",
        help="print a static cache's header, counts and sections",
        description="Prints a static cache file's header fields, counts and section table. Opening checks "
        "the header and section table only; --verify also checks every section checksum.",
    )
    inspect.add_argument("file", help="a static cache file")
    inspect.add_argument("--verify", action="store_true", help="check every checksum and invariant (reads the whole file)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (NgramCacheError, OSError) as e:
        print(f"ngramcache {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
