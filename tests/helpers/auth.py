"""Bearer tokens of the auth tests: a fixed table of named tokens, their roles and namespaces, and its tokens file."""

from __future__ import annotations

from pathlib import Path

from ngramcache.cache_service.security import token_sha256

__all__ = ["ALPHA", "BETA", "TOKENS", "bearer", "token", "write_tokens_file"]

ALPHA, BETA = "alpha", "beta"

# name -> (namespaces, roles); the token itself is "tok-<name>-" padded to 32 characters.
TOKENS: dict[str, tuple[list[str], list[str]]] = {
    "admin_all": (["*"], ["admin"]),
    "all_alpha": ([ALPHA, "alpha-tmp"], ["admin"]),
    "draft_ab": ([ALPHA, BETA], ["draft"]),
    "draft_all": (["*"], ["draft"]),
    "push_all": (["*"], ["push"]),
    "push_alpha": ([ALPHA], ["push"]),
}


def token(name: str) -> str:
    """The secret of the token named `name` in `TOKENS`."""
    return f"tok-{name}-".ljust(32, "x")


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the token named `name`."""
    return (("authorization", f"Bearer {token(name)}"),)


def write_tokens_file(path: Path) -> Path:
    """Writes `TOKENS` as a server's --tokens-file (TOML, SHA-256 of each token) to `path`; returns it."""
    lines = []
    for name, (namespaces, roles) in TOKENS.items():
        lines += ["[[token]]", f'name = "{name}"', f'sha256 = "{token_sha256(token(name))}"',
                  "namespaces = [" + ", ".join(f'"{n}"' for n in namespaces) + "]",
                  "roles = [" + ", ".join(f'"{r}"' for r in roles) + "]", ""]
    path.write_text("\n".join(lines))
    return path
