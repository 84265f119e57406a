"""A static generation's corpus index written as SGLang's external n-gram corpus: JSONL, one document a line, each a JSON string."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import UNTAGGED, StaticCache
from ngramcache.client.kernel.errors import CacheFormatError, InvalidArgumentError, TokenizerMismatchError
from ngramcache.client.kernel.files import write_lines_atomic

if TYPE_CHECKING:
    from ngramcache.client.kernel.tokenizer import Tokenizer

__all__ = ["SGLANG_DEFAULT_MAX_TOKENS", "SglangExport", "corpus_documents", "export_sglang"]

# SGLang refuses a corpus past --speculative-ngram-external-corpus-max-tokens, 10,000,000 by default.
SGLANG_DEFAULT_MAX_TOKENS = 10_000_000
_SEPARATOR = 0xFFFFFFFF  # between two streams of the TEXT section (docs/static-format.md)
_CHUNK = 1 << 20  # tokens read from the mapped section at a time


@dataclass(frozen=True)
class SglangExport:
    """What `export_sglang` wrote: documents (lines) and the corpus tokens they came from."""

    documents: int
    tokens: int


def corpus_documents(cache: StaticCache) -> Iterator[NDArray[np.int32]]:
    """The token streams of a static file's corpus index (its TEXT section), in order.

    The file's checksums are verified first (the section is read whole).

    Raises:
        InvalidArgumentError: the file has no corpus index (built without ``--corpus-index``):
            it keeps n-gram counts only, not the token sequences.
        CacheFormatError: the file is corrupt.
    """
    if cache.index_depth == 0 or cache.n_indexed == 0:
        raise InvalidArgumentError(
            f"{cache.path} has no corpus index: it keeps n-gram counts, not the token sequences SGLang's corpus "
            "needs; build the generation with `ngramcache build --corpus-index`")
    cache.verify()
    text = [s for s in cache.sections if s["name"] == "TEXT"]
    if len(text) != 1:
        raise CacheFormatError(f"{cache.path}: a corpus index without exactly one TEXT section")
    offset, length = int(text[0]["offset"]), int(text[0]["length"])
    if length % 4:
        raise CacheFormatError(f"{cache.path}: the TEXT section's length {length} is not a whole number of tokens")
    if length == 0:
        return
    words = np.memmap(cache.path, dtype="<u4", mode="r", offset=offset, shape=(length // 4,))
    pending: list[NDArray[np.uint32]] = []
    for start in range(0, len(words), _CHUNK):
        chunk = np.asarray(words[start:start + _CHUNK])
        cuts = np.flatnonzero(chunk == _SEPARATOR)
        begin = 0
        for cut in cuts:
            pending.append(chunk[begin:cut])
            yield _joined(pending)
            pending = []
            begin = int(cut) + 1
        pending.append(chunk[begin:])
    yield _joined(pending)


def _joined(parts: list[NDArray[np.uint32]]) -> NDArray[np.int32]:
    whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return whole.astype(np.int32)


def export_sglang(cache: StaticCache, tokenizer: Tokenizer, output: str | os.PathLike[str]) -> SglangExport:
    """Writes the corpus index of `cache` as SGLang's external n-gram corpus (``--speculative-ngram-external-corpus-path``).

    Each stream of the corpus index is decoded with `tokenizer` into one line, a JSON string
    (SGLang encodes each again with the model's tokenizer, without special tokens). Empty
    streams are left out. The file is written atomically: an interrupted export leaves no file.

    Args:
        cache: a static generation with a corpus index.
        tokenizer: the generation's tokenizer (its fingerprint must be the file's, unless the
            file is untagged).
        output: the JSONL file to write (replaced if it exists).

    Raises:
        InvalidArgumentError: no corpus index, or a token id outside the tokenizer's vocabulary.
        TokenizerMismatchError: the tokenizer is not the file's.
        CacheFormatError: the file is corrupt.
        OSError: the output cannot be written (a full disk, say).
    """
    if cache.fingerprint != UNTAGGED and bytes(tokenizer.fingerprint) != cache.fingerprint:
        raise TokenizerMismatchError(
            f"{cache.path} was built with another tokenizer (fingerprint {cache.fingerprint.hex()[:16]}..., "
            f"the tokenizer's {bytes(tokenizer.fingerprint).hex()[:16]}...): give the generation's tokenizer")
    counts = {"documents": 0, "tokens": 0}

    def lines() -> Iterator[str]:
        for doc in corpus_documents(cache):
            if len(doc) == 0:
                continue
            counts["documents"] += 1
            counts["tokens"] += len(doc)
            yield json.dumps(tokenizer.decode(doc), ensure_ascii=False) + "\n"

    write_lines_atomic(output, lines())
    return SglangExport(counts["documents"], counts["tokens"])
