"""Building a static generation: `build_static` streams corpus files (text or tokens) into one, `build_static_from_tokens` takes token arrays in memory; both say what did not fit."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ngramcache.client import _core
from ngramcache.client._core import StaticBuilder, StaticCache
from ngramcache.client.kernel import corpus
from ngramcache.client.kernel.errors import InvalidArgumentError

if TYPE_CHECKING:
    from ngramcache.client.kernel.tokenizer import Tokenizer

__all__ = ["BuildResult", "IndexBudgetWarning", "build_static", "build_static_from_tokens", "out_of_vocabulary"]

DEFAULT_MEMORY_BUDGET = 1 << 30


class IndexBudgetWarning(UserWarning):
    """A corpus index left tokens out: they did not fit in its half of the memory budget."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What a build wrote."""

    path: str
    n_tokens: int  # tokens read, over every stream
    n_streams: int
    n_keys: int  # n-gram keys in the file
    n_indexed: int  # tokens the corpus index holds (0 without one)
    n_not_indexed: int  # tokens past the index's budget: counted in the tables, not matched by the match mode
    n_followers: int = 0  # distinct (key, follower) pairs in the file
    file_bytes: int = 0
    n_runs: int = 0  # sorted runs spilled to disk beyond the memory budget
    index_depth: int = 0  # the longest match the corpus index finds (0 without one)
    n_inputs: int = 0  # input files read (build_static only)
    seconds: float = 0.0  # the whole build, reading and writing
    tokenize_seconds: float = 0.0  # of which tokenizing text
    n_skipped: int = 0  # files found in input folders that were neither UTF-8 text nor token files (build_static only)
    skipped_example: str | None = None  # the first of them


def _result(path: str | os.PathLike[str], stats: dict[str, int], **more: float | int | str | None) -> BuildResult:
    cache = StaticCache.open(os.fspath(path))  # O(1): the header and the section table
    return BuildResult(os.fspath(path), stats["n_tokens"], stats["n_streams"], cache.n_keys, stats["n_indexed"],
                       stats["n_not_indexed"], n_followers=cache.n_followers, file_bytes=cache.file_size,
                       n_runs=stats.get("n_runs", 0), index_depth=cache.index_depth, **more)  # type: ignore[arg-type]


def _warn_if_not_indexed(result: BuildResult, memory_budget: int) -> None:
    if result.n_not_indexed:
        warnings.warn(IndexBudgetWarning(
            f"{result.path}: the corpus index holds {result.n_indexed:,} of {result.n_tokens:,} tokens; "
            f"{result.n_not_indexed:,} did not fit in half of memory_budget ({memory_budget:,} bytes, 32 bytes a "
            "token): give a larger memory_budget to index them"), stacklevel=3)


