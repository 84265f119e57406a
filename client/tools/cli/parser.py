"""The argument parser of `ngramcache`: every command, its flags and their help."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Iterable

from ngramcache.client._core import MAX_DRAFT, NGRAM_MAX
from ngramcache.client.tools.cli.arguments import (
    MAX_GENERATION,
    budget_option,
    file_filter_options,
    int_in,
    quiet_option,
    tokenizer_options,
)
from ngramcache.client.tools.cli.commands import (
    cmd_build,
    cmd_export_llama,
    cmd_export_sglang,
    cmd_import_llama,
    cmd_inspect,
    cmd_merge,
    cmd_stats,
)
from ngramcache.client.tools.cli.demo import cmd_demo
from ngramcache.client.tools.cli.llama import add_llama_follow
from ngramcache.client.tools.cli.sglang import add_sglang_commands
from ngramcache.client.tools.cli.tokens import add_token_commands

# A hook that adds subcommands: the service side adds `serve` (ngramcache.cache_service.cli)
# without the client importing it.
CommandHook = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), or 0+unknown when run from a tree never installed."""
    try:
        return importlib.metadata.version("ngramcache")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def json_option(p: argparse.ArgumentParser, what: str) -> None:
    """--json: the result as one JSON object on stdout (notes and errors stay on stderr)."""
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as one JSON object on stdout instead of the text (notes and errors go to stderr)")


