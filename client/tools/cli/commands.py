"""The file commands (build, stats, inspect, merge, import-llama, export-llama, export-sglang): each checks, calls the library, prints."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path

import numpy as np

from ngramcache.client._core import (
    MAX_VOCAB,
    UNTAGGED,
    CountTable,
    StaticBuilder,
    StaticCache,
    export_llama,
    import_llama,
    load_llama_counts,
    replay,
)
from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.build import IndexBudgetWarning, build_static, out_of_vocabulary, with_path
from ngramcache.client.kernel.errors import CacheFormatError, InvalidArgumentError, TokenizerMismatchError
from ngramcache.client.kernel.files import write_lines_atomic
from ngramcache.client.kernel.progress import Progress
from ngramcache.client.tools.cli.arguments import load_tokenizer_spec, show_fingerprint, vocab_and_fingerprint
from ngramcache.client.tools.cli.guards import (
    check_folder,
    check_input_file,
    check_output,
    open_static,
    reading_static,
)

STATIC_MAGIC = b"NGCSTAT\0"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux

def cmd_build(args: argparse.Namespace) -> int:
    if args.index_depth is not None and not args.corpus_index:
        raise InvalidArgumentError("--index-depth sets the depth of the corpus index: add --corpus-index")
    items = corpus.collect_inputs(args.inputs, args.include, args.exclude)
    check_output(args.output, args.inputs, suffix=".ngc")
    if args.scratch_dir is not None:
        check_folder(args.scratch_dir, "--scratch-dir")
    tokenizer = load_tokenizer_spec(args.tokenizer)
    if tokenizer is None and any(i.kind == "text" for i in items):
        raise InvalidArgumentError("text inputs need --tokenizer SPEC (a tokenizer.json path or tiktoken:<encoding>)")
    vocab, fingerprint, source = vocab_and_fingerprint(args, tokenizer)

    def writing() -> None:
        if not args.quiet:
            print(("sorting the corpus index, " if args.corpus_index else "") + "merging sorted runs and writing the "
                  "file...", file=sys.stderr)

    with Progress("build", sum(i.size for i in items), "B", quiet=args.quiet) as progress, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexBudgetWarning)  # said below, in the CLI's words
        built = build_static(items, args.output, vocab_size=vocab, fingerprint=fingerprint, tokenizer=tokenizer,
                             ngram_size=args.ngram_size, generation=args.generation, memory_budget=args.memory_budget,
                             scratch_dir=args.scratch_dir, threads=args.threads, corpus_index=args.corpus_index,
                             index_depth=args.index_depth or 32, vocabulary_source=source, progress=progress.update,
                             on_writing=writing)
    result = {
        "output": args.output,
        "inputs": built.n_inputs,
        "skipped": built.n_skipped,
        "n_tokens": built.n_tokens,
        "n_keys": built.n_keys,
        "n_followers": built.n_followers,
        "file_bytes": built.file_bytes,
        "runs_spilled": built.n_runs,
        "n_indexed": built.n_indexed,
        "n_not_indexed": built.n_not_indexed,
        "seconds": round(built.seconds, 3),
        "tokenize_seconds": round(built.tokenize_seconds, 3),
        "tokens_per_second": round(built.n_tokens / max(built.seconds, 1e-9)),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if args.json:
        print(json.dumps(result))
    elif not args.quiet:
        print(f"wrote {args.output}: {built.n_keys:,} keys, {built.n_followers:,} followers from "
              f"{built.n_tokens:,} tokens in {built.seconds:.2f} s (tokenizing {built.tokenize_seconds:.2f} s); "
              f"{built.file_bytes / 1e6:.1f} MB; {built.n_runs} runs spilled; peak RSS {result['peak_rss_mb']:.0f} MB")
        if args.corpus_index:
            print(f"corpus index: {built.n_indexed:,} tokens, matches up to {built.index_depth} tokens (format "
                  f"version 2; drafters use it with mode 'match')")
    note = corpus.Skipped(built.n_skipped, built.skipped_example).note()
    if note:
        print(note, file=sys.stderr)
    if args.corpus_index and built.n_not_indexed and not args.quiet:
        print(f"warning: {built.n_not_indexed:,} tokens past the index's half of --memory-budget were counted but "
              f"not indexed (32 bytes a token while sorting); raise --memory-budget to index them all", file=sys.stderr)
    return 0


def _draft_lines(drafts: np.ndarray) -> Iterator[str]:
    """replay()'s drafts (each call's tokens followed by -1) as one line per call."""
    line: list[str] = []
    for t in drafts.tolist():
        if t == -1:
            yield " ".join(line) + "\n"
            line = []
        else:
            line.append(str(t))


def _looks_static(path: str) -> bool:
    with suppress(OSError), open(path, "rb") as f:
        return f.read(len(STATIC_MAGIC)) == STATIC_MAGIC
    return False


def cmd_stats(args: argparse.Namespace) -> int:
    if args.ngram_min > args.ngram_max:
        raise InvalidArgumentError(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}")
    if args.dynamic is not None:
        check_input_file(args.dynamic, "--dynamic")
        if _looks_static(args.dynamic):
            raise InvalidArgumentError(f"--dynamic {args.dynamic} is a static cache: pass it as --static "
                                       "(--dynamic takes llama.cpp's format)")
    if args.static is not None:
        check_input_file(args.static, "--static")
    if args.dump_drafts is not None:
        check_output(args.dump_drafts, [p for p in (args.input, args.static, args.dynamic) if p], flag="--dump-drafts")
    tokenizer = load_tokenizer_spec(args.tokenizer)
    static = None
    t_load_ms = 0.0
    if args.static:
        t0 = time.perf_counter()
        static = open_static(args.static, "--static")
        t_load_ms = (time.perf_counter() - t0) * 1e3
        if tokenizer is not None and static.fingerprint not in (UNTAGGED, tokenizer.fingerprint):
            raise TokenizerMismatchError(
                f"{args.static} was built with tokenizer fingerprint {static.fingerprint.hex()[:16]}..., "
                f"not {tokenizer.spec} ({tokenizer.fingerprint.hex()[:16]}...)"
            )
    tokens = corpus.load_tokens(args.input, tokenizer)
    if len(tokens) <= args.n_ctx:
        raise InvalidArgumentError(
            f"{args.input} holds {len(tokens):,} tokens, not more than --n-ctx {args.n_ctx}: the replay needs at "
            f"least one whole chunk of --n-ctx tokens and one more token; pass a smaller --n-ctx"
        )
    if static is not None:
        vocab, source = static.vocab_size, f"--static {args.static}"
    elif tokenizer is not None:
        vocab, source = tokenizer.vocab_size, f"--tokenizer {tokenizer.spec}"
    else:
        vocab, source = MAX_VOCAB, "any tokenizer"
    bad = out_of_vocabulary(args.input, tokens, 0, vocab, source)
    if bad is not None:
        raise bad
    dynamic = CountTable()
    if args.dynamic:
        try:
            load_llama_counts(args.dynamic, vocab, dynamic)
        except (CacheFormatError, InvalidArgumentError) as e:
            raise type(e)(f"--dynamic {with_path(args.dynamic, str(e))} (a llama.cpp cache file, as llama-lookup -lcd "
                          "writes, for the same tokenizer)") from None
    if args.tree_budget and args.mode != "match":
        raise InvalidArgumentError("--tree-budget needs --mode match (the compatible mode drafts a line)")
    if args.mode == "match" and static is not None and static.index_depth == 0:
        print(f"note: {args.static} has no corpus index (build it with --corpus-index); the match mode uses its "
              "2-gram counts only", file=sys.stderr)
    reading: AbstractContextManager[None] = reading_static(args.static) if args.static else nullcontext()
    with reading:
        r = replay(tokens, args.n_ctx, args.n_draft, args.ngram_min, args.ngram_max, static, dynamic,
                   args.dump_drafts is not None, mode=args.mode, tree_budget=args.tree_budget)
    if args.dump_drafts is not None:
        write_lines_atomic(args.dump_drafts, _draft_lines(r["drafts"]))
    drafted = r["n_drafted"]
    steps = r["n_draft_calls"]
    out = {
        "mode": args.mode,
        "tree_budget": args.tree_budget,
        "n_input": len(tokens),
        "n_ctx": args.n_ctx,
        "n_draft": args.n_draft,
        "n_draft_calls": r["n_draft_calls"],
        "n_drafted": drafted,
        "n_accept": r["n_accept"],
        "accept_pct": round(100.0 * r["n_accept"] / drafted, 3) if drafted else 0.0,
        "tokens_per_step": round(r["n_chunks"] * (args.n_ctx - 1) / steps, 4) if steps else 0.0,
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
    check_input_file(args.file, "input")
    t0 = time.perf_counter()
    cache = StaticCache.open(args.file)
    t_open_ms = (time.perf_counter() - t0) * 1e3
    if args.verify:
        cache.verify()
    hist = cache.follower_histogram()
    # A file whose counts came without their token count (an import from llama.cpp's format, or
    # a merge of such files) records 0 tokens for a non-empty table: the count is unknown.
    n_tokens = None if cache.n_tokens == 0 and cache.n_keys > 0 else cache.n_tokens
    sections = cache.sections
    followers_per_key = {(f"{1 << b}" if b == 0 else f"{1 << b}-{(1 << (b + 1)) - 1}"): n for b, n in enumerate(hist)}
    info: dict[str, object] = {
        "path": cache.path,
        "format_version": cache.format_version,
        "ngram_size": cache.ngram_size,
        "vocab_size": cache.vocab_size,
        "fingerprint": show_fingerprint(cache.fingerprint),
        "generation": cache.generation,
        "n_keys": cache.n_keys,
        "n_followers": cache.n_followers,
        "n_tokens": n_tokens,
        "n_overflow": cache.n_overflow,
        "index_depth": cache.index_depth,
        "n_indexed": cache.n_indexed,
        "file_size": cache.file_size,
        "open_ms": round(t_open_ms, 4),
        "verified": bool(args.verify),
        "sections": sections,
        "followers_per_key": followers_per_key,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key not in ("sections", "followers_per_key"):
            print(f"{key:>15}: {'unknown' if value is None else value}")
    for s in sections:
        print(f"{'section':>15}: {s['name']:<10} offset {s['offset']:>14,}  length {s['length']:>14,}")
    print(f"{'followers/key':>15}:")
    for label, n in followers_per_key.items():
        print(f"{label:>15}  {n:>12,} keys")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    for p in args.inputs:
        check_input_file(p, "input")
    check_output(args.output, args.inputs)
    caches = [open_static(p, "input") for p in args.inputs]
    first = caches[0]
    for c in caches[1:]:
        for field in ("fingerprint", "ngram_size", "vocab_size"):
            a, b = getattr(first, field), getattr(c, field)
            if a != b:
                shown = (a.hex(), b.hex()) if isinstance(a, bytes) else (a, b)
                error = TokenizerMismatchError if field != "ngram_size" else InvalidArgumentError
                raise error(f"cannot merge: {first.path} has {field} {shown[0]}, {c.path} has {shown[1]}")
    for c in caches:  # a damaged input would be merged into a plausible-looking output
        with reading_static(c.path):
            c.verify()
    generation = args.generation if args.generation is not None else max(c.generation for c in caches)
    builder = StaticBuilder(args.output, first.vocab_size, first.ngram_size, fingerprint=first.fingerprint,
                            generation=generation, memory_budget=args.memory_budget)
    for c in caches:  # add_static also adds the input's n_tokens to the output's
        with reading_static(c.path, (CacheFormatError, InvalidArgumentError)):
            builder.add_static(c)
    stats = builder.finish()
    out = StaticCache.open(args.output)
    unknown = [c.path for c in caches if c.n_tokens == 0 and c.n_keys > 0]
    if args.json:
        print(json.dumps({"output": args.output, "inputs": [c.path for c in caches], "n_keys": out.n_keys,
                          "n_followers": out.n_followers, "n_tokens": None if unknown else out.n_tokens,
                          "n_pairs": stats["n_pairs"], "generation": generation, "file_bytes": out.file_size}))
    elif not args.quiet:
        tokens = f"{out.n_tokens:,} tokens" if out.n_tokens or not out.n_keys else "an unknown number of tokens"
        print(f"wrote {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers from {tokens} "
              f"(merged {len(caches)} files, {stats['n_pairs']:,} counted pairs), generation {generation}")
        if unknown:  # add_static makes the sum unknown (0) then: a partial sum would mislead
            print(f"note: the token count of {', '.join(unknown)} is unknown (imported), so the merged file's is too",
                  file=sys.stderr)
    return 0


def cmd_import_llama(args: argparse.Namespace) -> int:
    check_input_file(args.input, "input")
    check_output(args.output, [args.input])
    if os.path.getsize(args.input) == 0:
        raise InvalidArgumentError(f"{args.input} is empty: a llama.cpp cache with no n-grams; {args.output} was not written")
    tokenizer = load_tokenizer_spec(args.tokenizer)
    vocab, fingerprint, _ = vocab_and_fingerprint(args, tokenizer)
    # llama.cpp's format does not say how many tokens were counted: the file records 0 (unknown).
    builder = StaticBuilder(args.output, vocab, args.ngram_size, fingerprint=fingerprint, generation=args.generation,
                            memory_budget=args.memory_budget)
    import_llama(args.input, builder)
    builder.finish()
    out = StaticCache.open(args.output)
    if args.json:
        print(json.dumps({"input": args.input, "output": args.output, "n_keys": out.n_keys,
                          "n_followers": out.n_followers, "n_tokens": None, "file_bytes": out.file_size}))
    elif not args.quiet:
        print(f"imported {args.input} -> {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers")
    return 0


def cmd_export_llama(args: argparse.Namespace) -> int:
    check_input_file(args.input, "input")
    check_output(args.output, [args.input])
    cache = open_static(args.input, "input")
    with reading_static(args.input):
        export_llama(cache, args.output)
    if args.json:
        print(json.dumps({"input": args.input, "output": args.output, "format": "llama.cpp", "n_keys": cache.n_keys,
                          "file_bytes": Path(args.output).stat().st_size}))
    elif not args.quiet:
        print(f"exported {args.input} -> {args.output} (llama.cpp format, {Path(args.output).stat().st_size:,} bytes)")
    return 0


def cmd_export_sglang(args: argparse.Namespace) -> int:
    from ngramcache.client.kernel.sglang_corpus import SGLANG_DEFAULT_MAX_TOKENS, export_sglang

    check_input_file(args.input, "input")
    check_output(args.output, [args.input])
    cache = open_static(args.input, "input")
    tokenizer = load_tokenizer_spec(args.tokenizer)
    assert tokenizer is not None  # --tokenizer is required
    with reading_static(args.input):
        written = export_sglang(cache, tokenizer, args.output)
    if args.json:
        print(json.dumps({"input": args.input, "output": args.output, "format": "sglang", "documents": written.documents,
                          "tokens": written.tokens, "file_bytes": Path(args.output).stat().st_size}))
    elif not args.quiet:
        print(f"exported {args.input} -> {args.output} (SGLang external n-gram corpus: {written.documents:,} documents, "
              f"{written.tokens:,} tokens, {Path(args.output).stat().st_size:,} bytes)")
    if not args.quiet and written.tokens > SGLANG_DEFAULT_MAX_TOKENS:
        print(f"note: SGLang loads at most {SGLANG_DEFAULT_MAX_TOKENS:,} corpus tokens by default: give it "
              f"--speculative-ngram-external-corpus-max-tokens {written.tokens + written.documents}", file=sys.stderr)
    return 0
