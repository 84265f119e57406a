"""The `ngramcache` console script: imports the commands inside a guard, so Ctrl-C while Python is still importing is one line and exit 130, never a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def quiet_grpc_logging() -> None:
    """Turns gRPC's C-core log lines off (``E1204 ... add_port.cc:83] ...``, TLS handshake failures): every
    command says what went wrong in its own one line. A GRPC_VERBOSITY the user set is left alone, so
    ``GRPC_VERBOSITY=debug ngramcache ...`` (or ``info``, ``error``) turns them back on.

    Must run before grpc is first imported: the C core reads the variables once.
    """
    import ngramcache  # sets GRPC_VERBOSITY=ERROR where the user set none; keeps what they set

    if ngramcache._USER_GRPC_VERBOSITY is None:
        os.environ["GRPC_VERBOSITY"] = "NONE"
        os.environ["GRPC_TRACE"] = ""


def main() -> int:
    """Runs `ngramcache.cache_service.cli.main`, importing it first (numpy, grpc and the core take a moment)."""
    quiet_grpc_logging()
    try:
        from ngramcache.cache_service.cli import main as run
    except KeyboardInterrupt:
        print("\r\033[Kngramcache: interrupted" if sys.stderr.isatty() else "ngramcache: interrupted", file=sys.stderr)
        return 130
    status = run()
    # The command is done: a Ctrl-C from here on has nothing left to stop, and one that lands while the interpreter
    # shuts down (joining threads, flushing) would print Python's "Exception ignored in threading._shutdown" traceback.
    with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


if __name__ == "__main__":
    sys.exit(main())
