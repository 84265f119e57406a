"""Checks made before any work (inputs, outputs, folders) and the guard that reports an interruption truthfully: a mistake costs nothing and never destroys an input."""

from __future__ import annotations

import argparse
import errno
import glob
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ngramcache.client._core import StaticCache
from ngramcache.client.kernel.build import with_path
from ngramcache.client.kernel.errors import CacheFormatError, InvalidArgumentError


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


def _inside_input_folder(path: Path, inputs: Iterable[str]) -> bool:
    """True when `path` (absolute) is or lies inside one of the folders among `inputs`."""
    chain = _folder_chain(path)
    return any(Path(raw).is_dir() and _identity(raw) in chain for raw in inputs)


def _file_instead_of(folder: str, inputs: Iterable[str], suffix: str) -> str:
    """A file name to suggest for an output given as the existing `folder`: NAME inside it, or, when it
    is (or lies in) an input folder, a file beside the outermost such folder (``corpus.ngc`` for ``corpus``)."""
    inputs = list(inputs)
    here = Path(os.path.abspath(folder))
    if not _inside_input_folder(here, inputs):
        return os.path.join(folder, "NAME")
    while here != here.parent:
        candidate = here.parent / (here.name + suffix)
        if not _inside_input_folder(here.parent, inputs):
            return os.path.relpath(candidate) if not os.path.isabs(folder) else str(candidate)
        here = here.parent
    return "NAME" + suffix


def check_output(output: str, inputs: Iterable[str], flag: str = "-o", suffix: str = ".out") -> None:
    """Refuses, before any work, an output that would destroy an input or cannot be written.

    Refused: an output that is one of `inputs` (compared by device and inode, so a symlink, a
    hard link or another spelling of an input is caught), lies inside an input folder, is a
    directory or another non-regular file, or whose folder does not exist or is not writable.

    An output given as an existing folder is refused with a file name to use instead (NAME in
    it, or, when the folder is an input, `suffix` added to its name: a file beside it).

    Raises:
        InvalidArgumentError: naming `flag`, the output and the reason.
    """
    inputs = list(inputs)
    p = Path(output)
    if not output:
        raise InvalidArgumentError(f"{flag} needs a file name")
    if p.is_dir():
        raise InvalidArgumentError(f"{flag} {output} is a directory: give the file to write, e.g. "
                                   f"{_file_instead_of(output, inputs, suffix)}")
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


def outputs_of(args: argparse.Namespace) -> list[str]:
    """The files a command will write, known from its arguments."""
    outs = [getattr(args, name, None) for name in ("output", "dump_drafts")]
    if args.command == "demo" and args.workdir:
        outs.append(str(Path(args.workdir) / "stdlib.ngc"))
    if args.command == "tokenize" and args.output.endswith(".npy"):
        outs.append(args.output[: -len(".npy")] + ".offsets.npy")
    return [o for o in outs if o]


_OUTPUT_FLAGS = {"output": "-o", "dump_drafts": "--dump-drafts"}
# What a command's -o file is usually called, for the name suggested instead of a folder.
_OUTPUT_SUFFIXES = {"build": ".ngc", "merge": ".ngc", "import-llama": ".ngc", "export-llama": ".lookup",
                    "export-sglang": ".jsonl", "tokenize": ".npy"}


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
                # A token file's stream offsets (OUT.npy -> OUT.offsets.npy) are read with it: an input too.
                sidecar = str(item)[: -len(".npy")] + ".offsets.npy" if str(item).endswith(".npy") else None
                if sidecar and not str(item).endswith(".offsets.npy") and os.path.isfile(sidecar):
                    found.append(sidecar)
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
            check_output(output, inputs, flag, _OUTPUT_SUFFIXES.get(getattr(args, "command", ""), ".out")
                         if name == "output" else ".txt")


@contextmanager
def reading_static(path: str, errors: tuple[type[Exception], ...] = (CacheFormatError,)) -> Iterator[None]:
    """Re-raises `errors` raised while reading static cache `path` naming it and suggesting a check."""
    try:
        yield
    except errors as e:
        raise CacheFormatError(f"{with_path(path, str(e))}; to check the whole file: ngramcache inspect --verify {path}") from None


def open_static(path: str, what: str) -> StaticCache:
    """Opens a static cache given as `what` (e.g. --static), naming it in any error."""
    check_input_file(path, what)
    with reading_static(path):
        return StaticCache.open(path)


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

