"""The static cache file format: round trips and every hostile case named in the format doc."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
from helpers import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramcache import (
    UNTAGGED,
    CacheFormatError,
    Drafter,
    InvalidArgumentError,
    StaticCache,
    build_static_from_tokens,
    checksum64,
)

HEADER = 128
ENTRY = 32
N_SECTIONS = 6
NAMES = ["ROWS", "KEYS", "STARTS", "TOTALS", "FOLLOWERS", "OVERFLOW"]


def write_cache(path, streams, vocab=50, k=2, fingerprint=b"\x07" * 32, generation=3):
    build_static_from_tokens(
        [np.asarray(s, dtype=np.int32) for s in streams], str(path), vocab_size=vocab, ngram_size=k,
        fingerprint=fingerprint, generation=generation,
    )
    return path.read_bytes()


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(1)
    streams = [rng.integers(0, 50, 3000) for _ in range(3)]
    data = write_cache(tmp_path / "good.ngc", streams)
    return data, streams


def sections(data: bytes):
    out = []
    for i in range(N_SECTIONS):
        sid, _, off, length, csum = struct.unpack_from("<IIQQQ", data, HEADER + i * ENTRY)
        out.append((sid, off, length, csum))
    return out


def reseal(data: bytearray) -> bytearray:
    """Recomputes the header checksum so a test reaches the check after it."""
    end = HEADER + N_SECTIONS * ENTRY
    scratch = bytearray(data[:end])
    scratch[120:128] = b"\0" * 8
    struct.pack_into("<Q", data, 120, checksum64(bytes(scratch)))
    return data


def open_bytes(tmp_path, data, name="bad.ngc"):
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return StaticCache.open(str(p))


def test_round_trip_header_and_counts(tmp_path, good):
    data, streams = good
    c = StaticCache.open(str(tmp_path / "good.ngc"))
    assert (c.format_version, c.ngram_size, c.vocab_size, c.generation) == (1, 2, 50, 3)
    assert c.fingerprint == b"\x07" * 32
    assert c.file_size == len(data) == os.path.getsize(tmp_path / "good.ngc")
    assert c.n_tokens == sum(len(s) for s in streams)
    want = reference.count_static(streams, 2)
    assert c.n_keys == len(want)
    assert c.n_followers == sum(len(v) for v in want.values())
    c.verify()
    for key, followers in list(want.items())[:300]:
        toks, counts = c.lookup(list(key))
        assert dict(zip(toks.tolist(), counts.tolist())) == dict(followers)
        best = max(sorted(followers), key=lambda t: followers[t])
        assert c.best(list(key)) == (best, followers[best], sum(followers.values()))
    assert reference.rows_to_table(c.to_rows()) == want
    for sid, off, _length, _ in sections(data):
        assert off % 8 == 0, NAMES[sid - 1]
    toks, counts = c.lookup([49, 49]) if (49, 49) not in want else (np.array([]), np.array([]))
    assert len(toks) == len(counts) == 0
    assert c.best([49, 49]) is None or (49, 49) in want


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ngram_sizes(tmp_path, k):
    rng = np.random.default_rng(k)
    streams = [rng.integers(0, 6, 400) for _ in range(2)]
    write_cache(tmp_path / "k.ngc", streams, vocab=6, k=k)
    c = StaticCache.open(str(tmp_path / "k.ngc"))
    c.verify()
    assert reference.rows_to_table(c.to_rows()) == reference.count_static(streams, k)


def test_large_counts_use_the_overflow_section(tmp_path):
    # vocab 2^20 leaves a 12-bit count field: 5000 repeats overflow it.
    vocab = 1 << 20
    stream = np.array([vocab - 1, 5] * 5000 + [vocab - 1, 6], dtype=np.int32)
    write_cache(tmp_path / "o.ngc", [stream], vocab=vocab)
    c = StaticCache.open(str(tmp_path / "o.ngc"))
    assert c.n_overflow >= 1
    c.verify()
    toks, counts = c.lookup([vocab - 1, 5])
    assert toks.tolist() == [vocab - 1] and counts.tolist() == [5000]
    assert c.best([5, vocab - 1]) == (5, 4999, 5000)
    toks, counts = c.lookup([5, vocab - 1])
    assert toks.tolist() == [5, 6] and counts.tolist() == [4999, 1]


def test_file_too_small(tmp_path):
    for size in (0, 7, HEADER - 1):
        with pytest.raises(CacheFormatError, match="smaller than the 128-byte header"):
            open_bytes(tmp_path, b"\0" * size)


def test_truncated_at_every_section_boundary(tmp_path, good):
    data, _ = good
    cuts = {HEADER, HEADER + ENTRY * 3, HEADER + ENTRY * N_SECTIONS, len(data) - 1}
    for _, off, length, _ in sections(data):
        cuts.update({off, off + length // 2, off + length})
    cuts.discard(len(data))
    assert len(cuts) > 10
    for cut in sorted(cuts):
        with pytest.raises(CacheFormatError, match="truncated") as e:
            open_bytes(tmp_path, data[:cut])
        assert str(tmp_path) in str(e.value)


def test_truncation_message_names_the_section(tmp_path, good):
    data, _ = good
    _, off, length, _ = sections(data)[4]
    with pytest.raises(CacheFormatError, match="inside or before section FOLLOWERS"):
        open_bytes(tmp_path, data[: off + length // 2])


def test_bad_magic(tmp_path, good):
    data = bytearray(good[0])
    data[0:8] = b"GGUF\0\0\0\0"
    with pytest.raises(CacheFormatError, match="bad magic"):
        open_bytes(tmp_path, data)


def test_llama_cpp_file_is_not_a_static_cache(tmp_path):
    # A llama.cpp cache record: 4 int32 n-gram, follower count, (token, count) pairs.
    rec = struct.pack("<4iiii", 1, 2, -1, -1, 1, 3, 9) * 40
    with pytest.raises(CacheFormatError, match="bad magic"):
        open_bytes(tmp_path, rec)


def test_unknown_version(tmp_path, good):
    data = bytearray(good[0])
    struct.pack_into("<I", data, 8, 3)
    with pytest.raises(CacheFormatError, match="unsupported format version 3"):
        open_bytes(tmp_path, reseal(data))


def test_version_2_needs_its_nine_sections(tmp_path, good):
    data = bytearray(good[0])
    struct.pack_into("<I", data, 8, 2)
    with pytest.raises(CacheFormatError, match="section count is 6, format version 2 has 9"):
        open_bytes(tmp_path, reseal(data))


def test_other_byte_order(tmp_path, good):
    data = bytearray(good[0])
    struct.pack_into(">I", data, 12, 0x01020304)
    with pytest.raises(CacheFormatError, match="endianness marker"):
        open_bytes(tmp_path, data)


def test_header_checksum(tmp_path, good):
    data = bytearray(good[0])
    data[40] ^= 0xFF  # inside the fingerprint
    with pytest.raises(CacheFormatError, match="header checksum mismatch"):
        open_bytes(tmp_path, data)
    data = bytearray(good[0])
    data[HEADER + 4 * ENTRY + 24] ^= 1  # a section checksum in the table
    with pytest.raises(CacheFormatError, match="header checksum mismatch"):
        open_bytes(tmp_path, data)


def patch_section(data, index, offset=None, length=None):
    data = bytearray(data)
    base = HEADER + index * ENTRY
    if offset is not None:
        struct.pack_into("<Q", data, base + 8, offset)
    if length is not None:
        struct.pack_into("<Q", data, base + 16, length)
    return reseal(data)


def test_offset_past_the_end(tmp_path, good):
    data = good[0]
    with pytest.raises(CacheFormatError, match="section FOLLOWERS .* extends past the end"):
        open_bytes(tmp_path, patch_section(data, 4, offset=len(data) + 8))
    with pytest.raises(CacheFormatError, match="section OVERFLOW .* extends past the end"):
        open_bytes(tmp_path, patch_section(data, 5, offset=2**64 - 8))


def test_length_past_the_end(tmp_path, good):
    data = good[0]
    with pytest.raises(CacheFormatError, match="section STARTS .* extends past the end"):
        open_bytes(tmp_path, patch_section(data, 2, length=len(data)))
    with pytest.raises(CacheFormatError, match="extends past the end"):
        open_bytes(tmp_path, patch_section(data, 3, length=2**64 - 1))


def test_length_disagreeing_with_the_counts(tmp_path, good):
    data = good[0]
    _, _, length, _ = sections(data)[1]
    with pytest.raises(CacheFormatError, match="section KEYS is .* the header counts imply"):
        open_bytes(tmp_path, patch_section(data, 1, length=length - 8))


def test_misaligned_section(tmp_path, good):
    data = good[0]
    _, off, _, _ = sections(data)[3]
    with pytest.raises(CacheFormatError, match="section TOTALS is misaligned"):
        open_bytes(tmp_path, patch_section(data, 3, offset=off + 4))


def test_overlapping_sections(tmp_path, good):
    data = good[0]
    _, off, _, _ = sections(data)[1]
    with pytest.raises(CacheFormatError, match="section STARTS .* overlaps"):
        open_bytes(tmp_path, patch_section(data, 2, offset=off))


def test_header_fields_out_of_range(tmp_path, good):
    for field_offset, value, message in [
        (20, 5, "n-gram size 5 is outside 1..4"),
        (20, 0, "n-gram size 0"),
        (24, 0, "vocabulary size 0"),
        (24, 1 << 25, "vocabulary size"),
        (104, 9, "token_bits"),
        (28, 7, "section count is 7"),
        (16, 64, "header size is 64"),
    ]:
        data = bytearray(good[0])
        struct.pack_into("<I", data, field_offset, value)
        with pytest.raises(CacheFormatError, match=message):
            open_bytes(tmp_path, reseal(data))


def test_wrong_section_checksum_found_by_verify(tmp_path, good):
    data, _ = good
    for index in range(4):  # ROWS, KEYS, STARTS, TOTALS
        _, off, length, _ = sections(data)[index]
        bad = bytearray(data)
        bad[off + length // 2] ^= 0x01
        c = open_bytes(tmp_path, bad, f"flip{index}.ngc")  # opening stays O(1): it does not read sections
        with pytest.raises(CacheFormatError, match=f"checksum mismatch in section {NAMES[index]}"):
            c.verify()


def test_key_size_other_than_the_file_says(tmp_path, good):
    c = StaticCache.open(str(tmp_path / "good.ngc"))
    with pytest.raises(InvalidArgumentError, match="keys of 2 tokens, got an n-gram of 3"):
        c.lookup([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="keys of 2 tokens, got an n-gram of 1"):
        c.best([1])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        c.lookup([1, 50])


def test_not_a_file(tmp_path):
    with pytest.raises(OSError, match="cannot open"):
        StaticCache.open(str(tmp_path / "missing.ngc"))
    with pytest.raises(OSError, match="not a regular file"):
        StaticCache.open(str(tmp_path))


def test_write_is_atomic_and_leaves_no_temporary(tmp_path, good):
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["good.ngc"]
    # A failed build (token outside the vocabulary) leaves the old file untouched.
    before = (tmp_path / "good.ngc").read_bytes()
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        build_static_from_tokens([np.array([1, 2, 99], dtype=np.int32)], str(tmp_path / "good.ngc"), vocab_size=50, fingerprint=UNTAGGED)
    assert (tmp_path / "good.ngc").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ngc"]


def test_build_arguments(tmp_path):
    s = [np.array([1, 2, 3], dtype=np.int32)]
    with pytest.raises(InvalidArgumentError, match="ngram_size"):
        build_static_from_tokens(s, str(tmp_path / "a"), vocab_size=5, ngram_size=5, fingerprint=UNTAGGED)
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        build_static_from_tokens(s, str(tmp_path / "a"), vocab_size=0, fingerprint=UNTAGGED)
    with pytest.raises(InvalidArgumentError, match="fingerprint must be 32 bytes"):
        build_static_from_tokens(s, str(tmp_path / "a"), vocab_size=5, fingerprint=b"x")
    with pytest.raises(OSError, match="cannot create"):
        build_static_from_tokens(s, str(tmp_path / "no" / "dir" / "a"), vocab_size=5, fingerprint=UNTAGGED)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8))
def test_damaged_sections_never_crash(tmp_path, good, flips):
    """Bytes damaged anywhere: open refuses, or lookups and drafts stay in bounds and verify() refuses, naming the
    first section whose bytes changed (a flip that wrote the byte already there, or one in the padding between
    sections, changes no section: verify passes and the rows read back whole)."""
    data = bytearray(good[0])
    table_end = HEADER + N_SECTIONS * ENTRY
    for pos, value in flips:
        data[table_end + pos % (len(data) - table_end)] = value
    damaged = [NAMES[sid - 1] for sid, off, length, _ in sections(good[0])
               if data[off:off + length] != good[0][off:off + length]]
    try:
        c = open_bytes(tmp_path, data, "fuzz.ngc")
    except CacheFormatError:
        return
    d = Drafter(static=c)
    rng = np.random.default_rng(len(flips))
    for _ in range(50):
        key = rng.integers(0, 50, 2).tolist()
        try:
            c.lookup(key)
            c.best(key)
        except CacheFormatError:
            pass
        tokens = d.draft(0, np.asarray(rng.integers(0, 50, 6), dtype=np.int32), 8)
        assert all(0 <= t < 50 for t in tokens.tolist())
    if damaged:  # verify checks the sections in order: the first damaged one is named
        with pytest.raises(CacheFormatError, match=f"^{re.escape(c.path)}: checksum mismatch in section {damaged[0]}: "
                                                   "the file is corrupt$"):
            c.verify()
    else:
        c.verify()
        assert len(c.to_rows()) == len(StaticCache.open(str(tmp_path / "good.ngc")).to_rows())


def test_rows_past_the_keys_with_valid_checksums_are_refused_by_verify(tmp_path, good):
    """Found by the fuzzer (native/fuzz/crashes/fuzz_static_cache/): a ROWS entry above
    n_keys followed by a lower one, with every checksum valid, made verify() read KEYS past
    its section. It must be a format error naming ROWS."""
    data, _ = good
    bad = bytearray(data)
    _, off, length, _ = sections(bad)[0]  # ROWS: u32[V + 1]
    n_keys = struct.unpack_from("<Q", bad, 72)[0]
    struct.pack_into("<I", bad, off + 4 * 3, n_keys + 1000)  # ROWS[3] far past the keys; ROWS[4] lower again
    struct.pack_into("<Q", bad, HEADER + 24, checksum64(bytes(bad[off:off + length])))  # section 1's checksum
    c = open_bytes(tmp_path, reseal(bad))
    with pytest.raises(CacheFormatError, match="ROWS is not monotone at token 3"):
        c.verify()
