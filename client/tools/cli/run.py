"""Running one command: the exit statuses, and one line on stderr for every error (2), Ctrl-C (130) or bug (1)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from contextlib import suppress

from ngramcache.client.kernel.errors import NgramCacheError
from ngramcache.client.tools.cli.guards import OutputGuard, check_outputs_against_inputs, describe_os_error, outputs_of
from ngramcache.client.tools.cli.parser import CommandHook, build_parser

EXIT_ERROR = 2                 # a user error (argparse uses 2 as well)
EXIT_UNEXPECTED = 1            # an error nobody anticipated: a bug to report
EXIT_INTERRUPTED = 130         # 128 + SIGINT, what shells report for Ctrl-C


def _say(message: str) -> None:
    """One line on stderr; on a terminal it first erases the line (the echoed ^C, a progress line)."""
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    print(prefix + message, file=sys.stderr)


def main(argv: list[str] | None = None, extra_commands: Iterable[CommandHook] = ()) -> int:
    """Runs one command; returns its exit status (0, 1, 2 or 130) instead of raising."""
    guard = OutputGuard()
    name = "ngramcache"
    args: argparse.Namespace | None = None
    try:
        args = build_parser(extra_commands).parse_args(argv)
        name = f"ngramcache {args.command}"
        args.guard = guard
        check_outputs_against_inputs(args)
        for path in outputs_of(args):
            guard.expect(path)
        command: Callable[[argparse.Namespace], int] = args.func
        return command(args)
    except KeyboardInterrupt:
        _say(f"{name}: {guard.interrupted()}")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ngramcache inspect F | head`: the reader left; not an error
        with suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())  # Python's flush of stdout at exit goes nowhere
            os.close(null)
        return 0
    except MemoryError:
        hint = ": give a smaller --memory-budget" if args is not None and hasattr(args, "memory_budget") else ""
        _say(f"{name}: error: out of memory{hint}")
        return EXIT_ERROR
    except NgramCacheError as e:
        _say(f"{name}: error: {e}")
        return EXIT_ERROR
    except OSError as e:
        _say(f"{name}: error: {describe_os_error(e)}")
        return EXIT_ERROR
    except Exception as e:
        if os.environ.get("NGRAMCACHE_TRACEBACK"):
            traceback.print_exc()
        _say(f"{name}: unexpected error: {type(e).__name__}: {e} (please report it; NGRAMCACHE_TRACEBACK=1 "
             "prints the traceback)")
        return EXIT_UNEXPECTED

