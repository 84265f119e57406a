"""NgramClient refuses a cache_dir it cannot use, naming it, before it connects; one it can use is created (then the client connects: nothing listens on the port it is given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ngramcache import (
    BackendUnavailableError,
    InvalidArgumentError,
)

FP = b"\x07" * 32


def test_a_bad_cache_dir_is_an_invalid_argument_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ngramcache import NgramClient

    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "missing" / "cache", f"cache_dir {tmp_path / 'missing' / 'cache'}: its parent folder "
                                         f"{tmp_path / 'missing'} does not exist: create it, or give another cache_dir"),
        (tmp_path / "file", f"cache_dir {tmp_path / 'file'} exists and is not a folder"),
        (tmp_path / "file" / "cache", f"cache_dir {tmp_path / 'file' / 'cache'}: its parent folder"),
        ("", "cache_dir is empty"),
    ]
    for cache_dir, message in cases:
        with pytest.raises(InvalidArgumentError) as err:
            NgramClient("127.0.0.1:9", "ns", (FP, 100), cache_dir=cache_dir, connect_timeout=0.2)
        assert str(err.value).startswith(message), err.value
    assert not (tmp_path / "missing").exists()
    # A cache_dir whose parent exists is created (and the client goes on to connect: nothing listens there).
    with pytest.raises(BackendUnavailableError):
        NgramClient("127.0.0.1:9", "ns", (FP, 100), cache_dir=tmp_path / "new", connect_timeout=0.2, ready_timeout=0.5)
    assert (tmp_path / "new").is_dir()
    # The default one is created with its parents.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    with pytest.raises(BackendUnavailableError):
        NgramClient("127.0.0.1:9", "ns", (FP, 100), connect_timeout=0.2, ready_timeout=0.5)
    assert (tmp_path / "home" / ".cache" / "ngramcache" / "ns").is_dir()
