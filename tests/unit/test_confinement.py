"""cache_service/confinement.py: a corpus path is taken only under a corpus root; outside, missing, unreadable or malformed all get one text."""

from __future__ import annotations

import os

import grpc
import pytest

from ngramcache.cache_service.confinement import check_under_roots, confine_corpus, parse_roots
from ngramcache.cache_service.status import ServiceError


@pytest.fixture
def layout(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"\0" * 8)
    (root / "sub" / "b.bin").write_bytes(b"\0" * 8)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\1" * 8)
    (root / "escape.bin").symlink_to(secret)
    return root, secret


def refused_text(path: str, roots) -> str:
    with pytest.raises(ServiceError) as e:
        confine_corpus([path], roots)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    return str(e.value).replace(repr(path[:80]), "PATH").replace("...", "")


def test_paths_under_a_root_are_taken(layout):
    root, _ = layout
    roots = parse_roots(str(root))
    assert confine_corpus([str(root / "a.bin"), str(root / "sub")], roots) == (str(root / "a.bin"), str(root / "sub"))
    assert check_under_roots(str(root / "sub" / ".." / "a.bin"), roots) == str(root / "a.bin")


def test_outside_missing_unreadable_and_malformed_get_one_text(layout, tmp_path):
    root, secret = layout
    roots = parse_roots(str(root))
    unreadable = root / "locked.bin"
    unreadable.write_bytes(b"x")
    unreadable.chmod(0)
    cases = [str(secret), "/etc/passwd", str(root / "missing.bin"), str(root / "escape.bin"),
             str(root / ".." / "secret.bin"), "/" + "x" * 300, "relative.bin", str(root / "a.bin") + "\x00",
             "/" + "y" * 5000]
    if os.geteuid() != 0:  # root reads anything
        cases.append(str(unreadable))
    texts = {refused_text(p, roots) for p in cases}
    assert len(texts) == 1, texts
    assert "corpus roots" in texts.pop()


def test_no_root_configured_takes_no_path(layout):
    root, _ = layout
    with pytest.raises(ServiceError, match="takes no corpus paths") as e:
        confine_corpus([str(root / "a.bin")], ())
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert confine_corpus([], ()) == ()