def build_parser(extra_commands: Iterable[CommandHook] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngramcache",
        description="A shared n-gram cache for speculative decoding (prompt lookup / llama.cpp's ngram cache).",
        epilog="Exit status: 0 on success, 2 on a user error, 130 when interrupted (Ctrl-C), 1 on an "
        "unexpected error. Outputs are written atomically and never replace an input.",
    )
    parser.add_argument("--version", action="version", version=f"ngramcache {package_version()}",
                        help="print the version (ngramcache X.Y.Z) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generation = int_in(0, MAX_GENERATION)
    ngram_size = int_in(1, NGRAM_MAX)

    demo = sub.add_parser(
        "demo",
        help="build a static cache from a real corpus and draft from it",
        description="Builds a static cache from CPython's standard library (byte tokens), opens it, and "
        "replays held-out files through the drafter as llama-lookup-stats does, with and without the cache.",
    )
    demo.add_argument("--workdir", metavar="DIR",
                      help="folder to write the cache (stdlib.ngc) and the demo's other files in, created if "
                           "missing and kept (default: a new temporary folder, removed at the end, also on Ctrl-C)")
    demo.add_argument("--n-ctx", type=int_in(2), default=4096, metavar="N",
                      help="replay chunk size in tokens (the workers' request length), at least 2 (default 4096)")
    demo.add_argument("--n-draft", type=int_in(1, MAX_DRAFT), default=8, metavar="N",
                      help=f"tokens drafted per call at most, 1..{MAX_DRAFT} (default 8)")
    demo.add_argument("--test-files", type=int_in(1), default=20, metavar="N",
                      help="held-out files replayed, at least 1; served, worker A replays the first two thirds "
                           "of them and B the last two thirds (default 20)")
    demo.set_defaults(func=cmd_demo)

    build = sub.add_parser(
        "build",
        help="build a static cache from text or token files (llama-lookup-create at corpus scale)",
        description="Counts the (n-gram, follower) pairs of every input and writes a static cache. INPUT is a "
        "text file or folder (UTF-8, tokenized with --tokenizer), or a token file: .bin/.tokens (raw little-endian "
        "int32) or .npy (1-D int32; a sibling NAME.offsets.npy of int64 stream starts splits it into streams). "
        "N-grams never span two files or streams. --memory-budget bounds the counting buffers (and the corpus index "
        "while it is sorted): beyond it sorted runs go to scratch files beside the output (or --scratch-dir) and are "
        "merged. The process needs more besides: about 50 MB for Python and the core, the tokenizer's tables (about "
        "70 MB for tiktoken:qwen) and the text being tokenized (a batch of 1/32 of the budget, 1 to 8 MiB, takes "
        "about 10 times its size while it is tokenized); peak RSS on 15 MB of Python source with tiktoken:qwen: "
        "149 MB at 16MiB, 215 MB at 1GiB (--json prints it). The file is written atomically; "
        "the output may not be an input or lie inside an input folder.",
    )
    build.add_argument("inputs", nargs="+", metavar="INPUT", help="text or token files, or folders of them (searched "
                       "recursively; hidden entries and __pycache__ skipped)")
    file_filter_options(build)
    build.add_argument("-o", "--output", required=True, metavar="OUT",
                       help="the static cache to write (replaced atomically if it exists)")
    tokenizer_options(build)
    build.add_argument("--ngram-size", type=ngram_size, default=2, metavar="K",
                       help=f"tokens per key, 1..{NGRAM_MAX} (default 2, as llama.cpp)")
    budget_option(build, "counting")
    build.add_argument("--generation", type=generation, default=1, metavar="N",
                       help="generation number recorded in the file, a whole number >= 0 (default 1: a new "
                            "namespace's first); `ngramcache publish` takes it only above the namespace's latest "
                            "(`ngramcache namespace list` shows it), and never 0")
    build.add_argument("--scratch-dir", metavar="DIR",
                       help="an existing folder for the sorted runs that spill beyond --memory-budget "
                            "(default: the output's folder)")
    build.add_argument("--threads", type=int_in(0, 1024), default=0, metavar="N",
                       help="sorting threads, 0 for all cores (default 0)")
    build.add_argument("--corpus-index", action="store_true",
                       help="also index the corpus for the match mode's longest matches (format version 2; about 8 "
                            "bytes per token in the file). The index takes half of --memory-budget, 32 bytes a "
                            "token while it is sorted; tokens past that are counted but not indexed (a warning says "
                            "how many)")
    build.add_argument("--index-depth", type=int_in(1, 64), default=None, metavar="D",
                       help="with --corpus-index: the longest match the index finds, 1..64 tokens (default 32)")
    build.add_argument("--json", action="store_true",
                       help="print one JSON object of figures (tokens, keys, bytes, seconds, peak RSS) instead of "
                            "the summary")
    quiet_option(build)
    build.set_defaults(func=cmd_build)

    stats = sub.add_parser(
        "stats",
        help="replay a test set through the drafter as llama-lookup-stats does",
        description="Cuts TEST into chunks of --n-ctx tokens (a last partial chunk is skipped; like llama-lookup-stats, "
        "so is a last full chunk that ends exactly at the end of TEST, so TEST needs more than --n-ctx tokens) and "
        "simulates generation: draft up to --n-draft tokens, accept the prefix that matches the text, append the true "
        "next token, update the context table; after each chunk the context table is merged into the dynamic one. "
        "Reports drafted and accepted tokens and the drafting cost.",
    )
    stats.add_argument("--input", required=True, metavar="TEST",
                       help="the test set: text (needs --tokenizer) or a token file (.bin/.tokens/.npy), or a folder")
    stats.add_argument("--static", metavar="FILE", help="a static cache to draft from (default: none)")
    stats.add_argument("--dynamic", metavar="FILE",
                       help="a dynamic cache in llama.cpp's format (llama-lookup -lcd) loaded first (default: none, "
                            "the dynamic table starts empty)")
    stats.add_argument("--n-ctx", type=int_in(2), default=4096, metavar="N",
                       help="chunk size in tokens, at least 2 (default 4096)")
    stats.add_argument("--n-draft", type=int_in(1, MAX_DRAFT), default=8, metavar="N",
                       help=f"tokens drafted per call at most, 1..{MAX_DRAFT} (default 8)")
    stats.add_argument("--ngram-min", type=int_in(1, NGRAM_MAX), default=1, metavar="N",
                       help=f"shortest context/dynamic n-gram in tokens, 1..{NGRAM_MAX} (default 1)")
    stats.add_argument("--ngram-max", type=int_in(1, NGRAM_MAX), default=4, metavar="N",
                       help=f"longest context/dynamic n-gram in tokens, 1..{NGRAM_MAX} (default 4)")
    stats.add_argument("--tokenizer", metavar="SPEC",
                       help="tokenizes a text TEST (a tokenizer.json path or tiktoken:<encoding>); must match the "
                            "static cache's fingerprint")
    stats.add_argument("--mode", choices=("compatible", "match"), default="compatible",
                       help="compatible: llama.cpp's drafts, token for token (default); match: longest matches over "
                            "the sequence, earlier chunks and the static file's corpus index, with the count tables "
                            "competing")
    stats.add_argument("--tree-budget", type=int_in(0, MAX_DRAFT), default=0, metavar="N",
                       help="with --mode match: draft trees of at most N nodes and accept each tree's longest path "
                            "that matches the text (n_drafted counts nodes); 0 (default) drafts a line")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of one figure per line")
    stats.add_argument("--dump-drafts", metavar="PATH",
                       help="also write one line per draft call: the drafted tokens in decimal (empty when none); "
                            "written atomically")
    stats.set_defaults(func=cmd_stats)

    inspect = sub.add_parser(
        "inspect",
        help="print a static cache's header, counts, sections and followers per key",
        description="Prints a static cache file's header fields, counts, section table and the distribution of "
        "followers per key. Opening checks the header and section table only; --verify also checks every "
        "section checksum and structural invariant. The fingerprint shows as 'untagged' when it is all zeros; "
        "n_tokens as 'unknown' (null in JSON) when the counts came without it (imported from llama.cpp's format).",
    )
    inspect.add_argument("file", metavar="FILE", help="a static cache file")
    inspect.add_argument("--verify", action="store_true", help="check every checksum and invariant (reads the whole file)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    inspect.set_defaults(func=cmd_inspect)

    merge = sub.add_parser(
        "merge",
        help="sum the counts of static caches into one",
        description="Sums the counts of static caches built with the same tokenizer (fingerprint), vocabulary and "
        "n-gram size; refuses others, naming the difference. Every input is verified first (as inspect --verify). "
        "The output may not be one of the inputs.",
    )
    merge.add_argument("inputs", nargs="+", metavar="FILE", help="static caches to merge")
    merge.add_argument("-o", "--output", required=True, metavar="OUT",
                       help="the merged static cache to write (replaced atomically if it exists)")
    merge.add_argument("--generation", type=generation, metavar="N",
                       help="generation of the output, a whole number >= 0 (default: the largest input's)")
    budget_option(merge, "merging")
    json_option(merge, "the output's figures (keys, followers, tokens, bytes, generation)")
    quiet_option(merge)
    merge.set_defaults(func=cmd_merge)

    imp = sub.add_parser(
        "import-llama",
        help="convert a llama.cpp cache file (llama-lookup-create) into a static cache",
        description="Reads llama.cpp's n-gram cache format (records of a 4-token n-gram, a follower count and "
        "(token, count) pairs) and writes a static cache. Every key must have --ngram-size tokens; malformed "
        "records are refused with their byte offset. llama.cpp's format does not record how many tokens were "
        "counted, so the output's n_tokens is unknown.",
    )
    imp.add_argument("input", metavar="IN", help="a llama.cpp cache file")
    imp.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="the static cache to write (replaced atomically if it exists)")
    tokenizer_options(imp)
    imp.add_argument("--ngram-size", type=ngram_size, default=2, metavar="K",
                     help=f"tokens per key, 1..{NGRAM_MAX} (default 2)")
    imp.add_argument("--generation", type=generation, default=0, metavar="N",
                     help="generation number recorded, a whole number >= 0 (default 0)")
    budget_option(imp, "sorting")
    json_option(imp, "the output's figures (keys, followers, bytes)")
    quiet_option(imp)
    imp.set_defaults(func=cmd_import_llama)

    exp = sub.add_parser(
        "export-llama",
        help="write a static cache in llama.cpp's format (loads with llama-lookup -lcs)",
        description="Writes every key of a static cache as llama.cpp n-gram cache records.",
    )
    exp.add_argument("input", metavar="IN", help="the static cache to export")
    exp.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="the llama.cpp cache file to write (replaced atomically if it exists)")
    json_option(exp, "the figures (keys written, bytes)")
    quiet_option(exp)
    exp.set_defaults(func=cmd_export_llama)

    sgl = sub.add_parser(
        "export-sglang",
        help="write a generation's corpus as SGLang's external n-gram corpus (JSONL of strings)",
        description="Decodes each document of a static generation's corpus index (built with --corpus-index) "
                    "into one JSON string a line: the file SGLang's --speculative-ngram-external-corpus-path loads.",
    )
    sgl.add_argument("input", metavar="IN", help="the static generation to export (with a corpus index)")
    sgl.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="the JSONL file to write (replaced atomically if it exists)")
    sgl.add_argument("--tokenizer", required=True, metavar="SPEC",
                     help="the generation's tokenizer: a Hugging Face tokenizer.json path, or tiktoken:<encoding>")
    json_option(sgl, "the figures (documents, tokens, bytes)")
    quiet_option(sgl)
    sgl.set_defaults(func=cmd_export_sglang)
    add_sglang_commands(sub)
    add_token_commands(sub)
    add_llama_follow(sub)
    for add in extra_commands:
        add(sub)
    return parser

