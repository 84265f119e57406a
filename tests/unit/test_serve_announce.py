"""`ngramcache serve`'s own lines (listening, draining, stopped) are written one line to a write call."""

from __future__ import annotations

import json
import sys

import pytest

from ngramcache.cache_service.cli import _Announcer


class _Calls:
    """A stream that keeps each write call apart (stderr is unbuffered: each call is one write(2))."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("log_json", [False, True])
@pytest.mark.parametrize("to_stdout", [False, True])
def test_a_line_and_its_newline_go_out_in_one_write(monkeypatch: pytest.MonkeyPatch, log_json: bool,
                                                    to_stdout: bool) -> None:
    """The workers of `serve --workers N` share one stderr; two lines written at the same moment (both
    workers draining on one SIGTERM) ran together when the newline went out in a write of its own."""
    stream = _Calls()
    monkeypatch.setattr(sys, "stdout" if to_stdout else "stderr", stream)
    _Announcer(log_json)("ngramcache serve: SIGTERM: draining (up to 10 s)...", stdout=to_stdout)
    assert len(stream.calls) == 1 and stream.calls[0].endswith("\n") and stream.calls[0].count("\n") == 1
    if log_json:
        assert json.loads(stream.calls[0])["message"] == "ngramcache serve: SIGTERM: draining (up to 10 s)..."
