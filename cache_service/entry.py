"""The `ngramcache` console script: imports the commands inside a guard, so Ctrl-C while Python is still importing is one line and exit 130, never a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    """Runs `ngramcache.cache_service.cli.main`, importing it first (numpy, grpc and the core take a moment)."""
    try:
        from ngramcache.cache_service.cli import main as run
    except KeyboardInterrupt:
        print("\r\033[Kngramcache: interrupted" if sys.stderr.isatty() else "ngramcache: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
