"""A one-line progress display for long commands: shown on a terminal, silent otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


class Progress:
    """Prints `label: done/total unit, rate, ETA` on one line of stderr, at most 4 times a second.

    Silent when stderr is not a terminal or `quiet` is set. A context manager: leaving the
    `with` block, normally or by an exception (Ctrl-C included), erases the line, so an error
    message printed next starts on a clean line. Not thread-safe.
    """

    def __init__(self, label: str, total: float | None, unit: str = "B", quiet: bool = False) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.enabled = not quiet and sys.stderr.isatty()
        self.start = self.last = time.monotonic()
        self.done = 0.0
        self.tokens = 0

    def update(self, done_delta: float, tokens_delta: int = 0) -> None:
        self.done += done_delta
        self.tokens += tokens_delta
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.25:
            self.last = now
            self._print(now)

    def _print(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        parts = [f"{self.label}: {_human(self.done)}{self.unit}"]
        if self.total:
            pct = 100.0 * self.done / self.total
            parts[0] += f"/{_human(self.total)}{self.unit} ({pct:.0f}%)"
        if self.tokens:
            parts.append(f"{_human(self.tokens)} tokens, {_human(self.tokens / elapsed)} tokens/s")
        if self.total and self.done >= 0.02 * self.total:  # too early, an ETA is noise
            eta = elapsed * (self.total - self.done) / self.done
            parts.append(f"ETA {eta:.0f} s")
        sys.stderr.write("\r" + ", ".join(parts) + "\033[K")
        sys.stderr.flush()

    def close(self, message: str | None = None) -> None:
        """Erases the progress line (once), then prints `message` on a line of its own if given."""
        if self.enabled:
            self.enabled = False
            sys.stderr.write("\r\033[K")
            if message:
                sys.stderr.write(message + "\n")
            sys.stderr.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _human(x: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.1f}{unit}" if unit else f"{x:.0f}"
        x /= 1000
    return f"{x:.1f}P"
