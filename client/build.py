"""Building a static generation from token streams in memory: `build_static_from_tokens`, which says what did not fit (a result, and a warning)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from ngramcache.client import _core

__all__ = ["BuildResult", "IndexBudgetWarning", "build_static_from_tokens"]


class IndexBudgetWarning(UserWarning):
    """A corpus index left tokens out: they did not fit in its half of the memory budget."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `build_static_from_tokens` wrote."""

    path: str
    n_tokens: int  # tokens read, over every stream
    n_streams: int
    n_keys: int  # n-gram keys in the file
    n_indexed: int  # tokens the corpus index holds (0 without one)
    n_not_indexed: int  # tokens past the index's budget: counted in the tables, not matched by the match mode


def build_static_from_tokens(streams: Sequence[NDArray[np.int32]], path: str | os.PathLike[str], vocab_size: int,
                             ngram_size: int = 2, *, fingerprint: bytes, generation: int = 0,
                             corpus_index: bool = False, memory_budget: int = 1 << 30) -> BuildResult:
    """Count the (ngram_size-gram, follower) pairs of each int32 token stream and write a static cache to ``path``
    atomically (n-grams never span two streams).

    Args:
        streams: int32 token arrays, one per document.
        path: the file to write.
        vocab_size: the tokenizer's vocabulary size; every token must be below it.
        ngram_size: tokens per key (1..4).
        fingerprint: the tokenizer's 32-byte fingerprint (``UNTAGGED`` for raw tokens).
        generation: the generation number recorded in the header.
        corpus_index: also index the streams for the match mode (static format version 2).
        memory_budget: bytes the build may use (>= 16 MiB); the corpus index gets half of it,
            32 bytes a token, and tokens past that are left out of the index.

    Returns:
        The counts of what was written; ``n_not_indexed`` > 0 also raises an `IndexBudgetWarning`.

    Raises:
        InvalidArgumentError: a bad argument or a token outside the vocabulary.
        OSError: the file cannot be written.
    """
    stats = _core.build_static_from_tokens(list(streams), path, vocab_size, ngram_size, fingerprint=fingerprint,
                                           generation=generation, corpus_index=corpus_index,
                                           memory_budget=memory_budget)
    result = BuildResult(os.fspath(path), stats["n_tokens"], stats["n_streams"], stats["n_keys"], stats["n_indexed"],
                         stats["n_not_indexed"])
    if corpus_index and result.n_not_indexed:
        warnings.warn(IndexBudgetWarning(
            f"{result.path}: the corpus index holds {result.n_indexed:,} of {result.n_tokens:,} tokens; "
            f"{result.n_not_indexed:,} did not fit in half of memory_budget ({memory_budget:,} bytes, 32 bytes a "
            "token): give a larger memory_budget to index them"), stacklevel=2)
    return result
