"""The commands' shared arguments: argparse types that refuse a bad value with the flag's name, and the tokenizer, budget and quiet options."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ngramcache.client._core import MAX_VOCAB, UNTAGGED
from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.errors import InvalidArgumentError, TokenizerMismatchError

if TYPE_CHECKING:
    from ngramcache.client.kernel.tokenizer import Tokenizer


MIN_BUDGET = 16 << 20          # the builder refuses a smaller memory budget
DEFAULT_BUDGET = 1 << 30
MAX_GENERATION = (1 << 63) - 1  # the header field is a signed 64-bit integer
def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that knows
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in lo..hi (no upper bound when hi is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            small = hi is not None and hi < 1 << 32  # a range worth showing whole
            bound = f"in {lo}..{hi}" if small else f"at least {lo}" if value < lo else f"at most {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def seconds_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in (lo, hi] (nan, inf and overflowing values refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"must be a number of seconds in ({lo:g}, {hi:g}], got {text[:40]}")
        return value
    return parse


def memory_budget(text: str) -> int:
    """An argparse type: a size (see corpus.parse_size) within 16 MiB .. this machine's memory."""
    try:
        n = corpus.parse_size(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < MIN_BUDGET:
        raise argparse.ArgumentTypeError(f"{text} is below the minimum of 16MiB")
    physical = _physical_memory()
    if physical is not None and n > physical:
        raise argparse.ArgumentTypeError(f"{text} is more than this machine's memory ({_gib(physical)})")
    return n

def load_tokenizer_spec(spec: str | None) -> Tokenizer | None:
    if spec is None:
        return None
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    return load_tokenizer(spec)


def _fingerprint_from_hex(text: str) -> bytes:
    """--fingerprint: 64 hexadecimal digits, or `untagged` for the all-zero fingerprint."""
    if text.strip().lower() == "untagged":
        return UNTAGGED
    try:
        fp = bytes.fromhex(text)
    except ValueError:
        fp = b""
    if len(fp) != 32:
        raise InvalidArgumentError(f"--fingerprint must be 64 hexadecimal digits (32 bytes) or 'untagged', got {text!r}")
    return fp


def show_fingerprint(fp: bytes) -> str:
    return "untagged" if fp == UNTAGGED else fp.hex()


def vocab_and_fingerprint(args: argparse.Namespace, tokenizer: Tokenizer | None) -> tuple[int, bytes, str]:
    """The vocabulary size and fingerprint a new file records (from --tokenizer, or given explicitly),
    and where the vocabulary comes from, for messages."""
    if tokenizer is not None:
        if args.vocab_size is not None and args.vocab_size != tokenizer.vocab_size:
            raise InvalidArgumentError(f"--vocab-size {args.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}")
        fp = tokenizer.fingerprint
        if args.fingerprint is not None and _fingerprint_from_hex(args.fingerprint) != fp:
            raise TokenizerMismatchError("--fingerprint differs from the tokenizer's fingerprint")
        return tokenizer.vocab_size, fp, f"--tokenizer {tokenizer.spec}"
    if args.vocab_size is None or args.fingerprint is None:
        raise InvalidArgumentError("token inputs need --tokenizer SPEC, or both --vocab-size and --fingerprint "
                                   "(HEX, or 'untagged' for token files of no known tokenizer)")
    return args.vocab_size, _fingerprint_from_hex(args.fingerprint), f"--vocab-size {args.vocab_size}"


def tokenizer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="a Hugging Face tokenizer.json path, or tiktoken:<encoding> (cl100k_base, qwen, qwen3.5); "
                        "gives the vocabulary size and the tokenizer fingerprint recorded in the file")
    p.add_argument("--vocab-size", type=int_in(1, MAX_VOCAB), metavar="V",
                   help=f"vocabulary size (1..{MAX_VOCAB}), for token inputs without --tokenizer; with it, must agree")
    p.add_argument("--fingerprint", metavar="HEX",
                   help="tokenizer fingerprint recorded in the file, for token inputs without --tokenizer: 64 hex "
                        "digits, or 'untagged' (all zeros) for tokens of no known tokenizer")


def budget_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--memory-budget", type=memory_budget, default=DEFAULT_BUDGET, metavar="SIZE",
                   help=f"memory for {what} (the core's buffers; Python, a tokenizer and text being tokenized "
                        "come on top): bytes, or with a unit (KiB, MiB, GiB, TiB; K, M, G, T are powers "
                        "of 1000), e.g. 256MiB; at least 16MiB and at most this machine's memory; beyond it sorted "
                        "runs spill to disk (default 1GiB)")


def file_filter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="in input folders, take only files whose name matches GLOB (with a '/', whose path below "
                        "the folder matches it); repeatable (default: every file); files named as INPUT are always taken")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="in input folders, leave out files and folders whose name matches GLOB (with a '/', whose "
                        "path below the folder matches it), e.g. '*.min.js' or tests; repeatable (default: none). Hidden "
                        "entries and __pycache__ are always left out, and a file that is neither UTF-8 text nor a token file "
                        "is skipped with a note")


def quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="print nothing on success (errors are still printed)")

