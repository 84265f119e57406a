"""TOML on every supported Python: the standard library's tomllib (3.11+), else its backport tomli (3.10, a dependency there)."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pyproject.toml installs tomli there, the same API
    import tomli as tomllib

__all__ = ["tomllib"]
