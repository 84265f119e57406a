"""Build inputs: text files and folders (tokenized), and token files (.bin/.tokens/.npy).

Every input file is one or more *streams*; n-grams never span two streams, as
llama-lookup-create counts each input on its own. Token files are read in bounded chunks so
a corpus larger than memory streams through.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError

if TYPE_CHECKING:
    from ngramcache.client.kernel.tokenizer import Tokenizer

TOKEN_SUFFIXES = (".bin", ".tokens")  # raw little-endian int32
NPY_SUFFIX = ".npy"                   # numpy int32, 1-D; optional sibling <stem>.offsets.npy
OFFSETS_SUFFIX = ".offsets.npy"       # int64 start of each stream, first element 0
CHUNK_TOKENS = 4 << 20                # tokens read per chunk (16 MiB)
TEXT_BATCH_BYTES = 8 << 20            # text tokenized per batch


DEFAULT_EXCLUDES = (".*", "__pycache__")  # hidden entries and Python's bytecode caches, always left out of folders


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str  # "text", "raw" or "npy"
    size: int  # bytes on disk
    found: bool = False  # found in a folder (not named): skipped with a note, not refused, when it is not UTF-8


def is_token_file(path: Path) -> bool:
    return path.suffix in TOKEN_SUFFIXES or (path.suffix == NPY_SUFFIX and not path.name.endswith(OFFSETS_SUFFIX))


def _glob_matches(glob: str, rel: PurePosixPath) -> bool:
    """A GLOB with a ``/`` matches the whole path below the input folder; one without, any single name in it."""
    if "/" in glob:
        return fnmatch.fnmatchcase(str(rel), glob.strip("/"))
    return any(fnmatch.fnmatchcase(part, glob) for part in rel.parts)


def _folder_files(folder: Path, include: Sequence[str], exclude: Sequence[str]) -> list[Path]:
    """The files below `folder` that the globs keep (excluded folders are not entered), sorted."""
    excludes = (*DEFAULT_EXCLUDES, *exclude)
    out: list[Path] = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        rel_root = PurePosixPath(here.relative_to(folder).as_posix())
        dirs[:] = [d for d in dirs if not any(_glob_matches(g, rel_root / d) for g in excludes)]
        for name in names:
            rel = rel_root / name
            if any(_glob_matches(g, rel) for g in excludes):
                continue
            if include and not any(_glob_matches(g, PurePosixPath(name)) if "/" not in g else _glob_matches(g, rel)
                                   for g in include):
                continue
            if (here / name).is_file():
                out.append(here / name)
    return sorted(out)


def collect_inputs(paths: Sequence[str | os.PathLike[str]], include: Sequence[str] = (),
                   exclude: Sequence[str] = ()) -> list[InputFile]:
    """Expands folders (recursively, sorted) into input files.

    In a folder, hidden entries and ``__pycache__`` are always left out, and so is whatever an
    ``exclude`` glob matches; with ``include`` globs, only files one of them matches are kept.
    A glob without ``/`` matches a single name (``*.pyc``, ``tests``: a file or a folder at any
    depth; ``include`` matches file names), one with ``/`` the path below the folder
    (``docs/*.md``; ``*`` also crosses ``/``). Files named directly are always taken.

    Raises:
        InvalidArgumentError: an input is missing or not a file or folder, or nothing is left.
    """
    out: list[InputFile] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files, found = _folder_files(p, include, exclude), True
        elif p.is_file():
            files, found = [p], False
        elif p.exists():
            raise InvalidArgumentError(f"input {raw} is not a regular file or a folder")
        else:
            raise InvalidArgumentError(f"input {raw} does not exist")
        for f in files:
            if f.name.endswith(OFFSETS_SUFFIX):
                continue  # read together with its .npy
            kind = "raw" if f.suffix in TOKEN_SUFFIXES else "npy" if f.suffix == NPY_SUFFIX else "text"
            out.append(InputFile(f, kind, f.stat().st_size, found))
    if not out:
        filters = " (after --include/--exclude)" if include or exclude else ""
        raise InvalidArgumentError("no input files found in " + ", ".join(os.fspath(p) for p in paths) + filters)
    return out


def _npy_layout(path: Path) -> tuple[int, int]:
    """(data offset, n tokens) of a 1-D int32 .npy file, checked."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as e:
            raise InvalidArgumentError(f"{path}: not a valid .npy file ({e})") from None
        offset = f.tell()
    if dtype != np.dtype("<i4") or len(shape) != 1:
        raise InvalidArgumentError(f"{path}: token .npy files must be 1-D little-endian int32, got {dtype} of shape {shape}")
    n = int(shape[0])
    if offset + 4 * n > path.stat().st_size:
        raise InvalidArgumentError(f"{path}: truncated: the header promises {n} tokens")
    return offset, n


def _read_range(path: Path, offset: int, start: int, end: int) -> Iterator[np.ndarray]:
    """Tokens [start, end) of a raw int32 file whose data starts at byte `offset`, in chunks."""
    with open(path, "rb") as f:
        f.seek(offset + 4 * start)
        pos = start
        while pos < end:
            n = min(CHUNK_TOKENS, end - pos)
            chunk = np.fromfile(f, dtype="<i4", count=n)
            if len(chunk) != n:
                raise InvalidArgumentError(f"{path}: file ended early at token {pos + len(chunk)}")
            yield chunk.astype(np.int32, copy=False)
            pos += n


def token_streams(item: InputFile) -> Iterator[Iterator[np.ndarray]]:
    """The streams of a token file, each an iterator of int32 chunks."""
    if item.kind == "raw":
        if item.size % 4:
            raise InvalidArgumentError(f"{item.path}: {item.size} bytes is not a whole number of int32 tokens")
        yield _read_range(item.path, 0, 0, item.size // 4)
        return
    offset, n = _npy_layout(item.path)
    sidecar = item.path.with_name(item.path.name[: -len(NPY_SUFFIX)] + OFFSETS_SUFFIX)
    if not sidecar.exists():
        yield _read_range(item.path, offset, 0, n)
        return
    starts = np.load(sidecar)
    if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer) or (len(starts) and starts[0] != 0) \
            or np.any(np.diff(starts) < 0) or (len(starts) and starts[-1] > n):
        raise InvalidArgumentError(f"{sidecar}: stream offsets must be 1-D, ascending, start at 0 and stay within {n}")
    bounds = [int(x) for x in starts] + [n]
    for a, b in itertools.pairwise(bounds):
        yield _read_range(item.path, offset, a, b)


def read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(
            f"{path}: not UTF-8 text (byte {e.start}); token files must end in .bin, .tokens or .npy"
        ) from None


@dataclass
class Skipped:
    """Files found in folders that were neither UTF-8 text nor token files, left out of a build."""

    count: int = 0
    example: str | None = None  # the first one

    def add(self, path: Path) -> None:
        self.count += 1
        if self.example is None:
            self.example = os.fspath(path)

    def note(self) -> str:
        """One line for stderr (empty when nothing was skipped)."""
        if not self.count:
            return ""
        files = "file" if self.count == 1 else "files"
        return (f"note: skipped {self.count} {files} found in input folders that {'is' if self.count == 1 else 'are'} "
                f"neither UTF-8 text nor a token file (e.g. {self.example}); --exclude GLOB leaves such files out")


def read_texts(items: Sequence[InputFile], skipped: Skipped) -> tuple[list[InputFile], list[str]]:
    """The texts of `items` and the items they come from; a file found in a folder that is not UTF-8 is
    recorded in `skipped` instead, while one named directly is refused.

    Raises:
        InvalidArgumentError: a file named directly is not UTF-8.
    """
    kept: list[InputFile] = []
    texts: list[str] = []
    for item in items:
        if item.found:
            try:
                texts.append(item.path.read_bytes().decode("utf-8"))
            except UnicodeDecodeError:
                skipped.add(item.path)
                continue
        else:
            texts.append(read_text(item.path))
        kept.append(item)
    return kept, texts


def text_batch_bytes(memory_budget: int) -> int:
    """Text tokenized per batch under a build's memory budget: 1/32 of it, within 1 MiB..TEXT_BATCH_BYTES.

    A batch costs about 12 times its size while it is tokenized (the text, and the tokenizer's
    ids as Python ints before they become int32), so a small budget gets small batches."""
    return max(1 << 20, min(TEXT_BATCH_BYTES, memory_budget // 32))


def text_batches(items: list[InputFile], batch_bytes: int = TEXT_BATCH_BYTES) -> Iterator[list[InputFile]]:
    """Groups text files into batches of about `batch_bytes` (a file larger than that is a batch of its own)."""
    batch: list[InputFile] = []
    size = 0
    for item in items:
        batch.append(item)
        size += item.size
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def load_tokens(path: str, tokenizer: Tokenizer | None) -> np.ndarray:
    """A whole test input as one int32 array: a token file, or text tokenized with `tokenizer`."""
    items = collect_inputs([path])
    parts: list[np.ndarray] = []
    for item in items:
        if item.kind == "text":
            if tokenizer is None:
                raise InvalidArgumentError(f"{item.path} is text: pass --tokenizer to tokenize it")
            parts.append(tokenizer.encode(read_text(item.path)))
        else:
            for stream in token_streams(item):
                parts.extend(stream)
    return np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0, np.int32), dtype=np.int32)


def parse_size(text: str) -> int:
    """'1GiB', '256MiB', '512M', '1.5GB', '1000000' -> bytes: a positive, finite amount.

    Raises:
        InvalidArgumentError: not a size (also 'nan', 'inf', zero and negative amounts).
    """
    units = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
             "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB").strip()
    unit = s[len(s.rstrip("KMGTIB")):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0 or value * units[unit] < 1:
        raise InvalidArgumentError(f"cannot read size {text!r}: use a positive amount such as 1GiB, 256MiB or a byte count")
    return int(value * units[unit])


def first_out_of_vocabulary(tokens: np.ndarray, vocab_size: int) -> int | None:
    """The index of the first token of `tokens` outside [0, vocab_size), or None when all are inside."""
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    return int(bad[0]) if len(bad) else None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
