"""The `ngramcache` command line: one entry point, one subcommand per task."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from ngramcache.client import (
    CountTable,
    InvalidArgumentError,
    NgramCacheError,
    StaticCache,
    UNTAGGED,
    TokenizerMismatchError,
    build_static_from_tokens,
)
from ngramcache.client import corpus
from ngramcache import StaticBuilder, export_llama, import_llama, load_llama_counts, replay
from ngramcache.client.progress import Progress

ZERO_FINGERPRINT = bytes(32)


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
    build_static_from_tokens(streams, str(out), vocab_size=256, ngram_size=2, fingerprint=UNTAGGED)
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

    print(f"the cache stays at {out}; try: ngramcache inspect {out}")
    return 0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux


def _load_tokenizer(spec: str | None):
    if spec is None:
        return None
    from ngramcache.client.tokenizer import load_tokenizer

    return load_tokenizer(spec)


def _fingerprint_from_hex(text: str) -> bytes:
    try:
        fp = bytes.fromhex(text)
    except ValueError:
        fp = b""
    if len(fp) != 32:
        raise InvalidArgumentError(f"--fingerprint must be 64 hexadecimal digits (32 bytes), got {text!r}")
    return fp


def _vocab_and_fingerprint(args: argparse.Namespace, tokenizer) -> tuple[int, bytes]:
    """The vocabulary size and fingerprint a new file records: from --tokenizer, or given explicitly."""
    if tokenizer is not None:
        if args.vocab_size is not None and args.vocab_size != tokenizer.vocab_size:
            raise InvalidArgumentError(f"--vocab-size {args.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}")
        fp = tokenizer.fingerprint
        if args.fingerprint is not None and _fingerprint_from_hex(args.fingerprint) != fp:
            raise TokenizerMismatchError("--fingerprint differs from the tokenizer's fingerprint")
        return tokenizer.vocab_size, fp
    if args.vocab_size is None or args.fingerprint is None:
        raise InvalidArgumentError("token inputs need --tokenizer SPEC, or both --vocab-size and --fingerprint")
    return args.vocab_size, _fingerprint_from_hex(args.fingerprint)


def cmd_build(args: argparse.Namespace) -> int:
    items = corpus.collect_inputs(args.inputs)
    tokenizer = _load_tokenizer(args.tokenizer)
    if tokenizer is None and any(i.kind == "text" for i in items):
        raise InvalidArgumentError("text inputs need --tokenizer SPEC (a tokenizer.json path or tiktoken:<encoding>)")
    vocab, fingerprint = _vocab_and_fingerprint(args, tokenizer)
    budget = corpus.parse_size(args.memory_budget)
    builder = StaticBuilder(
        args.output, vocab, args.ngram_size, fingerprint=fingerprint, generation=args.generation,
        memory_budget=budget, scratch_dir=args.scratch_dir or "", threads=args.threads,
    )
    total = sum(i.size for i in items)
    progress = Progress("build", total, "B", quiet=args.quiet)
    t0 = time.perf_counter()
    t_tokenize = 0.0
    for item in (i for i in items if i.kind != "text"):
        for stream in corpus.token_streams(item):
            builder.begin_stream()
            for chunk in stream:
                builder.add_tokens(chunk)
                progress.update(4 * len(chunk), len(chunk))
    text_items = [i for i in items if i.kind == "text"]
    for batch in corpus.text_batches(text_items):
        ts = time.perf_counter()
        encoded = tokenizer.encode_batch([corpus.read_text(i.path) for i in batch])
        t_tokenize += time.perf_counter() - ts
        for item, tokens in zip(batch, encoded):
            builder.begin_stream()
            builder.add_tokens(tokens)
            progress.update(item.size, len(tokens))
    progress.close()
    if not args.quiet:
        print("merging sorted runs and writing the file...", file=sys.stderr)
    stats = builder.finish()
    elapsed = time.perf_counter() - t0
    cache = StaticCache.open(args.output)
    result = {
        "output": args.output,
        "inputs": len(items),
        "n_tokens": stats["n_tokens"],
        "n_keys": cache.n_keys,
        "n_followers": cache.n_followers,
        "file_bytes": cache.file_size,
        "runs_spilled": stats["n_runs"],
        "seconds": round(elapsed, 3),
        "tokenize_seconds": round(t_tokenize, 3),
        "tokens_per_second": round(stats["n_tokens"] / max(elapsed, 1e-9)),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if args.json:
        print(json.dumps(result))
    elif not args.quiet:
        print(f"wrote {args.output}: {cache.n_keys:,} keys, {cache.n_followers:,} followers from "
              f"{stats['n_tokens']:,} tokens in {elapsed:.2f} s (tokenizing {t_tokenize:.2f} s); "
              f"{cache.file_size / 1e6:.1f} MB; {stats['n_runs']} runs spilled; peak RSS {result['peak_rss_mb']:.0f} MB")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    tokenizer = _load_tokenizer(args.tokenizer)
    static = None
    t_load_ms = 0.0
    if args.static:
        t0 = time.perf_counter()
        static = StaticCache.open(args.static)
        t_load_ms = (time.perf_counter() - t0) * 1e3
        if tokenizer is not None and static.fingerprint not in (ZERO_FINGERPRINT, tokenizer.fingerprint):
            raise TokenizerMismatchError(
                f"{args.static} was built with tokenizer fingerprint {static.fingerprint.hex()[:16]}..., "
                f"not {tokenizer.spec} ({tokenizer.fingerprint.hex()[:16]}...)"
            )
    vocab = static.vocab_size if static is not None else tokenizer.vocab_size if tokenizer is not None else None
    tokens = corpus.load_tokens(args.input, tokenizer)
    if vocab is not None and len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):
        raise InvalidArgumentError(f"{args.input} holds token ids outside the vocabulary [0, {vocab})")
    dynamic = CountTable()
    if args.dynamic:
        load_llama_counts(args.dynamic, vocab or (1 << 24), dynamic)
    r = replay(tokens, args.n_ctx, args.n_draft, args.ngram_min, args.ngram_max, static, dynamic,
               args.dump_drafts is not None)
    if args.dump_drafts is not None:
        flat = r["drafts"].tolist()
        with open(args.dump_drafts, "w") as f:
            line: list[str] = []
            for t in flat:
                if t == -1:
                    f.write(" ".join(line) + "\n")
                    line = []
                else:
                    line.append(str(t))
    drafted = r["n_drafted"]
    out = {
        "n_input": len(tokens),
        "n_ctx": args.n_ctx,
        "n_draft": args.n_draft,
        "n_draft_calls": r["n_draft_calls"],
        "n_drafted": drafted,
        "n_accept": r["n_accept"],
        "accept_pct": round(100.0 * r["n_accept"] / drafted, 3) if drafted else 0.0,
        "t_load_ms": round(t_load_ms, 4),
        "t_draft_ms": round(r["t_draft_ns"] / 1e6, 3),
        "us_per_drafted": round(r["t_draft_ns"] / 1e3 / drafted, 4) if drafted else None,
        "us_per_drafted_draft_only": round(r["t_draft_only_ns"] / 1e3 / drafted, 4) if drafted else None,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>26}: {value}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cache = StaticCache.open(args.file)
    t_open_ms = (time.perf_counter() - t0) * 1e3
    if args.verify:
        cache.verify()
    hist = cache.follower_histogram()
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
        "open_ms": round(t_open_ms, 4),
        "verified": bool(args.verify),
        "sections": cache.sections,
        "followers_per_key": {(f"{1 << b}" if b == 0 else f"{1 << b}-{(1 << (b + 1)) - 1}"): n for b, n in enumerate(hist)},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key not in ("sections", "followers_per_key"):
            print(f"{key:>15}: {value}")
    for s in info["sections"]:
        print(f"{'section':>15}: {s['name']:<10} offset {s['offset']:>14,}  length {s['length']:>14,}")
    print(f"{'followers/key':>15}:")
    for label, n in info["followers_per_key"].items():
        print(f"{label:>15}  {n:>12,} keys")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    caches = [StaticCache.open(p) for p in args.inputs]
    first = caches[0]
    for c in caches[1:]:
        for field in ("fingerprint", "ngram_size", "vocab_size"):
            a, b = getattr(first, field), getattr(c, field)
            if a != b:
                shown = (a.hex(), b.hex()) if isinstance(a, bytes) else (a, b)
                error = TokenizerMismatchError if field != "ngram_size" else InvalidArgumentError
                raise error(f"cannot merge: {first.path} has {field} {shown[0]}, {c.path} has {shown[1]}")
    generation = args.generation if args.generation is not None else max(c.generation for c in caches)
    builder = StaticBuilder(args.output, first.vocab_size, first.ngram_size, fingerprint=first.fingerprint,
                            generation=generation, memory_budget=corpus.parse_size(args.memory_budget))
    for c in caches:
        builder.add_static(c)
    stats = builder.finish()
    out = StaticCache.open(args.output)
    if not args.quiet:
        print(f"wrote {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers "
              f"(merged {len(caches)} files, {stats['n_pairs']:,} counted pairs), generation {generation}")
    return 0


def cmd_import_llama(args: argparse.Namespace) -> int:
    tokenizer = _load_tokenizer(args.tokenizer)
    vocab, fingerprint = _vocab_and_fingerprint(args, tokenizer)
    builder = StaticBuilder(args.output, vocab, args.ngram_size, fingerprint=fingerprint, generation=args.generation,
                            memory_budget=corpus.parse_size(args.memory_budget))
    import_llama(args.input, builder)
    builder.finish()
    out = StaticCache.open(args.output)
    if not args.quiet:
        print(f"imported {args.input} -> {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers")
    return 0


def cmd_export_llama(args: argparse.Namespace) -> int:
    cache = StaticCache.open(args.input)
    export_llama(cache, args.output)
    if not args.quiet:
        print(f"exported {args.input} -> {args.output} (llama.cpp format, {Path(args.output).stat().st_size:,} bytes)")
    return 0


def _tokenizer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="a Hugging Face tokenizer.json path, or tiktoken:<encoding>; gives the vocabulary size and "
                        "the fingerprint recorded in the file")
    p.add_argument("--vocab-size", type=int, help="vocabulary size, for token inputs without --tokenizer")
    p.add_argument("--fingerprint", metavar="HEX", help="tokenizer fingerprint (64 hex digits), with --vocab-size")


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

    build = sub.add_parser(
        "build",
        help="build a static cache from text or token files (llama-lookup-create at corpus scale)",
        description="Counts the (n-gram, follower) pairs of every input and writes a static cache. INPUT is a "
        "text file or folder (UTF-8, tokenized with --tokenizer), or a token file: .bin/.tokens (raw little-endian "
        "int32) or .npy (1-D int32; a sibling NAME.offsets.npy of int64 stream starts splits it into streams). "
        "N-grams never span two files or streams. Memory stays within --memory-budget: beyond it sorted runs go "
        "to scratch files beside the output (or --scratch-dir) and are merged. The file is written atomically.",
    )
    build.add_argument("inputs", nargs="+", metavar="INPUT", help="text or token files, or folders of them")
    build.add_argument("-o", "--output", required=True, help="the static cache to write")
    _tokenizer_options(build)
    build.add_argument("--ngram-size", type=int, default=2, help="tokens per key, 1..4 (default 2, as llama.cpp)")
    build.add_argument("--memory-budget", default="1GiB", help="memory for counting, e.g. 256MiB (default 1GiB)")
    build.add_argument("--generation", type=int, default=0, help="generation number recorded in the file (default 0)")
    build.add_argument("--scratch-dir", help="where sorted runs go (default: beside the output)")
    build.add_argument("--threads", type=int, default=0, help="sorting threads (default: all cores)")
    build.add_argument("--json", action="store_true", help="print one JSON object of figures")
    build.add_argument("--quiet", action="store_true", help="no progress display and no summary")
    build.set_defaults(func=cmd_build)

    stats = sub.add_parser(
        "stats",
        help="replay a test set through the drafter as llama-lookup-stats does",
        description="Cuts TEST into chunks of --n-ctx tokens (a last partial chunk is skipped; like llama-lookup-stats, "
        "so is a last full chunk that ends exactly at the end of TEST) and simulates "
        "generation: draft up to --n-draft tokens, accept the prefix that matches the text, append the true next "
        "token, update the context table; after each chunk the context table is merged into the dynamic one. "
        "Reports drafted and accepted tokens and the drafting cost.",
    )
    stats.add_argument("--input", required=True, metavar="TEST", help="text (needs --tokenizer) or a token file")
    stats.add_argument("--static", metavar="FILE", help="a static cache")
    stats.add_argument("--dynamic", metavar="FILE", help="a dynamic cache in llama.cpp's format (llama-lookup -lcd)")
    stats.add_argument("--n-ctx", type=int, default=4096, help="chunk size in tokens (default 4096)")
    stats.add_argument("--n-draft", type=int, default=8, help="tokens drafted per call at most (default 8)")
    stats.add_argument("--ngram-min", type=int, default=1, help="shortest context/dynamic n-gram (default 1)")
    stats.add_argument("--ngram-max", type=int, default=4, help="longest context/dynamic n-gram (default 4)")
    stats.add_argument("--tokenizer", metavar="SPEC", help="tokenizes a text TEST; must match the static cache")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.add_argument("--dump-drafts", metavar="PATH",
                       help="write one line per draft call: the drafted tokens in decimal (empty when none)")
    stats.set_defaults(func=cmd_stats)

    inspect = sub.add_parser(
        "inspect",
        help="print a static cache's header, counts, sections and followers per key",
        description="Prints a static cache file's header fields, counts, section table and the distribution of "
        "followers per key. Opening checks the header and section table only; --verify also checks every "
        "section checksum and structural invariant.",
    )
    inspect.add_argument("file", help="a static cache file")
    inspect.add_argument("--verify", action="store_true", help="check every checksum and invariant (reads the whole file)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=cmd_inspect)

    merge = sub.add_parser(
        "merge",
        help="sum the counts of static caches into one",
        description="Sums the counts of static caches built with the same tokenizer (fingerprint) and n-gram size; "
        "refuses others, naming the difference.",
    )
    merge.add_argument("inputs", nargs="+", metavar="FILE", help="static caches to merge")
    merge.add_argument("-o", "--output", required=True, help="the merged static cache to write")
    merge.add_argument("--generation", type=int, help="generation of the output (default: the largest input's)")
    merge.add_argument("--memory-budget", default="1GiB", help="memory for merging (default 1GiB)")
    merge.add_argument("--quiet", action="store_true", help="no summary")
    merge.set_defaults(func=cmd_merge)

    imp = sub.add_parser(
        "import-llama",
        help="convert a llama.cpp cache file (llama-lookup-create) into a static cache",
        description="Reads llama.cpp's n-gram cache format (records of a 4-token n-gram, a follower count and "
        "(token, count) pairs) and writes a static cache. Every key must have --ngram-size tokens; malformed "
        "records are refused with their byte offset.",
    )
    imp.add_argument("input", help="a llama.cpp cache file")
    imp.add_argument("-o", "--output", required=True, help="the static cache to write")
    _tokenizer_options(imp)
    imp.add_argument("--ngram-size", type=int, default=2, help="tokens per key (default 2)")
    imp.add_argument("--generation", type=int, default=0, help="generation number recorded (default 0)")
    imp.add_argument("--memory-budget", default="1GiB", help="memory for sorting (default 1GiB)")
    imp.add_argument("--quiet", action="store_true", help="no summary")
    imp.set_defaults(func=cmd_import_llama)

    exp = sub.add_parser(
        "export-llama",
        help="write a static cache in llama.cpp's format (loads with llama-lookup -lcs)",
        description="Writes every key of a static cache as llama.cpp n-gram cache records.",
    )
    exp.add_argument("input", help="a static cache")
    exp.add_argument("-o", "--output", required=True, help="the llama.cpp cache file to write")
    exp.add_argument("--quiet", action="store_true", help="no summary")
    exp.set_defaults(func=cmd_export_llama)
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
