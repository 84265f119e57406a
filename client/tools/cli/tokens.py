"""The tokenizer commands: `tokenizer-info` (what a SPEC loads: vocabulary, fingerprint) and `tokenize` (text -> token files)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ngramcache.client.kernel.progress import Progress
from ngramcache.client.tools.cli.arguments import file_filter_options, load_tokenizer_spec, quiet_option

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

SPEC_HELP = ("a Hugging Face tokenizer.json, or the local model folder holding one (hub ids are never fetched: a "
             "downloaded model lives in ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REVISION/), or "
             "tiktoken:<encoding> (cl100k_base, qwen, qwen3.5)")


def cmd_tokenizer_info(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer_spec(args.spec)
    assert tokenizer is not None
    info = {"spec": tokenizer.spec, "kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
            "fingerprint": tokenizer.fingerprint_hex}
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>11}: {value}")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from ngramcache.client.kernel import corpus
    from ngramcache.client.kernel.token_files import tokenize_to_npy

    tokenizer = load_tokenizer_spec(args.tokenizer)
    assert tokenizer is not None  # --tokenizer is required
    items = corpus.collect_inputs(args.inputs, args.include, args.exclude)
    with Progress("tokenize", sum(i.size for i in items), "B", quiet=args.quiet) as progress:
        written = tokenize_to_npy(items, args.output, tokenizer, progress=progress.update)
    note = corpus.Skipped(written.n_skipped, written.skipped_example).note()
    if note:
        print(note, file=sys.stderr)
    if not args.quiet:
        print(f"wrote {written.path} ({written.n_tokens:,} tokens of {tokenizer.spec}) and {written.offsets_path} "
              f"({written.n_streams:,} streams, one per file)")
    return 0


def add_token_commands(sub: SubParsers) -> None:
    """Adds `tokenizer-info` and `tokenize` to the parser's subcommands."""
    info = sub.add_parser(
        "tokenizer-info",
        help="print what a --tokenizer SPEC loads: kind, vocabulary size and fingerprint",
        description="Loads a tokenizer SPEC (from local files only) and prints its kind, vocabulary size and "
        "fingerprint: the 64 hex digits a static cache and a namespace are bound to, as inspect and the "
        "tokenizer-mismatch errors show them.",
    )
    info.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    info.add_argument("--json", action="store_true", help="print one JSON object instead of one field per line")
    info.set_defaults(func=cmd_tokenizer_info)

    tok = sub.add_parser(
        "tokenize",
        help="tokenize text files into a token file (OUT.npy + OUT.offsets.npy) for build or rebuild --corpus",
        description="Tokenizes every text file (UTF-8) of the inputs with --tokenizer and writes OUT.npy (1-D "
        "little-endian int32, the files' tokens one after the other) and OUT.offsets.npy (1-D int64, where each "
        "file's stream starts): one stream per file, so n-grams never span two files. build and a service's "
        "rebuild --corpus read the pair as they read the text, without the tokenizer. Both files are written "
        "atomically (the offsets after the tokens); memory stays bounded whatever the corpus's size.",
    )
    tok.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="text files, or folders of them (searched recursively; hidden entries and __pycache__ "
                          "skipped)")
    file_filter_options(tok)
    tok.add_argument("-o", "--output", required=True, metavar="OUT.npy",
                     help="the token file to write, ending in .npy (OUT.offsets.npy is written beside it; both "
                          "replaced if they exist)")
    tok.add_argument("--tokenizer", required=True, metavar="SPEC", help=SPEC_HELP)
    quiet_option(tok)
    tok.set_defaults(func=cmd_tokenize)
