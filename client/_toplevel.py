"""ngramcache: a shared n-gram cache for speculative decoding.

This is the public API. It is installed as the top-level `ngramcache` package (its source
lives in client/_toplevel.py, installed by native/CMakeLists.txt, because the repository's top-level layout is fixed); the client
library is `ngramcache.client` and the service `ngramcache.cache_service`.
"""

from ngramcache.client import *  # noqa: F403
from ngramcache.client import __all__ as _client_all
from ngramcache.client import __version__

__all__ = [*_client_all, "__version__"]  # noqa: PLE0604 - the client's names, re-exported
