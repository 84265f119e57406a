"""The native drafter against the pure-Python reference (tests/helpers/reference.py)."""

from __future__ import annotations

import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramcache import (
    UNTAGGED,
    CountTable,
    Drafter,
    InvalidArgumentError,
    StaticCache,
    TokenizerMismatchError,
    build_static_from_tokens,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def arr(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def build_static(streams, vocab: int, k: int = 2, fingerprint: bytes = UNTAGGED, generation: int = 0):
    fd, path = tempfile.mkstemp(suffix=".ngc")
    os.close(fd)
    build_static_from_tokens([arr(s) for s in streams], path, vocab_size=vocab, ngram_size=k, fingerprint=fingerprint,
                             generation=generation)
    cache = StaticCache.open(path)
    os.unlink(path)  # the mapping keeps the file alive
    return cache


def check_replay(seq, vocab, n_draft, static_streams, dynamic_streams, ngram_min=1, ngram_max=4, k=2):
    """Accepts `seq` token by token and compares every draft with the reference."""
    static = build_static(static_streams, vocab, k) if static_streams is not None else None
    ref_static = reference.count_static(static_streams, k) if static_streams is not None else None
    dynamic, ref_dynamic = None, None
    if dynamic_streams is not None:
        dynamic, ref_dynamic = CountTable(), reference.new_table()
        for s in dynamic_streams:
            dynamic.update(arr(s), ngram_min=ngram_min, ngram_max=ngram_max)
            reference.update(ref_dynamic, s, len(s), ngram_min, ngram_max)
    drafter = Drafter(static=static, dynamic=dynamic, vocab_size=vocab, fingerprint=UNTAGGED, ngram_min=ngram_min, ngram_max=ngram_max)
    ref_context = reference.new_table()
    tokens = arr(seq)
    n_drafted = 0
    for i in range(len(seq) + 1):
        prefix = tokens[:i]
        drafter.accept(7, prefix)
        reference.update(ref_context, seq[:i], 1 if i else 0, ngram_min, ngram_max)
        got = drafter.draft(7, prefix, n_draft).tolist()
        want = reference.draft(seq[:i], n_draft, ref_context, ref_dynamic, ref_static, k, ngram_min, ngram_max)
        assert got == want, f"prefix {i}: got {got}, want {want}"
        n_drafted += len(got)
    return n_drafted


tokens_st = lambda vocab, max_len: st.lists(st.integers(0, vocab - 1), max_size=max_len)  # noqa: E731


@st.composite
def scenario(draw):
    vocab = draw(st.integers(2, 10))
    seq = draw(tokens_st(vocab, 80))
    static = draw(st.none() | st.lists(tokens_st(vocab, 120), max_size=3))
    dynamic = draw(st.none() | st.lists(tokens_st(vocab, 120), max_size=3))
    ngram_min = draw(st.integers(1, 4))
    ngram_max = draw(st.integers(ngram_min, 4))
    k = draw(st.sampled_from([2, 2, 1, 3]))
    return vocab, seq, static, dynamic, draw(st.integers(1, 12)), ngram_min, ngram_max, k


@SETTINGS
@given(scenario())
def test_random_streams_match_reference(case):
    vocab, seq, static, dynamic, n_draft, ngram_min, ngram_max, k = case
    check_replay(seq, vocab, n_draft, static, dynamic, ngram_min, ngram_max, k)


@SETTINGS
@given(st.integers(2, 6), st.lists(st.integers(0, 5), max_size=200), st.integers(1, 16))
def test_context_only_matches_reference(vocab, seq, n_draft):
    check_replay([t % vocab for t in seq], vocab, n_draft, None, None)


def real_streams() -> list[list[int]]:
    """Real text nobody here wrote: CPython's standard library, as byte tokens (vocab 256)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py"]
    return [list(lib.joinpath(n).read_bytes()) for n in names if lib.joinpath(n).exists()]


@pytest.mark.parametrize("with_static", [False, True])
@pytest.mark.parametrize("with_dynamic", [False, True])
def test_real_streams_match_reference(with_static, with_dynamic):
    streams = real_streams()
    assert len(streams) >= 4
    test_seq = streams[0][:1500]
    n_drafted = check_replay(
        test_seq,
        256,
        8,
        streams[2:] if with_static else None,
        streams[1:3] if with_dynamic else None,
    )
    assert n_drafted > 500  # the comparison covers real drafts, not empty ones


@pytest.mark.parametrize("with_static", [False, True])
def test_real_tokenizer_streams_match_reference(with_static):
    """The same text tokenized with Qwen's tokenizer (vocabulary 151,851), as a worker sees it."""
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    tok = load_tokenizer("tiktoken:qwen")
    texts = [bytes(s).decode() for s in real_streams()]
    streams = [tok.encode(t).tolist() for t in texts]
    n_drafted = check_replay(streams[0][:1200], tok.vocab_size, 6, streams[1:] if with_static else None, streams[2:4])
    assert n_drafted > 200


def test_short_sequences_get_no_draft():
    static = build_static([[1, 2, 3, 1, 2, 3, 1, 2, 3]], 5)
    d = Drafter(static=static)
    assert d.draft(0, arr([]), 4).tolist() == []
    assert d.draft(0, arr([1]), 4).tolist() == []
    assert d.draft(0, arr([1, 2]), 4).tolist() == [3, 1, 2, 3]


def test_static_swap_changes_drafts():
    a = build_static([[1, 2, 3] * 5], 8)
    b = build_static([[1, 2, 4] * 5], 8)
    d = Drafter(static=a)
    assert d.draft(0, arr([1, 2]), 1).tolist() == [3]
    d.set_static(b)
    assert d.draft(0, arr([1, 2]), 1).tolist() == [4]
    with pytest.raises(TokenizerMismatchError, match="vocabulary size"):
        d.set_static(build_static([[1, 2, 3]], 9))


def test_bad_arguments_raise_value_error():
    d = Drafter(vocab_size=10, fingerprint=UNTAGGED)
    with pytest.raises(ValueError, match="dtype int32"):
        d.draft(0, np.array([1, 2, 3], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="numpy array of int32"):
        d.draft(0, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="1-D"):
        d.draft(0, np.zeros((2, 2), dtype=np.int32), 4)
    with pytest.raises(ValueError, match="contiguous"):
        d.draft(0, np.arange(10, dtype=np.int32)[::2], 4)
    with pytest.raises(ValueError, match="n_draft"):
        d.draft(0, arr([1, 2]), 0)
    with pytest.raises(ValueError, match="n_draft"):
        d.draft(0, arr([1, 2]), 100000)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.draft(0, arr([1, 10]), 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.accept(0, arr([1, -1]))
    with pytest.raises(ValueError, match="vocab_size"):
        Drafter()
    with pytest.raises(ValueError, match="ngram_min"):
        Drafter(vocab_size=10, fingerprint=UNTAGGED, ngram_min=3, ngram_max=2)


def test_accept_is_incremental_and_refuses_a_shrunk_sequence():
    d = Drafter(vocab_size=10, fingerprint=UNTAGGED)
    seq = arr([1, 2, 3, 1, 2, 3, 1, 2])
    d.accept(1, seq[:4])
    d.accept(1, seq)
    d.accept(1, seq)  # nothing new: no double counting
    ref = reference.new_table()
    reference.update(ref, seq.tolist(), len(seq))
    assert reference.rows_to_table(d.context_rows(1)) == ref
    with pytest.raises(ValueError, match="already accepted"):
        d.accept(1, seq[:3])
    assert d.reset(1) and not d.reset(1)
    d.accept(1, seq[:3])


def test_drain_deltas_returns_accepted_counts_once():
    d = Drafter(vocab_size=10, fingerprint=UNTAGGED, track_deltas=True)
    d.accept(1, arr([1, 2, 3, 1, 2]))
    d.accept(2, arr([4, 5, 4, 5]))
    rows = d.drain_deltas()
    assert rows.dtype == np.int32 and rows.shape[1] == 7
    want = reference.new_table()
    reference.update(want, [1, 2, 3, 1, 2], 5)
    reference.update(want, [4, 5, 4, 5], 4)
    assert reference.rows_to_table(rows) == want
    assert d.drain_deltas().shape == (0, 7)


def test_draft_does_not_copy_or_keep_the_input():
    d = Drafter(vocab_size=10, fingerprint=UNTAGGED)
    seq = arr([1, 2, 1, 2, 1, 2])
    d.accept(0, seq)
    before = seq.copy()
    assert d.draft(0, seq, 4).tolist() == [1, 2, 1, 2]
    assert (seq == before).all()


# --- Tokenizer binding -------------------------------------------------------------------

FP_A, FP_B = b"\xaa" * 32, b"\xbb" * 32


def test_drafter_is_bound_to_its_static_caches_tokenizer():
    d = Drafter(static=build_static([[1, 2, 3] * 5], 8, fingerprint=FP_A))
    assert d.fingerprint == FP_A and d.vocab_size == 8
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        d.set_static(build_static([[1, 2, 3] * 5], 8, fingerprint=FP_B))
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        d.set_static(build_static([[1, 2, 3] * 5], 8, fingerprint=UNTAGGED))
    with pytest.raises(TokenizerMismatchError, match="fingerprint differs"):
        Drafter(static=build_static([[1, 2, 3]], 8, fingerprint=FP_A), fingerprint=FP_B)
    with pytest.raises(TokenizerMismatchError, match="vocab_size 9"):
        Drafter(static=build_static([[1, 2, 3]], 8, fingerprint=FP_A), vocab_size=9)
    assert d.draft(0, arr([1, 2]), 1).tolist() == [3]  # the refused swaps changed nothing


def test_drafter_without_static_needs_an_explicit_tokenizer():
    with pytest.raises(InvalidArgumentError, match="needs vocab_size and fingerprint"):
        Drafter(vocab_size=10)
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        Drafter(vocab_size=10, fingerprint=b"short")
    d = Drafter(vocab_size=8, fingerprint=FP_A)
    d.set_static(build_static([[1, 2, 3] * 5], 8, fingerprint=FP_A))
    assert d.draft(0, arr([1, 2]), 1).tolist() == [3]


def test_older_generation_is_refused_newer_and_equal_accepted():
    d = Drafter(static=build_static([[1, 2, 3] * 5], 8, generation=5))
    with pytest.raises(InvalidArgumentError, match="generation 4 is older than the attached generation 5"):
        d.set_static(build_static([[1, 2, 4] * 5], 8, generation=4))
    assert d.draft(0, arr([1, 2]), 1).tolist() == [3]
    d.set_static(build_static([[1, 2, 4] * 5], 8, generation=5))
    d.set_static(build_static([[1, 2, 5] * 5], 8, generation=6))
    assert d.static.generation == 6 and d.draft(0, arr([1, 2]), 1).tolist() == [5]
    d.set_static(None)
    assert d.draft(0, arr([1, 2]), 1).tolist() == []


def test_wrong_types_give_type_errors_not_internal_ones(tmp_path):
    with pytest.raises(TypeError, match=r"StaticCache.open\(path\)"):
        Drafter(static="x.ngc")
    with pytest.raises(TypeError, match=r"StaticCache.open\(path\)"):
        Drafter(static=tmp_path / "x.ngc")
    with pytest.raises(TypeError, match="must be a CountTable"):
        Drafter(vocab_size=8, fingerprint=UNTAGGED, dynamic={})


def test_paths_may_be_pathlike(tmp_path):
    path = tmp_path / "p.ngc"
    build_static_from_tokens([arr([1, 2, 3] * 4)], path, vocab_size=8, fingerprint=UNTAGGED)
    assert StaticCache.open(path).n_keys == 3


# --- Bounded sequences ---------------------------------------------------------------------


def test_max_sequences_evicts_the_least_recently_used():
    d = Drafter(vocab_size=10, fingerprint=UNTAGGED, max_sequences=3)
    for s in range(3):
        d.accept(s, arr([1, 2, 3, 1, 2]))
    d.draft(0, arr([1, 2]), 2)  # sequence 0 is now the most recently used
    d.accept(3, arr([4, 5, 4, 5]))
    assert d.n_sequences == 3 and d.n_evicted == 1
    assert d.context_rows(1).shape[0] == 0  # 1 was the least recently used
    assert d.context_rows(0).shape[0] > 0 and d.context_rows(3).shape[0] > 0
    d.accept(1, arr([1, 2, 3]))  # an evicted sequence starts again from nothing
    assert d.n_sequences == 3


def test_memory_cap_bounds_context_tables_and_reset_frees():
    rng = np.random.default_rng(3)
    d = Drafter(vocab_size=1000, fingerprint=UNTAGGED, max_memory=200_000)
    for s in range(50):
        d.accept(s, arr(rng.integers(0, 1000, 400)))
        assert d.memory_bytes() <= 200_000 + 100_000  # at most the sequence just accepted over the cap
    assert d.n_evicted > 0 and d.memory_bytes() <= 200_000
    before = d.memory_bytes()
    assert d.reset(49) and d.memory_bytes() < before
    for s in range(50):
        d.reset(s)
    assert d.memory_bytes() == 0 and d.n_sequences == 0


def test_idle_ttl_evicts_unused_sequences():
    import time

    d = Drafter(vocab_size=10, fingerprint=UNTAGGED, idle_ttl=0.05)
    d.accept(1, arr([1, 2, 3]))
    d.accept(2, arr([1, 2, 3]))
    time.sleep(0.12)
    d.accept(2, arr([1, 2, 3, 4]))
    assert d.evict_idle() == 1 and d.n_sequences == 1 and d.context_rows(2).shape[0] > 0


def test_bad_limits_are_refused():
    for kw, msg in [({"max_sequences": -1}, "max_sequences"), ({"idle_ttl": float("nan")}, "idle_ttl"),
                    ({"idle_ttl": -1.0}, "idle_ttl"), ({"max_memory": -5}, "max_memory")]:
        with pytest.raises(InvalidArgumentError, match=msg):
            Drafter(vocab_size=10, fingerprint=UNTAGGED, **kw)


# --- Concurrency ---------------------------------------------------------------------------


def writer_rows(rng, n: int, vocab: int) -> np.ndarray:
    """n int32 count rows of bigram keys whose tokens are all in [7, vocab): keys no sequence of
    tokens 0..6 (or draft of them) ever looks up."""
    rows = np.full((n, 7), -1, dtype=np.int32)
    rows[:, 0] = 2
    rows[:, 1:3] = rng.integers(7, vocab, (n, 2))
    rows[:, 5] = rng.integers(0, vocab, n)
    rows[:, 6] = rng.integers(1, 100, n)
    return rows


def sorted_rows(table: CountTable) -> list[tuple[int, ...]]:
    return sorted(map(tuple, table.to_rows().tolist()))


def test_parallel_drafts_equal_serial_drafts_while_the_mirror_and_static_change():
    """Two threads accepting and drafting sequences of their own, while two writers add count rows
    to the dynamic table and the static cache is swapped for a newer generation of the same counts:
    every draft equals the serial run's, and the dynamic table ends with exactly the counts the
    rows add serially. The writers' keys hold tokens the sequences never do, so no draft may depend
    on when a write lands. tests/native/test_sanitizers.py reruns this under ThreadSanitizer."""
    import threading

    rng = np.random.default_rng(5)
    vocab = 50
    seqs = [arr(rng.integers(0, 7, 600)) for _ in range(8)]
    older = build_static([s.tolist() for s in seqs[:4]], vocab, generation=1)
    newer = build_static([s.tolist() for s in seqs[:4]], vocab, generation=2)
    writes = [[writer_rows(rng, 2000, vocab) for _ in range(20)] for _ in range(2)]
    points = range(2, 300, 7)

    def accept_and_draft(d: Drafter, i: int) -> list[list[int]]:
        drafts = []
        for n in points:
            d.accept(i, seqs[i][:n])
            drafts.append(d.draft(i, seqs[i][:n], 8).tolist())
        return drafts

    # Serial: one thread, sequence after sequence, then the writes.
    serial_drafter = Drafter(static=older, dynamic=CountTable())
    serial = {i: accept_and_draft(serial_drafter, i) for i in range(len(seqs))}
    # ... and the drafts at the same points once every sequence holds its first 296 tokens.
    serial_after = {i: [serial_drafter.draft(i, seqs[i][:n], 8).tolist() for n in points] for i in range(len(seqs))}
    assert sum(len(x) for drafts in serial.values() for x in drafts) > 1000  # the drafts are not empty
    serial_dynamic = CountTable()
    for rows_list in writes:
        for rows in rows_list:
            serial_dynamic.add_rows(rows)

    # Concurrent: the same operations at once; each drafter thread then drafts at the same points
    # again until the writers are done, so drafts overlap every write.
    dynamic = CountTable()
    d = Drafter(static=older, dynamic=dynamic)
    results: dict[int, list[list[int]]] = {}
    redrafts: list[tuple[int, int, list[int]]] = []  # (sequence, length, draft) that differ from serial
    errors: list[BaseException] = []
    writers_done = threading.Event()

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:
                errors.append(e)
        return run

    @guarded
    def drafter_thread(ids):
        for i in ids:
            results[i] = accept_and_draft(d, i)
        while not writers_done.is_set():
            for i in ids:
                for k, n in enumerate(points):
                    got = d.draft(i, seqs[i][:n], 8).tolist()
                    if got != serial_after[i][k]:
                        redrafts.append((i, n, got))

    @guarded
    def writer_thread(rows_list):
        for rows in rows_list:
            dynamic.add_rows(rows)

    @guarded
    def swap_static():
        while dynamic.n_keys == 0 and not writers_done.is_set():
            pass
        d.set_static(newer)

    drafters = [threading.Thread(target=drafter_thread, args=(ids,)) for ids in ([0, 2, 4, 6], [1, 3, 5, 7])]
    writers = [threading.Thread(target=writer_thread, args=(w,)) for w in writes]
    swapper = threading.Thread(target=swap_static)
    for t in [*drafters, *writers, swapper]:
        t.start()
    for t in [*writers, swapper]:
        t.join()
    writers_done.set()
    for t in drafters:
        t.join()
    assert not errors
    assert results == serial
    assert redrafts == []
    assert d.static is newer
    dynamic.check_integrity()
    assert sorted_rows(dynamic) == sorted_rows(serial_dynamic)


def test_drain_deltas_counts_exactly_past_the_fold_threshold():
    """More than 4M occurrences between two drains are folded into a table as they come;
    the drained counts stay exact."""
    rng = np.random.default_rng(11)
    tokens = arr(rng.integers(0, 40, 1_100_000))  # 4 sizes x 1.1M positions > 2^22 occurrences
    d = Drafter(vocab_size=40, fingerprint=UNTAGGED, track_deltas=True)
    d.accept(1, tokens[:600_000])
    d.accept(1, tokens)
    got = d.drain_deltas()
    want = CountTable()
    want.update(tokens)
    def ordered(rows: np.ndarray) -> np.ndarray:  # millions of rows: sorted by numpy, not as Python tuples
        return rows[np.lexsort(rows.T[::-1])]

    expected = want.to_rows()
    assert got.shape == expected.shape and np.array_equal(ordered(got), ordered(expected))
    assert d.drain_deltas().shape == (0, 7)
