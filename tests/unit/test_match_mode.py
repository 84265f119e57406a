"""The match mode: the corpus index of format version 2 (round trips, longest matches against
brute force, every hostile case its format doc names) and the longest-match drafter."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ngramcache import (
    UNTAGGED,
    CacheFormatError,
    Drafter,
    InvalidArgumentError,
    StaticCache,
    build_static_from_tokens,
    checksum64,
)
from ngramcache.client import _core

HEADER = 128
ENTRY = 32
NAMES = ["ROWS", "KEYS", "STARTS", "TOTALS", "FOLLOWERS", "OVERFLOW", "TEXT", "SUFFIXES", "BUCKETS"]
SEPARATOR = 0xFFFFFFFF


def build(path, streams, vocab=8, corpus_index=True):
    build_static_from_tokens([np.asarray(s, dtype=np.int32) for s in streams], str(path), vocab_size=vocab,
                             fingerprint=UNTAGGED, corpus_index=corpus_index)
    return path.read_bytes()


def table(data: bytes) -> list[tuple[int, int, int, int]]:
    n = struct.unpack_from("<I", data, 28)[0]
    return [struct.unpack_from("<IxxxxQQQ", data, HEADER + i * ENTRY) for i in range(n)]


def section(data: bytes, name: str) -> np.ndarray:
    _, off, length, _ = table(data)[NAMES.index(name)]
    return np.frombuffer(data, dtype=np.uint32, count=length // 4, offset=off).copy()


def put_section(data: bytearray, name: str, values: np.ndarray) -> bytearray:
    """Writes a section's values and reseals its checksum and the header: damage only the
    structure, so the check that catches it is the one under test."""
    i = NAMES.index(name)
    _, off, length, _ = table(bytes(data))[i]
    raw = np.asarray(values, dtype=np.uint32).tobytes()
    assert len(raw) == length
    data[off:off + length] = raw
    struct.pack_into("<Q", data, HEADER + i * ENTRY + 24, checksum64(raw))
    return reseal(data)


def reseal(data: bytearray) -> bytearray:
    n = struct.unpack_from("<I", data, 28)[0]
    end = HEADER + n * ENTRY
    scratch = bytearray(data[:end])
    scratch[120:128] = b"\0" * 8
    struct.pack_into("<Q", data, 120, checksum64(bytes(scratch)))
    return data


def open_bytes(tmp_path, data, name="bad.ngc") -> StaticCache:
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return StaticCache.open(str(p))


def brute_match(streams, tail, depth=32):
    """The longest suffix of `tail` (<= depth tokens) inside one stream, and its occurrences."""
    best, count = 0, 0
    for length in range(1, min(depth, len(tail)) + 1):
        pattern = list(tail[-length:])
        c = sum(1 for s in streams for i in range(len(s) - length + 1) if list(s[i:i + length]) == pattern)
        if c == 0:
            break
        best, count = length, c
    return best, count


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(3)
    streams = [rng.integers(0, 4, n) for n in (400, 17, 1, 250)]
    return streams, build(tmp_path / "c.ngc", streams, vocab=8)


def test_round_trip_version_2_and_version_1_without_index(tmp_path, corpus):
    streams, data = corpus
    c = StaticCache.open(str(tmp_path / "c.ngc"))
    assert c.format_version == 2 and c.index_depth == 32
    assert c.n_indexed == sum(len(s) for s in streams)
    assert [s["name"] for s in c.sections] == NAMES
    c.verify()
    # TEXT: the streams with a separator between two; SUFFIXES one entry per token.
    text = section(data, "TEXT")
    assert len(text) == sum(len(s) for s in streams) + len(streams) - 1
    assert (text == SEPARATOR).sum() == len(streams) - 1
    assert sorted(section(data, "SUFFIXES")) == [i for i, t in enumerate(text) if t != SEPARATOR]
    # Without the index: version 1, and the count sections are the same bytes.
    plain = build(tmp_path / "p.ngc", streams, vocab=8, corpus_index=False)
    p = StaticCache.open(str(tmp_path / "p.ngc"))
    assert p.format_version == 1 and p.index_depth == 0 and p.n_indexed == 0 and len(p.sections) == 6
    for name in NAMES[:6]:
        assert section(plain, name).tobytes() == section(data, name).tobytes(), name
    assert p.corpus_match(np.array([1, 2], dtype=np.int32)) == (0, 0)


def test_corpus_match_is_the_longest_suffix_in_one_stream(tmp_path, corpus):
    streams, _ = corpus
    c = StaticCache.open(str(tmp_path / "c.ngc"))
    rng = np.random.default_rng(4)
    for trial in range(300):
        if trial % 2:  # a piece of the corpus, so long matches happen, sometimes across a stream's end
            s = streams[trial % len(streams)]
            end = int(rng.integers(1, len(s) + 1))
            tail = np.concatenate([rng.integers(0, 4, int(rng.integers(0, 3))), s[max(0, end - 40):end]])
        else:
            tail = rng.integers(0, 5, int(rng.integers(1, 12)))  # token 4 never occurs
        tail = tail.astype(np.int32)
        assert c.corpus_match(tail) == brute_match(streams, tail), tail


def test_a_match_never_spans_two_streams(tmp_path):
    c_path = tmp_path / "s.ngc"
    build(c_path, [[1, 2, 3], [4, 5, 6]], vocab=8)
    c = StaticCache.open(str(c_path))
    assert c.corpus_match(np.array([3, 4], dtype=np.int32)) == (1, 1)
    assert c.corpus_match(np.array([2, 3], dtype=np.int32)) == (2, 1)


def test_index_depth_bounds_the_match(tmp_path):
    from ngramcache.client._core import StaticBuilder

    path = tmp_path / "d.ngc"
    b = StaticBuilder(str(path), 8, 2, fingerprint=UNTAGGED, corpus_index=True, index_depth=3)
    b.begin_stream()
    b.add_tokens(np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 6], dtype=np.int32))
    b.finish()
    c = StaticCache.open(str(path))
    assert c.index_depth == 3
    c.verify()
    assert c.corpus_match(np.array([1, 2, 3, 4], dtype=np.int32)) == (3, 2)
    with pytest.raises(InvalidArgumentError, match="index_depth"):
        StaticBuilder(str(path), 8, 2, fingerprint=UNTAGGED, corpus_index=True, index_depth=65)


def test_the_index_takes_half_the_budget_and_says_what_it_left_out(tmp_path):
    from ngramcache.client._core import StaticBuilder

    path = tmp_path / "b.ngc"
    b = StaticBuilder(str(path), 8, 2, fingerprint=UNTAGGED, memory_budget=16 << 20, corpus_index=True)
    rng = np.random.default_rng(5)
    for _ in range(4):
        b.begin_stream()
        b.add_tokens(rng.integers(0, 8, 60_000).astype(np.int32))
    b.finish()
    st = b.stats
    assert st["n_tokens"] == 240_000 and st["n_not_indexed"] > 0
    assert st["n_indexed"] + st["n_not_indexed"] == 240_000
    c = StaticCache.open(str(path))
    assert c.n_indexed == st["n_indexed"] and c.n_tokens == 240_000
    c.verify()


# --- hostile files: open is O(1) and checks lengths; verify() checks the rest; a lookup in a
# --- damaged index gives a shorter match or none, never an out-of-bounds read.

def test_header_flags_and_lengths(tmp_path, corpus):
    _, data = corpus
    bad = bytearray(data)
    struct.pack_into("<I", bad, 108, 65)
    with pytest.raises(CacheFormatError, match="flags 0x00000041 are not valid for format version 2"):
        open_bytes(tmp_path, reseal(bad))
    bad = bytearray(data)
    struct.pack_into("<I", bad, 108, 0)
    with pytest.raises(CacheFormatError, match="index depth is 0 \\(both or neither must be zero\\)"):
        open_bytes(tmp_path, reseal(bad))
    bad = bytearray(data)
    i = NAMES.index("SUFFIXES")
    length = table(data)[i][2]
    struct.pack_into("<Q", bad, HEADER + i * ENTRY + 16, length + 2)
    with pytest.raises(CacheFormatError, match="SUFFIXES is .* not a whole number of entries"):
        open_bytes(tmp_path, reseal(bad))
    bad = bytearray(data)
    t = NAMES.index("TEXT")
    struct.pack_into("<Q", bad, HEADER + t * ENTRY + 16, length - 4)  # TEXT shorter than SUFFIXES
    with pytest.raises(CacheFormatError, match="more than TEXT's"):
        open_bytes(tmp_path, reseal(bad))
    bad = bytearray(data)
    j = NAMES.index("BUCKETS")
    struct.pack_into("<Q", bad, HEADER + j * ENTRY + 16, table(data)[j][2] - 4)
    with pytest.raises(CacheFormatError, match="BUCKETS is .* bytes, the header counts imply"):
        open_bytes(tmp_path, reseal(bad))
    bad = bytearray(data)
    struct.pack_into("<I", bad, 8, 1)  # version 1 with nine sections
    with pytest.raises(CacheFormatError, match="section count is 9, format version 1 has 6"):
        open_bytes(tmp_path, reseal(bad))


def lookups_survive(c: StaticCache) -> None:
    """Every kind of lookup on a damaged file returns something sane."""
    rng = np.random.default_rng(6)
    d = Drafter(c, mode="match")
    for i in range(200):
        tail = rng.integers(0, 8, int(rng.integers(1, 40))).astype(np.int32)
        length, count = c.corpus_match(tail)
        assert 0 <= length <= min(len(tail), c.index_depth) and count >= 0
        drafted = d.draft(i, tail, 8)
        assert len(drafted) <= 8 and all(0 <= t < c.vocab_size for t in drafted.tolist())
        tokens, parents = d.draft_tree(i, tail, 16)
        assert len(tokens) == len(parents) <= 16


@pytest.mark.parametrize("damage, message", [
    ("suffix_out_of_text", "is not a token position"),
    ("suffix_on_separator", "is not a token position"),
    ("suffix_twice", "lists position"),
    ("suffixes_unsorted", "not sorted|outside its bucket"),
    ("bucket_past_end", "BUCKETS does not span|not monotone"),
    ("bucket_not_monotone", "not monotone"),
    ("text_outside_vocabulary", "outside the vocabulary"),
])
def test_damaged_index_is_found_by_verify_and_never_read_out_of_bounds(tmp_path, corpus, damage, message):
    _, data = corpus
    bad = bytearray(data)
    sa, text, buckets = section(data, "SUFFIXES"), section(data, "TEXT"), section(data, "BUCKETS")
    if damage == "suffix_out_of_text":
        sa[5] = 0xFFFFFFF0
        put_section(bad, "SUFFIXES", sa)
    elif damage == "suffix_on_separator":
        sa[7] = int(np.flatnonzero(text == SEPARATOR)[0])
        put_section(bad, "SUFFIXES", sa)
    elif damage == "suffix_twice":
        sa[9] = sa[8]
        put_section(bad, "SUFFIXES", sa)
    elif damage == "suffixes_unsorted":
        put_section(bad, "SUFFIXES", sa[::-1].copy())
    elif damage == "bucket_past_end":
        buckets[2] = 0xFFFFFFF0
        put_section(bad, "BUCKETS", buckets)
    elif damage == "bucket_not_monotone":
        buckets[1], buckets[2] = buckets[2], buckets[1]
        put_section(bad, "BUCKETS", buckets)
    elif damage == "text_outside_vocabulary":
        text[3] = 1_000_000
        put_section(bad, "TEXT", text)
    c = open_bytes(tmp_path, bad)  # O(1): only lengths are checked at open
    with pytest.raises(CacheFormatError, match=message):
        c.verify()
    lookups_survive(c)


# What verify says of random 32-bit values in each section (the checksums resealed, so a structure check fires):
# a token past the vocabulary, a position past the text, a bucket bound past the suffixes or out of order.
RANDOM_DAMAGE = {"TEXT": r"TEXT\[\d+\] is outside the vocabulary",
                 "SUFFIXES": r"SUFFIXES\[\d+\] is not a token position",
                 "BUCKETS": "BUCKETS does not span SUFFIXES|BUCKETS is not monotone at token"}


def test_random_damage_never_reads_out_of_bounds(tmp_path, corpus):
    """Lookups on the damaged file stay in bounds (lookups_survive; the sanitizer runs catch a read past a
    section), and verify names the damaged section."""
    _, data = corpus
    rng = np.random.default_rng(7)
    for trial in range(30):
        bad = bytearray(data)
        name = NAMES[6 + trial % 3]
        values = section(data, name)
        idx = rng.integers(0, len(values), 4)
        values[idx] = rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32)
        put_section(bad, name, values)
        c = open_bytes(tmp_path, bad, name=f"r{trial}.ngc")
        lookups_survive(c)
        with pytest.raises(CacheFormatError, match=RANDOM_DAMAGE[name]):
            c.verify()


# --- the drafter


def test_match_mode_copies_the_sequence_the_history_and_the_corpus(tmp_path):
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    assert d.mode == "match"
    seq = np.array([*range(1, 13), 1, 2, 3], dtype=np.int32)
    d.accept(0, seq)
    assert list(d.draft(0, seq, 3)) == [4, 5, 6]
    # Another sequence matches what sequence 0 wrote (the history).
    other = np.array([50, 51, 7, 8], dtype=np.int32)
    d.accept(1, other)
    assert list(d.draft(1, other, 2)) == [9, 10]
    # A corpus index: a sequence that has seen nothing drafts from it.
    path = tmp_path / "k.ngc"
    build(path, [[60, 61, 62, 63, 64, 65, 66, 67]], vocab=100)
    c = StaticCache.open(str(path))
    dc = Drafter(c, mode="match")
    q = np.array([70, 61, 62, 63], dtype=np.int32)
    drafted = [int(t) for t in dc.draft(5, q, 8)]
    assert len(drafted) >= 2 and drafted == [64, 65, 66, 67][:len(drafted)]  # one occurrence: a short line


def test_the_history_outbox_holds_what_accept_added_with_its_offsets():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match", track_history=True)
    d.accept(1, np.array([1, 2, 3, 4], dtype=np.int32))  # the first accept (a prompt) stays a record of its own
    d.accept(1, np.array([1, 2, 3, 4, 5, 6], dtype=np.int32))
    d.accept(1, np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int32))  # merged with the record before
    d.accept(2, np.array([7, 8], dtype=np.int32))
    d.accept(1, np.array([1, 2, 3, 4, 5, 6, 7, 9], dtype=np.int32))  # another sequence came between
    records = [(seq, offset, list(t)) for seq, offset, t in d.drain_history()]
    assert records == [(1, 0, [1, 2, 3, 4]), (1, 4, [5, 6, 7]), (2, 0, [7, 8]), (1, 7, [9])]
    assert d.drain_history() == [] and d.history_dropped == 0
    # Without track_history nothing is kept; the compatible mode keeps an outbox too.
    quiet = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    quiet.accept(1, np.array([1, 2], dtype=np.int32))
    assert quiet.drain_history() == []
    compat = Drafter(vocab_size=100, fingerprint=UNTAGGED, track_history=True)
    compat.accept(3, np.array([5, 6, 7], dtype=np.int32))
    assert [(s, o, list(t)) for s, o, t in compat.drain_history()] == [(3, 0, [5, 6, 7])]


def test_add_history_lets_a_sequence_copy_what_another_drafter_generated():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    d.add_history(42, np.array([10, 11, 12, 13], dtype=np.int32))
    d.add_history(42, np.array([14, 15, 16, 17], dtype=np.int32))  # one text, continued
    assert d.history_size == 9  # a separator, then the 8 tokens
    seq = np.array([3, 12, 13, 14], dtype=np.int32)
    d.accept(5, seq)
    assert list(d.draft(5, seq, 3)) == [15, 16, 17]
    # Another source starts a new text: no match runs from one into the other.
    d.add_history(43, np.array([20, 21], dtype=np.int32))
    tail = np.array([3, 16, 17], dtype=np.int32)
    d.accept(6, tail)
    assert list(d.draft(6, tail, 4)) == []


def test_concurrent_sequences_keep_their_history_text_in_pieces():
    """Two sequences accepting in turn: the one that wrote last goes on at once, the other's tokens are held
    back until they make a piece (history_piece) that starts with the source's last tokens before it, so a
    draft runs on across pieces; reset and flush_history put the held-back rest in."""
    a, b = list(range(10, 40)), list(range(50, 80))

    def interleaved(piece: int) -> Drafter:
        d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match", match_params={"history_piece": piece})
        for k in range(2, 31, 2):  # a and b each accept 2 tokens a step
            d.accept(1, np.array(a[:k], dtype=np.int32))
            d.accept(2, np.array(b[:k], dtype=np.int32))
        return d

    cut = interleaved(1)
    assert cut.history_size == 60 + 30  # a separator before every 2 tokens
    d = interleaved(8)
    before = d.history_size
    d.reset(2)
    held = d.flush_history(0.0)
    assert d.flush_history(0.0) == 0
    assert d.history_size - before >= held
    # A match of 8 tokens drafts up to 8 (length_factor 1): across the pieces' ends (b's first piece ends at 63).
    for seq, probe, follow in ((7, [90, *range(55, 63)], range(63, 71)), (8, [91, *range(15, 23)], range(23, 31))):
        tokens = np.array(probe, dtype=np.int32)
        d.accept(seq, tokens)
        drafted = [int(t) for t in d.draft(seq, tokens, 8)]
        assert len(drafted) >= 6 and drafted == list(follow)[:len(drafted)]  # each text whole across its pieces


def test_add_history_refuses_bad_tokens_and_the_compatible_mode():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        d.add_history(1, np.array([5, 100], dtype=np.int32))
    assert d.history_size == 0  # nothing of a refused call is appended
    with pytest.raises(InvalidArgumentError, match="match mode"):
        Drafter(vocab_size=100, fingerprint=UNTAGGED).add_history(1, np.array([1], dtype=np.int32))


def test_end_history_puts_a_sources_held_back_tokens_in():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")  # history_piece 16
    d.add_history(1, np.array([1, 2, 3], dtype=np.int32))  # the first writer goes on at once
    d.add_history(2, np.array([7, 8, 9], dtype=np.int32))  # another writer: held back for a piece
    assert d.history_size == 4
    assert d.end_history(2) == 3 and d.history_size == 8 and d.end_history(2) == 0


def test_tree_drafts_are_well_formed_and_hold_both_continuations():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    seq = np.array([1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 1, 2, 3], dtype=np.int32)
    d.accept(0, seq)
    tokens, parents = d.draft_tree(0, seq, 6)
    assert 0 < len(tokens) <= 6
    assert all(-1 <= p < i for i, p in enumerate(parents))
    roots = {int(t) for t, p in zip(tokens, parents) if p == -1}
    assert {10, 20} <= roots
    with pytest.raises(InvalidArgumentError, match="budget"):
        d.draft_tree(0, seq, 0)


def test_compatible_mode_is_unchanged_and_refuses_trees():
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED)
    assert d.mode == "compatible"
    with pytest.raises(InvalidArgumentError, match="match mode"):
        d.draft_tree(0, np.array([1, 2], dtype=np.int32), 4)


def test_bad_modes_and_tuning_are_refused():
    with pytest.raises(InvalidArgumentError, match="mode must be 'compatible' or 'match'"):
        Drafter(vocab_size=10, fingerprint=UNTAGGED, mode="fast")
    with pytest.raises(InvalidArgumentError, match="has no 'speed'"):
        Drafter(vocab_size=10, fingerprint=UNTAGGED, mode="match", match_params={"speed": 1})
    with pytest.raises(InvalidArgumentError, match="min_prob"):
        Drafter(vocab_size=10, fingerprint=UNTAGGED, mode="match", match_params={"min_prob": 2})
    assert set(_core.MATCH_DEFAULTS) >= {"min_prob", "tree_min_prob", "history_tokens"}


def test_replay_in_the_match_mode_counts_linear_and_tree_drafts(tmp_path):
    rng = np.random.default_rng(8)
    block = rng.integers(0, 50, 300)
    stream = np.concatenate([block, rng.integers(0, 50, 100), block, block]).astype(np.int32)
    dyn = _core.CountTable()
    compat = _core.replay(stream, 900, 8, 1, 4, None, dyn)
    lin = _core.replay(stream, 900, 8, 1, 4, None, _core.CountTable(), mode="match")
    tree = _core.replay(stream, 900, 8, 1, 4, None, _core.CountTable(), mode="match", tree_budget=16, dump_drafts=True)
    for r in (compat, lin, tree):
        assert r["n_chunks"] == 1 and 0 <= r["n_accept"] <= r["n_drafted"]
    # Every tree's accepted path is at most its node count; the repeated blocks are copied.
    assert lin["n_accept"] > 300 and tree["n_accept"] > 300
    drafts = tree["drafts"]
    assert (drafts == -1).sum() == tree["n_draft_calls"]
    with pytest.raises(InvalidArgumentError, match="tree drafts need mode='match'"):
        _core.replay(stream, 900, 8, 1, 4, None, dyn, tree_budget=4)


# --- the commands


def cli(capsys, *args):
    from ngramcache.client.tools import cli as cli_module

    rc = cli_module.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_build_stats_and_inspect_in_the_match_mode(tmp_path, capsys):
    rng = np.random.default_rng(9)
    block = rng.integers(0, 500, 2000)
    tokens = np.concatenate([block, rng.integers(0, 500, 3000), block, rng.integers(0, 500, 3000)]).astype(np.int32)
    src = tmp_path / "corpus.npy"
    np.save(src, tokens[:5000])
    test = tmp_path / "test.npy"
    np.save(test, tokens)
    out = tmp_path / "c.ngc"
    rc, _, err = cli(capsys, "build", src, "-o", out, "--vocab-size", 500, "--fingerprint", "untagged", "--corpus-index",
                     "--index-depth", 16)
    assert rc == 0, err
    rc, text, _ = cli(capsys, "inspect", out, "--verify", "--json")
    info = json.loads(text)
    assert info["format_version"] == 2 and info["index_depth"] == 16 and info["n_indexed"] == 5000
    figures = {}
    for mode, budget in (("compatible", 0), ("match", 0), ("match", 8)):
        rc, text, err = cli(capsys, "stats", "--input", test, "--static", out, "--n-ctx", 4096, "--mode", mode,
                            "--tree-budget", budget, "--json")
        assert rc == 0, err
        figures[mode, budget] = json.loads(text)
    for (mode, budget), f in figures.items():
        assert f["mode"] == mode and f["tree_budget"] == budget and f["tokens_per_step"] > 1
    # The second copy of the block is in the corpus: the match mode copies it from the index.
    assert figures["match", 0]["n_accept"] > 1500
    rc, _, err = cli(capsys, "stats", "--input", test, "--tree-budget", 8)
    assert rc == 2 and "--tree-budget needs --mode match" in err
    rc, _, err = cli(capsys, "build", src, "-o", tmp_path / "d.ngc", "--vocab-size", 500, "--fingerprint", "untagged",
                     "--index-depth", 8)
    assert rc == 2 and "add --corpus-index" in err and not (tmp_path / "d.ngc").exists()


def test_scored_trees_come_best_first_and_every_prefix_is_a_smaller_budgets_tree():
    rng = np.random.default_rng(5)
    block = rng.integers(0, 40, 60).astype(np.int32)
    d = Drafter(vocab_size=100, fingerprint=UNTAGGED, mode="match")
    for i, variant in enumerate((block, np.concatenate([block[:30], rng.integers(0, 40, 30)]).astype(np.int32))):
        d.accept(i, variant)
        d.reset(i)
    seq = np.concatenate([rng.integers(50, 60, 5), block[:20]]).astype(np.int32)
    d.accept(9, seq)
    tokens, parents, probs = d.draft_tree_scored(9, seq, 16)
    assert len(tokens) > 4 and probs.dtype == np.float32
    assert np.array_equal(tokens, d.draft_tree(9, seq, 16)[0])
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert np.all((probs > 0) & (probs <= 1)) and np.all(np.diff(probs) <= 1e-7)  # best first
    assert all(probs[i] <= probs[p] + 1e-7 for i, p in enumerate(parents) if p >= 0)  # a path's odds only fall
    for m in range(1, len(tokens) + 1):  # what a cost-aware engine keeps is the tree a budget of m drafts
        small, small_parents = d.draft_tree(9, seq, m)
        assert np.array_equal(small, tokens[:m]) and np.array_equal(small_parents, parents[:m])
