"""llama.cpp's cache format: export, import, round trips and hostile files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramcache import (
    UNTAGGED,
    CacheFormatError,
    CountTable,
    StaticBuilder,
    StaticCache,
    build_static_from_tokens,
    export_llama,
    import_llama,
    load_llama_counts,
)


def records(path) -> dict:
    """Parses a llama.cpp cache file the obvious way."""
    data = path.read_bytes()
    out, pos = {}, 0
    while pos < len(data):
        ngram = struct.unpack_from("<4i", data, pos)
        (n,) = struct.unpack_from("<i", data, pos + 16)
        pos += 20
        key = tuple(t for t in ngram if t != -1)
        out[key] = {}
        for _ in range(n):
            tok, cnt = struct.unpack_from("<ii", data, pos)
            out[key][tok] = cnt
            pos += 8
    return out


@pytest.fixture
def cache(tmp_path):
    rng = np.random.default_rng(9)
    streams = [rng.integers(0, 40, 4000).astype(np.int32) for _ in range(2)]
    build_static_from_tokens(streams, str(tmp_path / "c.ngc"), vocab_size=40, fingerprint=b"f" * 32, generation=4)
    return StaticCache.open(str(tmp_path / "c.ngc")), streams


def test_export_matches_llama_layout(tmp_path, cache):
    c, streams = cache
    export_llama(c, str(tmp_path / "c.bin"))
    assert records(tmp_path / "c.bin") == {k: dict(v) for k, v in reference.count_static(streams).items()}


def test_import_of_export_is_identity(tmp_path, cache):
    c, _ = cache
    export_llama(c, str(tmp_path / "c.bin"))
    b = StaticBuilder(str(tmp_path / "back.ngc"), 40, 2, fingerprint=b"f" * 32, generation=4)
    import_llama(str(tmp_path / "c.bin"), b)
    b.finish()
    back = StaticCache.open(str(tmp_path / "back.ngc"))
    assert (back.to_rows() == c.to_rows()).all()
    assert (back.n_keys, back.n_followers, back.fingerprint, back.generation) == (c.n_keys, c.n_followers, c.fingerprint, 4)


def test_dynamic_llama_cache_loads_into_a_count_table(tmp_path):
    rec = struct.pack("<4ii", 1, -1, -1, -1, 1) + struct.pack("<ii", 2, 3)
    rec += struct.pack("<4ii", 1, 2, 3, -1, 2) + struct.pack("<iiii", 4, 1, 5, 2)
    (tmp_path / "d.bin").write_bytes(rec)
    t = CountTable()
    load_llama_counts(str(tmp_path / "d.bin"), 10, t)
    assert t.lookup([1])[1].tolist() == [3]
    assert t.lookup([1, 2, 3])[0].tolist() == [4, 5]


def hostile_cases():
    good = struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 3, 1)
    return [
        (good + struct.pack("<4i", 1, 2, -1, -1), 28, "truncated record"),
        (good + struct.pack("<4ii", 1, 2, -1, -1, 2) + struct.pack("<ii", 3, 1), 56, "follower 1 of 2 is missing"),
        (good + struct.pack("<4ii", 1, 2, -1, -1, 0), 44, "follower count 0 must be > 0"),
        (good + struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 3, -7), 52, "count -7 must be > 0"),
        (good + struct.pack("<4ii", 1, 99, -1, -1, 1) + struct.pack("<ii", 3, 1), 32, "token 99 is outside the vocabulary"),
        (good + struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 50, 1), 48, "follower token 50 is outside"),
        (good + struct.pack("<4ii", 1, -1, 5, -1, 1) + struct.pack("<ii", 3, 1), 36, "after an unused"),
        (good + struct.pack("<4ii", -1, -1, -1, -1, 1) + struct.pack("<ii", 3, 1), 28, "empty n-gram"),
        (good[:-3], 20, "follower 0 of 1 is missing"),
    ]


@pytest.mark.parametrize("data,offset,message", hostile_cases())
def test_hostile_files_are_refused_with_the_offset(tmp_path, data, offset, message):
    (tmp_path / "bad.bin").write_bytes(data)
    b = StaticBuilder(str(tmp_path / "out.ngc"), 40, fingerprint=UNTAGGED)
    with pytest.raises(CacheFormatError, match=f"byte {offset}: .*{message}"):
        import_llama(str(tmp_path / "bad.bin"), b)
    t = CountTable()
    with pytest.raises(CacheFormatError, match=f"byte {offset}"):
        load_llama_counts(str(tmp_path / "bad.bin"), 40, t)
    assert t.n_keys == 0  # all or nothing
    assert not (tmp_path / "out.ngc").exists()


def test_mixed_ngram_sizes_are_refused_for_a_static_import(tmp_path):
    rec = struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 3, 1)
    rec += struct.pack("<4ii", 1, 2, 3, -1, 1) + struct.pack("<ii", 3, 1)
    (tmp_path / "m.bin").write_bytes(rec)
    with pytest.raises(CacheFormatError, match="byte 28: an n-gram of 3 tokens; this import builds keys of 2"):
        import_llama(str(tmp_path / "m.bin"), StaticBuilder(str(tmp_path / "o.ngc"), 40, fingerprint=UNTAGGED))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.integers(0, 3))
def test_random_bytes_never_crash_the_importers(tmp_path, data, prefix_records):
    """Arbitrary bytes (after some good records) are imported or refused cleanly, all or nothing."""
    good = (struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<ii", 3, 1)) * prefix_records
    path = tmp_path / "fuzz.bin"
    path.write_bytes(good + data)
    t = CountTable()
    try:
        load_llama_counts(str(path), 40, t)
    except CacheFormatError as e:
        assert "byte " in str(e)
        assert t.n_keys == 0
    else:
        t.check_integrity()
    b = StaticBuilder(str(tmp_path / "fuzz.ngc"), 40, fingerprint=UNTAGGED)
    try:
        import_llama(str(path), b)
    except CacheFormatError:
        return
    b.finish()
    StaticCache.open(str(tmp_path / "fuzz.ngc")).verify()
