"""Server-side paths a client may name (a rebuild's corpus): only under the configured corpus roots, refused alike whether outside, missing or unreadable.

A request field that names a file on the server lets its caller read that file into a
generation it can then fetch, and an error that differs between "missing" and "not allowed"
tells it which paths exist. So a path is taken only when its real path (symlinks and ``..``
resolved) lies under one of the roots the operator configured (``--corpus-root``, none by
default) and is readable there; everything else gets one and the same PERMISSION_DENIED text,
which quotes a short prefix of the path and nothing about it. Files found inside a named
folder are checked the same way when the rebuild reads them (a symlink out of a root is
refused). docs/security.md has the table of request fields that name server-side resources.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grpc

from .status import ServiceError

__all__ = ["MAX_PATH", "check_under_roots", "confine_corpus", "parse_roots"]

MAX_PATH = 4096


def parse_roots(setting: str | None) -> tuple[str, ...]:
    """The roots of a ``corpus_root`` setting (folders separated by ``:``), resolved; empty or None: none."""
    return tuple(os.path.realpath(p) for p in (setting or "").split(os.pathsep) if p.strip())


def _shown(path: object) -> str:
    text = path if isinstance(path, str) else repr(path)
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


def _refused(path: object) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                        f"corpus path {_shown(path)} is not a readable file or folder under this server's corpus roots")


def check_under_roots(path: str, roots: Sequence[str]) -> str:
    """The real path of ``path`` if it lies under one of ``roots`` and is readable; else PERMISSION_DENIED (one text)."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\x00" in path or not os.path.isabs(path):
        raise _refused(path)
    try:
        real = os.path.realpath(path)
        inside = any(os.path.commonpath([real, root]) == root for root in roots)
        readable = inside and (os.path.isfile(real) or os.path.isdir(real)) and os.access(real, os.R_OK)
    except (OSError, ValueError):  # a name too long, a component that is not a folder, ...
        readable = False
    if not readable:
        raise _refused(path)
    return real


def confine_corpus(paths: Sequence[str], roots: Sequence[str]) -> tuple[str, ...]:
    """The corpus paths of a rebuild request, each checked by `check_under_roots`.

    Raises:
        ServiceError: PERMISSION_DENIED, with one text whatever the reason; when no root is
            configured, a text saying the server takes no corpus paths.
    """
    if not paths:
        return ()
    if not roots:
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                           "this server takes no corpus paths (it runs without --corpus-root): rebuild from the "
                           "store's counts, or publish a generation built elsewhere")
    return tuple(check_under_roots(p, roots) for p in paths)
