"""The `ngramcache` command line: one entry point, one subcommand per task.

Every command checks its arguments and its output path before any work, so a mistake costs
nothing and never destroys an input; a user error is one line on stderr (exit status 2),
Ctrl-C one line (exit status 130), and neither leaves a partial output behind.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import math
import os
import resource
import secrets
import shutil
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ngramcache import (
    StaticBuilder,
    export_llama,
    import_llama,
    load_llama_counts,
    replay,
)
from ngramcache.client import (
    MAX_DRAFT,
    MAX_VOCAB,
    NGRAM_MAX,
    UNTAGGED,
    CacheFormatError,
    CountTable,
    InvalidArgumentError,
    NgramCacheError,
    StaticCache,
    TokenizerMismatchError,
    build_static_from_tokens,
    corpus,
)
from ngramcache.client.progress import Progress

if TYPE_CHECKING:
    from ngramcache.client.tokenizer import Tokenizer

MIN_BUDGET = 16 << 20          # the builder refuses a smaller memory budget
DEFAULT_BUDGET = 1 << 30
MAX_GENERATION = (1 << 63) - 1  # the header field is a signed 64-bit integer
EXIT_ERROR = 2                 # a user error (argparse uses 2 as well)
EXIT_UNEXPECTED = 1            # an error nobody anticipated: a bug to report
EXIT_INTERRUPTED = 130         # 128 + SIGINT, what shells report for Ctrl-C
STATIC_MAGIC = b"NGCSTAT\0"


# --- checks made before any work -------------------------------------------------------------

def _identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the file `path` names after symlinks, or None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _folder_chain(folder: Path) -> set[tuple[int, int]]:
    """The identities of `folder` (symlinks resolved) and of every folder above it."""
    chain: set[tuple[int, int]] = set()
    here = Path(os.path.realpath(folder))
    for p in (here, *here.parents):
        ident = _identity(p)
        if ident is not None:
            chain.add(ident)
    return chain


def check_input_file(path: str, what: str) -> None:
    """Refuses a missing, unreadable or non-regular input file, naming it as `what` (e.g. --static)."""
    p = Path(path)
    if not p.exists():
        raise InvalidArgumentError(f"{what} {path} does not exist")
    if p.is_dir():
        raise InvalidArgumentError(f"{what} {path} is a directory, not a file")
    if not p.is_file():
        raise InvalidArgumentError(f"{what} {path} is not a regular file")
    if not os.access(p, os.R_OK):
        raise InvalidArgumentError(f"{what} {path}: permission denied")


def check_folder(path: str, flag: str) -> None:
    """Refuses a folder option (e.g. --scratch-dir) that does not name a writable folder."""
    p = Path(path)
    if not p.exists():
        raise InvalidArgumentError(f"{flag} {path} does not exist")
    if not p.is_dir():
        raise InvalidArgumentError(f"{flag} {path} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{flag} {path}: permission denied")


def check_output(output: str, inputs: Iterable[str], flag: str = "-o") -> None:
    """Refuses, before any work, an output that would destroy an input or cannot be written.

    Refused: an output that is one of `inputs` (compared by device and inode, so a symlink, a
    hard link or another spelling of an input is caught), lies inside an input folder, is a
    directory or another non-regular file, or whose folder does not exist or is not writable.

    Raises:
        InvalidArgumentError: naming `flag`, the output and the reason.
    """
    p = Path(output)
    if not output:
        raise InvalidArgumentError(f"{flag} needs a file name")
    if p.is_dir():
        raise InvalidArgumentError(f"{flag} {output} is a directory: give the file to write, e.g. {os.path.join(output, 'NAME')}")
    if p.exists() and not p.is_file():
        raise InvalidArgumentError(f"{flag} {output} exists and is not a regular file")
    parent = p.parent
    if not parent.exists():
        raise InvalidArgumentError(f"{flag} {output}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise InvalidArgumentError(f"{flag} {output}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{flag} {output}: cannot write in the folder {parent}: permission denied")
    out_id = _identity(p)
    chain = _folder_chain(parent)
    for raw in inputs:
        in_id = _identity(raw)
        if in_id is None:
            continue
        if in_id == out_id:
            raise InvalidArgumentError(f"{flag} {output} is the input {raw}: writing it would destroy the input; "
                                       "choose another output file")
        if Path(raw).is_dir() and in_id in chain:
            raise InvalidArgumentError(f"{flag} {output} lies inside the input folder {raw}; write it elsewhere")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that knows
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


# --- argparse types: a bad value is refused with the flag's name, before any work -------------

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


# --- interruption: say truthfully what was written, leave nothing half-written ---------------

class OutputGuard:
    """Remembers each output's file before a command runs, to report an interruption truthfully.

    Every writer writes a temporary file beside its output and renames it at the end, so an
    output whose (device, inode) changed during the command is complete, and one that did not
    change is untouched. Not thread-safe.
    """

    def __init__(self) -> None:
        self._before: dict[str, tuple[int, int] | None] = {}

    def expect(self, path: str) -> None:
        """Records `path` as an output of this command (before it is written)."""
        self._before.setdefault(path, _identity(path))

    def interrupted(self) -> str:
        """Removes this process's temporary files beside the outputs; returns what to tell the user."""
        written = []
        for path, before in self._before.items():
            for tmp in glob.glob(glob.escape(path) + f".tmp.{os.getpid()}.*"):
                with suppress(OSError):
                    os.unlink(tmp)
            now = _identity(path)
            if now is not None and now != before:
                written.append(path)
        if written:
            return f"interrupted after writing {' and '.join(written)}; {'it is' if len(written) == 1 else 'they are'} complete"
        if self._before:
            return "interrupted; nothing was written"
        return "interrupted"


