"""CountTable: llama.cpp update semantics, growth, heavy collisions, merge, integrity."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import reference
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramcache import MAX_VOCAB, CountTable, InvalidArgumentError, ngram_hash


def arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def as_table(t: CountTable):
    return reference.rows_to_table(t.to_rows())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 8), max_size=120),
    st.integers(0, 130),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_update_matches_llama_semantics(tokens, n_new, ngram_min, extra):
    ngram_max = min(4, ngram_min + extra)
    n_new = min(n_new, len(tokens))
    t = CountTable()
    t.update(arr(tokens), n_new, ngram_min, ngram_max)
    t.check_integrity()
    want = reference.new_table()
    reference.update(want, tokens, n_new, ngram_min, ngram_max)
    assert as_table(t) == want
    assert t.n_keys == len(want)
    assert t.n_entries == sum(len(v) for v in want.values())


def test_incremental_updates_equal_one_update():
    rng = np.random.default_rng(0)
    tokens = arr(rng.integers(0, 20, 2000))
    whole, parts = CountTable(), CountTable()
    whole.update(tokens)
    for end in range(0, len(tokens) + 1, 37):
        parts.update(tokens[:end], min(37, end))
        parts.check_integrity()
    parts.update(tokens, len(tokens) % 37)
    assert as_table(whole) == as_table(parts)


def test_growth_keeps_every_key():
    t = CountTable()
    rng = np.random.default_rng(1)
    keys = rng.integers(0, MAX_VOCAB, size=(50_000, 2))
    sizes = []
    for i, (a, b) in enumerate(keys.tolist()):
        t.add([a, b], i % 1000, 1 + i % 3)
        if i % 5000 == 0:
            t.check_integrity()
            sizes.append(t.memory_bytes())
    t.check_integrity()
    assert sizes == sorted(sizes)
    unique = {(a, b) for a, b in keys.tolist()}
    assert t.n_keys == len(unique)
    for i, (a, b) in enumerate(keys[:2000].tolist()):
        toks, _ = t.lookup([a, b])
        assert i % 1000 in toks.tolist()


def test_heavy_collisions():
    """Keys whose hashes agree in their low 12 bits all start probing at the same slot."""
    rng = np.random.default_rng(2)
    colliding: list[list[int]] = []
    while len(colliding) < 400:  # one in 4,096 keys qualifies: drawn in bulk, not one rng call a key
        colliding += [key for key in rng.integers(0, 1 << 20, (200_000, 3)).tolist() if ngram_hash(key) & 0xFFF == 0x5A5]
    colliding = colliding[:400]
    t = CountTable()
    for i, key in enumerate(colliding):
        t.add(key, i, i + 1)
        if i % 50 == 0:
            t.check_integrity()
    t.check_integrity()
    for i, key in enumerate(colliding):
        toks, counts = t.lookup(key)
        assert toks.tolist() == [i] and counts.tolist() == [i + 1]
    # Absent keys with the same home slot are still reported absent.
    probe = rng.integers(1 << 21, 1 << 22, 3).tolist()
    assert t.lookup(probe)[0].size == 0


def test_merge_sums_counts():
    rng = np.random.default_rng(3)
    a, b = CountTable(), CountTable()
    sa, sb = rng.integers(0, 9, 800), rng.integers(0, 9, 800)
    a.update(arr(sa))
    b.update(arr(sb))
    want = reference.new_table()
    reference.update(want, sa.tolist(), len(sa))
    reference.update(want, sb.tolist(), len(sb))
    a.merge(b)
    a.check_integrity()
    b.check_integrity()
    assert as_table(a) == want
    with pytest.raises(InvalidArgumentError, match="itself"):
        a.merge(a)


def test_followers_sorted_and_counts_saturate():
    t = CountTable()
    for tok in [9, 3, 7, 3, 1]:
        t.add([5], tok)
    toks, counts = t.lookup([5])
    assert toks.tolist() == [1, 3, 7, 9] and counts.tolist() == [1, 2, 1, 1]
    t.add([6], 1, 2**32 - 1)
    t.add([6], 1, 5)
    assert t.lookup([6])[1].tolist() == [2**32 - 1]
    t.check_integrity()


def test_add_rows_is_all_or_nothing():
    t = CountTable()
    good = arr([[2, 1, 2, -1, -1, 3, 4], [1, 7, -1, -1, -1, 8, 1]])
    t.add_rows(good)
    assert t.n_entries == 2
    for bad, message in [
        ([[2, 1, 2, -1, -1, 3, 4], [5, 1, 2, 3, 4, 5, 1]], "n-gram size 5"),
        ([[2, 1, 2, -1, -1, 3, 4], [2, 1, 2, 3, -1, 5, 1]], "past the n-gram must be -1"),
        ([[2, 1, 2, -1, -1, 3, 4], [2, 1, -4, -1, -1, 5, 1]], "outside the vocabulary"),
        ([[2, 1, 2, -1, -1, 3, 4], [2, 1, 2, -1, -1, 5, 0]], "count 0 is outside"),
        ([[2, 1, 2, -1, -1, 3, 4], [2, 1, 2, -1, -1, -5, 1]], "follower -5 is outside the vocabulary"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            t.add_rows(arr(bad))
        assert t.n_entries == 2 and t.lookup([1, 2])[1].tolist() == [4]
    with pytest.raises(InvalidArgumentError, match="shape"):
        t.add_rows(arr([1, 2, 3]))
    t.check_integrity()


def test_bad_arguments():
    t = CountTable()
    with pytest.raises(ValueError, match="ngram_min"):
        t.update(arr([1, 2]), ngram_min=0)
    with pytest.raises(ValueError, match="n_new"):
        t.update(arr([1, 2]), 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        t.update(arr([1, -2]))
    with pytest.raises(ValueError, match="1..4 tokens"):
        t.lookup([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="count"):
        t.add([1], 2, 0)
    assert t.n_keys == 0


def test_clear_and_memory():
    t = CountTable()
    t.update(arr(list(range(100)) * 3))
    assert t.memory_bytes() > 0 and len(t) == t.n_keys > 0
    t.clear()
    t.check_integrity()
    assert t.n_keys == 0 and t.n_entries == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "update", "merge", "clear"]),
                          st.lists(st.integers(0, 6), min_size=1, max_size=12)), max_size=60))
def test_integrity_after_every_change(ops):
    """Random sequences of every mutation, with check_integrity() after each one."""
    t, want = CountTable(), reference.new_table()
    for op, tokens in ops:
        if op == "add":
            key, follower = tokens[: 1 + len(tokens) % 4], tokens[-1]
            t.add(key, follower, len(tokens))
            want[tuple(key)][follower] += len(tokens)
        elif op == "update":
            t.update(arr(tokens))
            reference.update(want, tokens, len(tokens))
        elif op == "merge":
            other = CountTable()
            other.update(arr(tokens), ngram_min=2, ngram_max=3)
            t.merge(other)
            reference.update(want, tokens, len(tokens), 2, 3)
        else:
            t.clear()
            want = reference.new_table()
        t.check_integrity()
    assert as_table(t) == {k: dict(v) for k, v in want.items() if v}


def test_assign_rows_upserts_absolute_counts():
    t = CountTable()
    t.add([1, 2], 3, 5)
    t.add([1, 2], 4, 9)
    rows = np.array([[2, 1, 2, -1, -1, 3, 7],      # overwrite 5 -> 7
                     [2, 1, 2, -1, -1, 4, 2],      # the maximum goes down: 9 -> 2
                     [1, 6, -1, -1, -1, 0, 1],     # a new key
                     [3, 1, 2, 3, -1, 5, 1 << 40]],  # saturates
                    dtype=np.int64)
    t.assign_rows(rows)
    assert t.lookup([1, 2])[1].tolist() == [7, 2]
    assert t.lookup([6])[0].tolist() == [0]
    assert t.lookup([1, 2, 3])[1].tolist() == [(1 << 32) - 1]
    t.check_integrity()
    t.assign_rows(rows)  # idempotent: absolute, not added
    assert t.lookup([1, 2])[1].tolist() == [7, 2]
    t.check_integrity()


def test_assign_rows_is_all_or_nothing():
    t = CountTable()
    t.add([1, 2], 3, 5)
    bad = np.array([[2, 1, 2, -1, -1, 3, 8], [2, 1, 2, -1, -1, 4, 0]], dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match="row 1: count 0"):
        t.assign_rows(bad)
    assert t.lookup([1, 2])[1].tolist() == [5]
    with pytest.raises(InvalidArgumentError, match="int64"):
        t.assign_rows(bad.astype(np.int32))


def test_assign_rows_matches_a_reference_upsert():
    rng = np.random.default_rng(9)
    t, ref = CountTable(), {}
    for _ in range(20):
        m = 300
        rows = np.full((m, 7), -1, dtype=np.int64)
        n = rng.integers(1, 5, m)
        rows[:, 0] = n
        for i in range(m):
            rows[i, 1:1 + n[i]] = rng.integers(0, 6, n[i])
        rows[:, 5] = rng.integers(0, 6, m)
        rows[:, 6] = rng.integers(1, 50, m)
        t.assign_rows(rows)
        for r in rows.tolist():
            ref[(tuple(r[1:1 + r[0]]), r[5])] = r[6]
        t.check_integrity()
    got = {(tuple(r[1:1 + r[0]]), r[5]): r[6] for r in t.to_rows().tolist()}
    assert got == ref


def test_parallel_writers_and_readers_equal_a_serial_run():
    """Four threads adding to one table at once (update a stream at a time, add_rows, merge) while
    two threads read it: the table ends with exactly the counts of the same operations done
    serially, and no reader sees a count go down. tests/native/test_sanitizers.py reruns this under
    ThreadSanitizer."""
    import threading

    rng = np.random.default_rng(21)
    streams = [arr(rng.integers(0, 40, 20_000)) for _ in range(2)]
    rows = np.full((3000, 7), -1, dtype=np.int32)
    rows[:, 0] = 2
    rows[:, 1:3] = rng.integers(0, 40, (3000, 2))
    rows[:, 5] = rng.integers(0, 40, 3000)
    rows[:, 6] = rng.integers(1, 9, 3000)
    other = CountTable()
    other.update(arr(rng.integers(0, 40, 5000)))
    probes = [streams[0][i:i + 2].tolist() for i in range(0, 1000, 20)]

    def update_in_steps(table: CountTable, tokens: np.ndarray) -> None:
        for end in range(500, len(tokens) + 1, 500):
            table.update(tokens[:end], n_new=500)

    def add_rows_in_chunks(table: CountTable) -> None:
        for i in range(0, len(rows), 100):
            table.add_rows(rows[i:i + 100])

    serial = CountTable()
    for s in streams:
        update_in_steps(serial, s)
    add_rows_in_chunks(serial)
    serial.merge(other)

    table = CountTable()
    errors: list[BaseException] = []
    went_down: list[tuple[list[int], int, int]] = []
    writers_done = threading.Event()

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    def reader():
        last = [0] * len(probes)
        while not writers_done.is_set():
            for j, key in enumerate(probes):
                total = int(table.lookup(key)[1].sum())
                if total < last[j]:
                    went_down.append((key, last[j], total))
                last[j] = total

    writers = [threading.Thread(target=guarded, args=(update_in_steps, table, s)) for s in streams]
    writers += [threading.Thread(target=guarded, args=(add_rows_in_chunks, table)),
                threading.Thread(target=guarded, args=(table.merge, other))]
    readers = [threading.Thread(target=guarded, args=(reader,)) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    writers_done.set()
    for t in readers:
        t.join()
    assert not errors and not went_down
    table.check_integrity()
    assert sorted(map(tuple, table.to_rows().tolist())) == sorted(map(tuple, serial.to_rows().tolist()))