def build_static_from_tokens(streams: Sequence[NDArray[np.int32]], path: str | os.PathLike[str], vocab_size: int,
                             ngram_size: int = 2, *, fingerprint: bytes, generation: int = 0,
                             corpus_index: bool = False, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> BuildResult:
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
    result = _result(path, stats)
    if corpus_index:
        _warn_if_not_indexed(result, memory_budget)
    return result


def with_path(path: str | Path, message: str) -> str:
    """``message``, prefixed with ``path`` unless it names it already."""
    return message if str(path) in message else f"{path}: {message}"


def out_of_vocabulary(path: str | Path, tokens: np.ndarray, start: int, vocab: int,
                      source: str) -> InvalidArgumentError | None:
    """The error for the first token of ``tokens`` (at position ``start`` of ``path``) outside [0, vocab), if any;
    ``source`` says where the vocabulary comes from (``--tokenizer X``, say)."""
    i = corpus.first_out_of_vocabulary(tokens, vocab)
    if i is None:
        return None
    return InvalidArgumentError(f"{path}: token {int(tokens[i])} at position {start + i} is outside the vocabulary "
                                f"[0, {vocab}) of {source}")


def _add_tokens(builder: StaticBuilder, path: Path, tokens: np.ndarray, start: int, vocab: int, source: str) -> None:
    """builder.add_tokens, naming the file and the position of a token outside the vocabulary."""
    try:
        builder.add_tokens(tokens)
    except InvalidArgumentError as e:
        raise out_of_vocabulary(path, tokens, start, vocab, source) or InvalidArgumentError(with_path(path, str(e))) from None


def build_static(inputs: Sequence[str | os.PathLike[str] | corpus.InputFile], output: str | os.PathLike[str], *,
                 vocab_size: int, fingerprint: bytes, tokenizer: Tokenizer | None = None, ngram_size: int = 2,
                 generation: int = 0, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 scratch_dir: str | os.PathLike[str] | None = None, threads: int = 0, corpus_index: bool = False,
                 index_depth: int = 32, vocabulary_source: str = "the vocabulary",
                 progress: Callable[[int, int], None] | None = None,
                 on_writing: Callable[[], None] | None = None, include: Sequence[str] = (),
                 exclude: Sequence[str] = ()) -> BuildResult:
    """Build a static cache from corpus files, streaming: bounded in memory whatever the corpus's size.

    Token files (.bin/.tokens raw int32, .npy with optional offsets) are read in chunks, each
    stream on its own; text files are tokenized in batches with ``tokenizer``. A file found in an
    input folder that is neither UTF-8 text nor a token file is skipped (``n_skipped`` says how
    many); one named directly is refused. Sorted runs past
    ``memory_budget`` spill beside the output (or into ``scratch_dir``). The file is written
    atomically: an error or Ctrl-C leaves any previous ``output`` as it was.

    Args:
        inputs: files and folders (expanded recursively by `corpus.collect_inputs`, hidden
            entries and ``__pycache__`` skipped), or `corpus.InputFile` items already collected.
        output: the static cache to write.
        vocab_size, fingerprint: the tokenizer's (``UNTAGGED`` for raw token ids).
        tokenizer: tokenizes text inputs; required when there are any.
        ngram_size, generation, corpus_index, index_depth: as the file records them.
        memory_budget, scratch_dir, threads: the builder's resources. ``memory_budget`` bounds the core's
            counting buffers (sorted runs spill to ``scratch_dir`` beyond it) and sizes the text batches
            (1/32 of it, 1..8 MiB); Python, the tokenizer's tables and a batch being tokenized (about 10
            times its size) come on top.
        vocabulary_source: names where the vocabulary comes from, in errors.
        progress: called as reading goes, with (bytes read, tokens read) since the last call.
        on_writing: called once every input is read, before the sort and write (the long, silent part).
        include, exclude: globs choosing the files of input folders (see `corpus.collect_inputs`).

    Returns:
        What was written; with a corpus index that left tokens out (``n_not_indexed``), an
        `IndexBudgetWarning` is raised as well.

    Raises:
        InvalidArgumentError: a missing input, text inputs without a tokenizer, a token outside
            the vocabulary (naming the file and position), or no stream long enough to hold
            one (n-gram, follower) pair (nothing is written then).
        OSError: a file that cannot be read or written.
    """
    items = [i if isinstance(i, corpus.InputFile) else None for i in inputs]
    paths = [os.fspath(i) for i in inputs if not isinstance(i, corpus.InputFile)]
    collected = [i for i in items if i is not None] + (corpus.collect_inputs(paths, include, exclude) if paths else [])
    if tokenizer is None and any(i.kind == "text" for i in collected):
        raise InvalidArgumentError("text inputs need a tokenizer")
    report = progress or (lambda done, tokens: None)
    builder = StaticBuilder(output, vocab_size, ngram_size, fingerprint=fingerprint, generation=generation,
                            memory_budget=memory_budget, scratch_dir=os.fspath(scratch_dir or ""), threads=threads,
                            corpus_index=corpus_index, index_depth=index_depth)
    t0 = time.perf_counter()
    t_tokenize = 0.0
    longest = 0  # tokens of the longest stream: with none above ngram_size there is no pair to count
    for item in (i for i in collected if i.kind != "text"):
        position = 0  # in tokens, from the start of the file
        for stream in corpus.token_streams(item):
            builder.begin_stream()
            length = 0
            for chunk in stream:
                _add_tokens(builder, item.path, chunk, position, vocab_size, vocabulary_source)
                position += len(chunk)
                length += len(chunk)
                report(4 * len(chunk), len(chunk))
            longest = max(longest, length)
    skipped = corpus.Skipped()
    for batch in corpus.text_batches([i for i in collected if i.kind == "text"], corpus.text_batch_bytes(memory_budget)):
        assert tokenizer is not None  # checked above
        n_before = skipped.count
        kept, texts = corpus.read_texts(batch, skipped)
        if skipped.count > n_before:
            report(sum(i.size for i in batch) - sum(i.size for i in kept), 0)
        ts = time.perf_counter()
        encoded = tokenizer.encode_batch(texts)
        t_tokenize += time.perf_counter() - ts
        for item, tokens in zip(kept, encoded):
            builder.begin_stream()
            _add_tokens(builder, item.path, tokens, 0, vocab_size, vocabulary_source)
            longest = max(longest, len(tokens))
            report(item.size, len(tokens))
    if longest <= ngram_size:
        raise InvalidArgumentError(
            f"nothing to build: no input stream holds more than {ngram_size} tokens (the longest has {longest}), "
            f"so there is no ({ngram_size}-gram, follower) pair to count; {os.fspath(output)} was not written")
    if on_writing is not None:
        on_writing()
    stats = builder.finish()
    result = _result(output, stats, n_inputs=len(collected) - skipped.count, seconds=time.perf_counter() - t0,
                     tokenize_seconds=t_tokenize, n_skipped=skipped.count, skipped_example=skipped.example)
    if corpus_index:
        _warn_if_not_indexed(result, memory_budget)
    return result
