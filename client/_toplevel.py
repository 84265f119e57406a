"""ngramcache: a shared n-gram cache for speculative decoding.

This is the public API. It is installed as the top-level `ngramcache` package (its source
lives in client/_toplevel.py, installed by native/CMakeLists.txt, because the repository's top-level layout is fixed); the client
library is `ngramcache.client` and the service `ngramcache.cache_service`.

The names are those of `ngramcache.client`, imported on first use (PEP 562), so importing a
submodule (the console script's entry point, say) does not load numpy, grpc and the core first.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# gRPC's C core reads GRPC_VERBOSITY once, when grpc is first imported; unset, grpcio 1.85 prints
# INFO lines on stderr, four per failed TLS handshake (``ssl_transport_security.cc:2563] Handshake
# failed ...``) ahead of the one error that says the same. Its documented default is ERROR: make
# that the level where the user set none (``GRPC_VERBOSITY=info`` brings the lines back). Has no
# effect where grpc was imported before ngramcache.
_USER_GRPC_VERBOSITY = os.environ.get("GRPC_VERBOSITY")
if _USER_GRPC_VERBOSITY is None:
    os.environ["GRPC_VERBOSITY"] = "ERROR"

if TYPE_CHECKING:
    from ngramcache.client import *  # noqa: F403
    from ngramcache.client import __version__  # noqa: F401


def __getattr__(name: str) -> Any:
    client = importlib.import_module("ngramcache.client")
    if name == "__all__":
        value: Any = [*client.__all__, "__version__"]
    elif name == "__version__" or name in client.__all__:
        value = getattr(client, name)
    else:
        raise AttributeError(f"module 'ngramcache' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
