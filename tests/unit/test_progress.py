"""The progress line (client/kernel/progress.py): shown on a terminal only, always erased at the end."""

from __future__ import annotations

import io

import pytest

from ngramcache.client.kernel.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_when_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with Progress("build", 100) as p:
        p.last = -1e9  # as if the last print were long ago
        p.update(50, 10)
    assert err.getvalue() == ""


def test_the_line_is_erased_when_the_block_ends_even_by_ctrl_c(monkeypatch):
    err = FakeTerminal()
    monkeypatch.setattr("sys.stderr", err)
    with pytest.raises(KeyboardInterrupt), Progress("build", 100) as p:
        p.last = -1e9
        p.update(50, 10)
        assert err.getvalue().startswith("\rbuild: 50B/100B (50%)")
        raise KeyboardInterrupt
    assert err.getvalue().endswith("\r\033[K")  # the next message starts on a clean line
    p.close()  # a second close writes nothing more
    assert err.getvalue().count("\r\033[K") == 1


def test_quiet_prints_nothing(monkeypatch):
    err = FakeTerminal()
    monkeypatch.setattr("sys.stderr", err)
    with Progress("build", 100, quiet=True) as p:
        p.last = -1e9
        p.update(50)
    assert err.getvalue() == ""
