"""Service addresses: what a client takes (``HOST:PORT``, ``[IPv6]:PORT`` or a gRPC target such as ``dns:///HOST:PORT``), checked before any channel is opened."""

from __future__ import annotations

import re

from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["DEFAULT_PORT", "DEFAULT_SERVER", "GRPC_SCHEMES", "check_address", "host_port"]

DEFAULT_PORT = 50051
"""The port `ngramcache serve` listens on unless told otherwise."""

DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"
"""Where `ngramcache serve` listens with no options: the commands' default --server."""

GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
"""Target schemes gRPC itself resolves; an address starting with one is passed to gRPC as it is."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def _example(rest: str) -> str:
    """A HOST:PORT made of what follows a URL scheme (its path dropped), for the message's example."""
    hostport = rest.split("/", 1)[0] or "HOST"
    return hostport if host_port(hostport) is not None else f"{hostport.rstrip(':')}:{DEFAULT_PORT}"


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT``, ``[IPv6]:PORT`` or a ``dns:``/``ipv4:``/``ipv6:`` target naming one
    address; None for anything else (a unix socket, a malformed address)."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    m = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\]:(\d{1,5})", address) or re.fullmatch(r"([^:\[\]/\s]+):(\d{1,5})", address)
    if m is None or not 0 < int(m.group(2)) <= 65535:
        return None
    return m.group(1), int(m.group(2))


def check_address(address: object, what: str = "address", tls_what: str = "tls_ca") -> str:
    """``address`` if a client can dial it, else InvalidArgumentError naming ``what`` and the fix.

    Taken: ``HOST:PORT``, ``[IPv6]:PORT``, and the targets gRPC resolves itself (``dns:///HOST:PORT``,
    ``ipv4:``, ``ipv6:``, ``unix:PATH``, ...). Refused with the fix: a URL (``http://``, ``grpc://``,
    ``https://``: gRPC takes no URL scheme; TLS is ``tls_what``), a missing or out-of-range port, a
    bare IPv6 address.

    Args:
        address: what the caller gave.
        what: how the caller named it, for the message (``address``, ``--server``).
        tls_what: how the caller names the TLS setting, for the message (``tls_ca``, ``--tls-ca``).
    """
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgumentError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {address!r}")
    if address != address.strip():
        raise InvalidArgumentError(f"{what} {address!r} has spaces around it; give HOST:PORT")
    if address.startswith(GRPC_SCHEMES):
        return address
    url = _URL.match(address)
    if url is not None:
        scheme = url.group(1).lower()
        tls = f"; for TLS give {tls_what}" if scheme in ("https", "grpcs") else ""
        raise InvalidArgumentError(f"{what} {address}: no URL scheme is taken ({scheme}://); give HOST:PORT, e.g. "
                                   f"{_example(url.group(2))} (or a gRPC target such as dns:///HOST:PORT){tls}")
    if host_port(address) is not None:
        return address
    if address.count(":") >= 2 and not address.startswith("["):
        raise InvalidArgumentError(f"{what} {address}: an IPv6 address goes in brackets, with the port after them: "
                                   f"[IPv6]:PORT, e.g. [::1]:{DEFAULT_PORT}")
    _, colon, port = address.rpartition(":")
    if not colon or not port or address.endswith("]"):
        bare = address.rstrip(":")
        raise InvalidArgumentError(f"{what} {address} has no port: give HOST:PORT, e.g. {bare}:{DEFAULT_PORT} "
                                   f"({DEFAULT_PORT} is what `ngramcache serve` listens on by default)")
    if port.isdigit():
        raise InvalidArgumentError(f"{what} {address}: the port must be in 1..65535, got {port}")
    raise InvalidArgumentError(f"{what} {address} is not HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