def _outputs_of(args: argparse.Namespace) -> list[str]:
    """The files a command will write, known from its arguments."""
    outs = [getattr(args, name, None) for name in ("output", "dump_drafts")]
    if args.command == "demo" and args.workdir:
        outs.append(str(Path(args.workdir) / "stdlib.ngc"))
    return [o for o in outs if o]


_OUTPUT_FLAGS = {"output": "-o", "dump_drafts": "--dump-drafts"}


def _inputs_of(args: argparse.Namespace) -> list[str]:
    """Every file a command's arguments name that exists and is not one of its outputs: tokenizers,
    token files, configs, TLS files, caches. Whatever an option is for, a file it names is read;
    folders count only as the command's positional inputs (a --scratch-dir is no input)."""
    found: list[str] = []
    for name, value in vars(args).items():
        if name in _OUTPUT_FLAGS or name in ("func", "guard", "command"):
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, (str, Path)) or not str(item):
                continue
            if os.path.isfile(item) or (name in ("inputs", "input") and os.path.lexists(item)):
                found.append(str(item))
    return found


def check_outputs_against_inputs(args: argparse.Namespace) -> None:
    """The one input/output guard of every command: no output may be a file the command reads
    (compared by device and inode: symlinks, hard links and other spellings are caught).

    Raises:
        InvalidArgumentError: naming the output's flag, the output and the input.
    """
    inputs = _inputs_of(args)
    for name, flag in _OUTPUT_FLAGS.items():
        output = getattr(args, name, None)
        if isinstance(output, str) and output:
            check_output(output, inputs, flag)


def _write_lines_atomically(path: str, lines: Iterable[str]) -> None:
    """Writes `lines` to a temporary file beside `path`, then renames it: never a partial file."""
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "x") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    except OSError as e:
        with suppress(OSError):
            os.unlink(tmp)
        if e.filename is None:  # a write or close that failed (a full disk): name the output, not a temporary
            raise OSError(e.errno, e.strerror, path) from None
        raise
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


# --- naming files in errors -------------------------------------------------------------------

def _named(path: str, message: str) -> str:
    return message if path in message else f"{path}: {message}"


@contextmanager
def _reading_static(path: str, errors: tuple[type[Exception], ...] = (CacheFormatError,)) -> Iterator[None]:
    """Re-raises `errors` raised while reading static cache `path` naming it and suggesting a check."""
    try:
        yield
    except errors as e:
        raise CacheFormatError(f"{_named(path, str(e))}; to check the whole file: ngramcache inspect --verify {path}") from None


def _open_static(path: str, what: str) -> StaticCache:
    """Opens a static cache given as `what` (e.g. --static), naming it in any error."""
    check_input_file(path, what)
    with _reading_static(path):
        return StaticCache.open(path)


