"""Writing token files: text tokenized into the int32 ``.npy`` + ``.offsets.npy`` streams that `corpus` reads.

``OUT.npy`` holds every file's tokens, one after the other (1-D little-endian int32), and
``OUT.offsets.npy`` where each file's stream starts (1-D int64, first element 0): the format
``ngramcache build`` and a service's ``rebuild --corpus`` read, n-grams never spanning two
files. Text is tokenized in batches of about ``corpus.TEXT_BATCH_BYTES`` and streamed to disk,
so memory stays bounded whatever the corpus's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.kernel.files import fsync_dir

if TYPE_CHECKING:
    from ngramcache.client.kernel.tokenizer import Tokenizer

__all__ = ["TokenizeResult", "offsets_path", "tokenize_to_npy"]

# A 1-D int32 .npy header (format 1.0) is padded to 128 bytes for any length below 10**40:
# the data starts there, and the header is written once the length is known.
_HEADER_BYTES = 128


@dataclasses.dataclass(frozen=True)
class TokenizeResult:
    """What `tokenize_to_npy` wrote."""

    path: str  # OUT.npy
    offsets_path: str  # OUT.offsets.npy
    n_tokens: int
    n_streams: int  # one per text file
    n_skipped: int = 0  # files found in input folders that were not UTF-8 text
    skipped_example: str | None = None  # the first of them


def offsets_path(path: str | os.PathLike[str]) -> str:
    """The stream offsets file beside a token ``.npy`` (``OUT.npy`` -> ``OUT.offsets.npy``)."""
    p = os.fspath(path)
    return p[: -len(corpus.NPY_SUFFIX)] + corpus.OFFSETS_SUFFIX


def _npy_header(n_tokens: int) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False, "shape": (n_tokens,)})
    header = buf.getvalue()
    if len(header) != _HEADER_BYTES:  # cannot happen below 10**40 tokens
        raise AssertionError(f"unexpected .npy header size {len(header)}")
    return header


def tokenize_to_npy(inputs: Sequence[str | os.PathLike[str] | corpus.InputFile], output: str | os.PathLike[str], tokenizer: Tokenizer,
                    *, include: Sequence[str] = (), exclude: Sequence[str] = (),
                    progress: Callable[[int, int], None] | None = None) -> TokenizeResult:
    """Tokenize text files and folders into ``output`` (``OUT.npy``) and ``OUT.offsets.npy``, one stream per file.

    Both files are written to temporary names beside ``output`` and renamed into place; an old
    ``OUT.offsets.npy`` is removed first, so an interruption between the two renames leaves the
    tokens readable (as a single stream), never a pair that disagrees.

    Args:
        inputs: text files and folders (expanded by `corpus.collect_inputs` with ``include`` and
            ``exclude``), or `corpus.InputFile` items already collected. A file found in a folder that is not UTF-8 text is skipped (counted in
            the result); one named directly is refused.
        output: the ``.npy`` file to write.
        tokenizer: tokenizes the text.
        include, exclude: globs choosing the files of input folders.
        progress: called as reading goes, with (bytes read, tokens written) since the last call.

    Returns:
        What was written.

    Raises:
        InvalidArgumentError: ``output`` does not end in ``.npy`` (or ends in ``.offsets.npy``), an
            input is missing, is a token file already, or a named file is not UTF-8.
        OSError: a file cannot be read or written.
    """
    target = os.fspath(output)
    if not target.endswith(corpus.NPY_SUFFIX) or target.endswith(corpus.OFFSETS_SUFFIX):
        raise InvalidArgumentError(f"-o {target}: the token file must end in .npy (not .offsets.npy): the offsets go "
                                   f"beside it, in NAME.offsets.npy")
    paths = [os.fspath(i) for i in inputs if not isinstance(i, corpus.InputFile)]
    items = [i for i in inputs if isinstance(i, corpus.InputFile)] + (
        corpus.collect_inputs(paths, include, exclude) if paths else [])
    tokens_in = [i for i in items if i.kind != "text"]
    if tokens_in:
        raise InvalidArgumentError(f"{tokens_in[0].path} is a token file already: tokenize takes text files (leave "
                                   "it out, or --exclude it)")
    report = progress or (lambda done, tokens: None)
    offsets_target = offsets_path(target)
    stem = f"{target}.tmp.{os.getpid()}.{secrets.token_hex(4)}"  # the name an interrupted command's clean-up removes
    tmp_tokens, tmp_offsets = stem, stem + ".offsets"
    skipped = corpus.Skipped()
    starts: list[int] = []
    n = 0
    try:
        with open(tmp_tokens, "xb") as f:
            f.write(b"\0" * _HEADER_BYTES)
            for batch in corpus.text_batches(items):
                kept, texts = corpus.read_texts(batch, skipped)
                report(sum(i.size for i in batch) - sum(i.size for i in kept), 0)
                for item, ids in zip(kept, tokenizer.encode_batch(texts), strict=True):
                    starts.append(n)
                    f.write(np.ascontiguousarray(ids, dtype="<i4").tobytes())
                    n += len(ids)
                    report(item.size, len(ids))
            if not starts:
                raise InvalidArgumentError(f"nothing to tokenize: no input file is UTF-8 text ({skipped.count} "
                                           f"skipped, e.g. {skipped.example}); {target} was not written")
            f.seek(0)
            f.write(_npy_header(n))
            f.flush()
            os.fsync(f.fileno())
        with open(tmp_offsets, "xb") as g:
            np.save(g, np.asarray(starts, dtype=np.int64))
            g.flush()
            os.fsync(g.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(offsets_target)
        os.replace(tmp_tokens, target)
        os.replace(tmp_offsets, offsets_target)
    except BaseException:
        for tmp in (tmp_tokens, tmp_offsets):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(target)))
    return TokenizeResult(target, offsets_target, n, len(starts), skipped.count, skipped.example)

