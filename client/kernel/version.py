"""The installed package's version (`ngramcache.__version__`)."""

from importlib import metadata

try:
    __version__ = metadata.version("ngramcache")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