def _out_of_vocabulary(path: str | Path, tokens: np.ndarray, start: int, vocab: int, source: str) -> InvalidArgumentError | None:
    """The error for the first token of `tokens` (at file position `start`) outside [0, vocab), if any."""
    i = corpus.first_out_of_vocabulary(tokens, vocab)
    if i is None:
        return None
    return InvalidArgumentError(f"{path}: token {int(tokens[i])} at position {start + i} is outside the vocabulary "
                                f"[0, {vocab}) of {source}")


def describe_os_error(e: OSError) -> str:
    """An OSError as a sentence naming the file ("X is a directory"), not "[Errno 21] ..."."""
    if e.filename is None:
        return str(e.strerror or e)  # the core's messages are sentences already
    name = os.fsdecode(e.filename)
    if e.filename2 is not None:
        name += f" -> {os.fsdecode(e.filename2)}"
    reasons = {
        errno.ENOENT: f"{name} does not exist",
        errno.EISDIR: f"{name} is a directory",
        errno.ENOTDIR: f"{name}: a part of this path is not a folder",
        errno.EACCES: f"{name}: permission denied",
        errno.EPERM: f"{name}: permission denied",
        errno.ENOSPC: f"{name}: no space left on the device",
        errno.EROFS: f"{name}: the file system is read-only",
        errno.EEXIST: f"{name} already exists",
    }
    if e.errno in reasons:
        return reasons[e.errno]
    return f"{name}: {(e.strerror or str(e)).lower()}"


# --- commands -------------------------------------------------------------------------------

def _byte_tokens(path: Path) -> np.ndarray:
    """A file's bytes as tokens (vocabulary 256): the demo needs no tokenizer download."""
    return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)


def demo_inputs(test_files: int, n_ctx: int) -> tuple[Path, list[Path], list[Path]]:
    """CPython's standard library as the demo's corpus: (its folder, `test_files` held-out files, the corpus files).

    Raises:
        InvalidArgumentError: no standard library found, or the held-out files are not longer than `n_ctx`.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 2000)
    if len(files) < 50:
        raise InvalidArgumentError(f"found only {len(files)} Python files under {lib}; the demo needs a standard library")
    held_out, corpus_files = files[::20][:test_files], [f for i, f in enumerate(files) if i % 20]
    n_test = sum(p.stat().st_size for p in held_out)
    if n_test <= n_ctx:
        raise InvalidArgumentError(f"the {len(held_out)} held-out files hold {n_test:,} tokens, not more than "
                                   f"--n-ctx {n_ctx}: pass a smaller --n-ctx or a larger --test-files")
    return lib, held_out, corpus_files


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ctrl-C is ignored inside (for cleaning up after a first one: a second must not leave half of it undone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def demo_workdir(workdir: str | None) -> Iterator[Path]:
    """The demo's work folder: `workdir` (created if missing, kept), or a new temporary folder removed on the
    way out, also on Ctrl-C or an error."""
    if workdir is not None:
        if Path(workdir).exists() and not Path(workdir).is_dir():
            raise InvalidArgumentError(f"--workdir {workdir} is not a folder")
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    folder = Path(tempfile.mkdtemp(prefix="ngramcache-demo-"))
    try:
        yield folder
    finally:
        with sigint_ignored():
            shutil.rmtree(folder, ignore_errors=True)


def run_local_demo(args: argparse.Namespace, workdir: Path, inputs: tuple[Path, list[Path], list[Path]]) -> Path:
    """The demo's first step: builds `workdir`/stdlib.ngc (generation 1) from the corpus of `inputs`
    (`demo_inputs`) and replays its held-out files through the local drafter, printing what it does.
    Returns the cache."""
    lib, held_out, corpus_files = inputs
    out = workdir / "stdlib.ngc"
    args.guard.expect(str(out))
    print(f"corpus: {len(corpus_files)} files of CPython's standard library ({lib}), byte tokens (vocabulary 256)")
    t0 = time.perf_counter()
    streams = [_byte_tokens(p) for p in corpus_files]
    build_static_from_tokens(streams, str(out), vocab_size=256, ngram_size=2, fingerprint=UNTAGGED, generation=1)
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
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    inputs = demo_inputs(args.test_files, args.n_ctx)
    with demo_workdir(args.workdir) as workdir:
        out = run_local_demo(args, workdir, inputs)
        if args.workdir is not None:
            print(f"the cache stays at {out}; try: ngramcache inspect {out}")
    if args.workdir is None:
        print(f"removed {workdir} (--workdir DIR keeps the cache)")
    return 0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux


def load_tokenizer_spec(spec: str | None) -> Tokenizer | None:
    if spec is None:
        return None
    from ngramcache.client.tokenizer import load_tokenizer

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


def _show_fingerprint(fp: bytes) -> str:
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


def _add_tokens(builder: StaticBuilder, path: Path, tokens: np.ndarray, start: int, vocab: int, source: str) -> None:
    """builder.add_tokens, naming the file and the position of a token outside the vocabulary."""
    try:
        builder.add_tokens(tokens)
    except InvalidArgumentError as e:
        raise _out_of_vocabulary(path, tokens, start, vocab, source) or InvalidArgumentError(_named(str(path), str(e))) from None


def cmd_build(args: argparse.Namespace) -> int:
    if args.index_depth is not None and not args.corpus_index:
        raise InvalidArgumentError("--index-depth sets the depth of the corpus index: add --corpus-index")
    items = corpus.collect_inputs(args.inputs)
    check_output(args.output, args.inputs)
    if args.scratch_dir is not None:
        check_folder(args.scratch_dir, "--scratch-dir")
    tokenizer = load_tokenizer_spec(args.tokenizer)
    if tokenizer is None and any(i.kind == "text" for i in items):
        raise InvalidArgumentError("text inputs need --tokenizer SPEC (a tokenizer.json path or tiktoken:<encoding>)")
    vocab, fingerprint, source = vocab_and_fingerprint(args, tokenizer)
    builder = StaticBuilder(args.output, vocab, args.ngram_size, fingerprint=fingerprint, generation=args.generation,
                            memory_budget=args.memory_budget, scratch_dir=args.scratch_dir or "", threads=args.threads,
                            corpus_index=args.corpus_index, index_depth=args.index_depth or 32)
    total = sum(i.size for i in items)
    t0 = time.perf_counter()
    t_tokenize = 0.0
    longest = 0  # tokens of the longest stream: with none above ngram_size there is no pair to count
    with Progress("build", total, "B", quiet=args.quiet) as progress:
        for item in (i for i in items if i.kind != "text"):
            position = 0  # in tokens, from the start of the file
            for stream in corpus.token_streams(item):
                builder.begin_stream()
                length = 0
                for chunk in stream:
                    _add_tokens(builder, item.path, chunk, position, vocab, source)
                    position += len(chunk)
                    length += len(chunk)
                    progress.update(4 * len(chunk), len(chunk))
                longest = max(longest, length)
        text_items = [i for i in items if i.kind == "text"]
        for batch in corpus.text_batches(text_items):
            assert tokenizer is not None  # checked above: text inputs need --tokenizer
            ts = time.perf_counter()
            encoded = tokenizer.encode_batch([corpus.read_text(i.path) for i in batch])
            t_tokenize += time.perf_counter() - ts
            for item, tokens in zip(batch, encoded):
                builder.begin_stream()
                _add_tokens(builder, item.path, tokens, 0, vocab, source)
                longest = max(longest, len(tokens))
                progress.update(item.size, len(tokens))
    if longest <= args.ngram_size:
        raise InvalidArgumentError(
            f"nothing to build: no input stream holds more than {args.ngram_size} tokens (the longest has {longest}), "
            f"so there is no ({args.ngram_size}-gram, follower) pair to count; {args.output} was not written")
    if not args.quiet:
        print(("sorting the corpus index, " if args.corpus_index else "") + "merging sorted runs and writing the file...",
              file=sys.stderr)
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
        "n_indexed": stats["n_indexed"],
        "n_not_indexed": stats["n_not_indexed"],
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
        if args.corpus_index:
            print(f"corpus index: {stats['n_indexed']:,} tokens, matches up to {cache.index_depth} tokens (format "
                  f"version 2; drafters use it with mode 'match')")
    if args.corpus_index and stats["n_not_indexed"] and not args.quiet:
        print(f"warning: {stats['n_not_indexed']:,} tokens past the index's half of --memory-budget were counted but "
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
        static = _open_static(args.static, "--static")
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
    bad = _out_of_vocabulary(args.input, tokens, 0, vocab, source)
    if bad is not None:
        raise bad
    dynamic = CountTable()
    if args.dynamic:
        try:
            load_llama_counts(args.dynamic, vocab, dynamic)
        except (CacheFormatError, InvalidArgumentError) as e:
            raise type(e)(f"--dynamic {_named(args.dynamic, str(e))} (a llama.cpp cache file, as llama-lookup -lcd "
                          "writes, for the same tokenizer)") from None
    if args.tree_budget and args.mode != "match":
        raise InvalidArgumentError("--tree-budget needs --mode match (the compatible mode drafts a line)")
    if args.mode == "match" and static is not None and static.index_depth == 0:
        print(f"note: {args.static} has no corpus index (build it with --corpus-index); the match mode uses its "
              "2-gram counts only", file=sys.stderr)
    reading: AbstractContextManager[None] = _reading_static(args.static) if args.static else nullcontext()
    with reading:
        r = replay(tokens, args.n_ctx, args.n_draft, args.ngram_min, args.ngram_max, static, dynamic,
                   args.dump_drafts is not None, mode=args.mode, tree_budget=args.tree_budget)
    if args.dump_drafts is not None:
        _write_lines_atomically(args.dump_drafts, _draft_lines(r["drafts"]))
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
        "fingerprint": _show_fingerprint(cache.fingerprint),
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
    caches = [_open_static(p, "input") for p in args.inputs]
    first = caches[0]
    for c in caches[1:]:
        for field in ("fingerprint", "ngram_size", "vocab_size"):
            a, b = getattr(first, field), getattr(c, field)
            if a != b:
                shown = (a.hex(), b.hex()) if isinstance(a, bytes) else (a, b)
                error = TokenizerMismatchError if field != "ngram_size" else InvalidArgumentError
                raise error(f"cannot merge: {first.path} has {field} {shown[0]}, {c.path} has {shown[1]}")
    for c in caches:  # a damaged input would be merged into a plausible-looking output
        with _reading_static(c.path):
            c.verify()
    generation = args.generation if args.generation is not None else max(c.generation for c in caches)
    builder = StaticBuilder(args.output, first.vocab_size, first.ngram_size, fingerprint=first.fingerprint,
                            generation=generation, memory_budget=args.memory_budget)
    for c in caches:  # add_static also adds the input's n_tokens to the output's
        with _reading_static(c.path, (CacheFormatError, InvalidArgumentError)):
            builder.add_static(c)
    stats = builder.finish()
    out = StaticCache.open(args.output)
    if not args.quiet:
        tokens = f"{out.n_tokens:,} tokens" if out.n_tokens or not out.n_keys else "an unknown number of tokens"
        print(f"wrote {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers from {tokens} "
              f"(merged {len(caches)} files, {stats['n_pairs']:,} counted pairs), generation {generation}")
        unknown = [c.path for c in caches if c.n_tokens == 0 and c.n_keys > 0]
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
    if not args.quiet:
        print(f"imported {args.input} -> {args.output}: {out.n_keys:,} keys, {out.n_followers:,} followers")
    return 0


def cmd_export_llama(args: argparse.Namespace) -> int:
    check_input_file(args.input, "input")
    check_output(args.output, [args.input])
    cache = _open_static(args.input, "input")
    with _reading_static(args.input):
        export_llama(cache, args.output)
    if not args.quiet:
        print(f"exported {args.input} -> {args.output} (llama.cpp format, {Path(args.output).stat().st_size:,} bytes)")
    return 0


# --- the parser -------------------------------------------------------------------------------

def tokenizer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="a Hugging Face tokenizer.json path, or tiktoken:<encoding> (cl100k_base, qwen, qwen3.5); "
                        "gives the vocabulary size and the tokenizer fingerprint recorded in the file")
    p.add_argument("--vocab-size", type=int_in(1, MAX_VOCAB), metavar="V",
                   help=f"vocabulary size (1..{MAX_VOCAB}), for token inputs without --tokenizer; with it, must agree")
    p.add_argument("--fingerprint", metavar="HEX",
                   help="tokenizer fingerprint recorded in the file, for token inputs without --tokenizer: 64 hex "
                        "digits, or 'untagged' (all zeros) for tokens of no known tokenizer")


def _budget_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--memory-budget", type=memory_budget, default=DEFAULT_BUDGET, metavar="SIZE",
                   help=f"memory for {what}: bytes, or with a unit (KiB, MiB, GiB, TiB; K, M, G, T are powers "
                        "of 1000), e.g. 256MiB; at least 16MiB and at most this machine's memory; beyond it sorted "
                        "runs spill to disk (default 1GiB)")


def _quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="print nothing on success (errors are still printed)")


# A hook that adds subcommands: the service side adds `serve` (ngramcache.cache_service.cli)
# without the client importing it.
CommandHook = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def build_parser(extra_commands: Iterable[CommandHook] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngramcache",
        description="A shared n-gram cache for speculative decoding (prompt lookup / llama.cpp's ngram cache).",
        epilog="Exit status: 0 on success, 2 on a user error, 130 when interrupted (Ctrl-C), 1 on an "
        "unexpected error. Outputs are written atomically and never replace an input.",
    )
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
        "N-grams never span two files or streams. Memory stays within --memory-budget: beyond it sorted runs go "
        "to scratch files beside the output (or --scratch-dir) and are merged. The file is written atomically; "
        "the output may not be an input or lie inside an input folder.",
    )
    build.add_argument("inputs", nargs="+", metavar="INPUT", help="text or token files, or folders of them (searched "
                       "recursively; hidden entries skipped)")
    build.add_argument("-o", "--output", required=True, metavar="OUT",
                       help="the static cache to write (replaced atomically if it exists)")
    tokenizer_options(build)
    build.add_argument("--ngram-size", type=ngram_size, default=2, metavar="K",
                       help=f"tokens per key, 1..{NGRAM_MAX} (default 2, as llama.cpp)")
    _budget_option(build, "counting")
    build.add_argument("--generation", type=generation, default=0, metavar="N",
                       help="generation number recorded in the file, a whole number >= 0 (default 0)")
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
    _quiet_option(build)
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
    _budget_option(merge, "merging")
    _quiet_option(merge)
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
    _budget_option(imp, "sorting")
    _quiet_option(imp)
    imp.set_defaults(func=cmd_import_llama)

    exp = sub.add_parser(
        "export-llama",
        help="write a static cache in llama.cpp's format (loads with llama-lookup -lcs)",
        description="Writes every key of a static cache as llama.cpp n-gram cache records.",
    )
    exp.add_argument("input", metavar="IN", help="the static cache to export")
    exp.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="the llama.cpp cache file to write (replaced atomically if it exists)")
    _quiet_option(exp)
    exp.set_defaults(func=cmd_export_llama)
    for add in extra_commands:
        add(sub)
    return parser


def _say(message: str) -> None:
    """One line on stderr; on a terminal it first erases the line (the echoed ^C, a progress line)."""
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    print(prefix + message, file=sys.stderr)


def main(argv: list[str] | None = None, extra_commands: Iterable[CommandHook] = ()) -> int:
    """Runs one command; returns its exit status (0, 1, 2 or 130) instead of raising."""
    guard = OutputGuard()
    name = "ngramcache"
    args: argparse.Namespace | None = None
    try:
        args = build_parser(extra_commands).parse_args(argv)
        name = f"ngramcache {args.command}"
        args.guard = guard
        check_outputs_against_inputs(args)
        for path in _outputs_of(args):
            guard.expect(path)
        command: Callable[[argparse.Namespace], int] = args.func
        return command(args)
    except KeyboardInterrupt:
        _say(f"{name}: {guard.interrupted()}")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ngramcache inspect F | head`: the reader left; not an error
        with suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemoryError:
        hint = ": give a smaller --memory-budget" if args is not None and hasattr(args, "memory_budget") else ""
        _say(f"{name}: error: out of memory{hint}")
        return EXIT_ERROR
    except NgramCacheError as e:
        _say(f"{name}: error: {e}")
        return EXIT_ERROR
    except OSError as e:
        _say(f"{name}: error: {describe_os_error(e)}")
        return EXIT_ERROR
    except Exception as e:
        if os.environ.get("NGRAMCACHE_TRACEBACK"):
            traceback.print_exc()
        _say(f"{name}: unexpected error: {type(e).__name__}: {e} (please report it; NGRAMCACHE_TRACEBACK=1 "
             "prints the traceback)")
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
