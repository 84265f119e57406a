"""Service addresses are checked before a channel opens: URLs, missing ports, bare IPv6 refused with the fix, in the library and the CLI."""

from __future__ import annotations

import pytest

from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.sync.admin import AdminClient
from ngramcache.client.sync.client import NgramClient
from ngramcache.client.sync.remote import RemoteDrafter
from ngramcache.client.wire.address import check_address, host_port

TOKENIZER = (bytes(32), 100)


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "localhost:1", "cache-1.internal:65535", "[::1]:50051",
                                     "dns:///cache.internal:50051", "ipv4:127.0.0.1:50051", "unix:/tmp/ngc.sock"])
def test_addresses_a_client_can_dial_are_taken_as_they_are(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:50051", "address http://127.0.0.1:50051: no URL scheme is taken (http://); give HOST:PORT, e.g. "
                               "127.0.0.1:50051 (or a gRPC target such as dns:///HOST:PORT)"),
    ("grpc://cache:7000/", "address grpc://cache:7000/: no URL scheme is taken (grpc://); give HOST:PORT, e.g. cache:7000"),
    ("https://cache", "address https://cache: no URL scheme is taken (https://); give HOST:PORT, e.g. cache:50051 (or a "
                      "gRPC target such as dns:///HOST:PORT); for TLS give tls_ca"),
    ("127.0.0.1", "address 127.0.0.1 has no port: give HOST:PORT, e.g. 127.0.0.1:50051 (50051 is what `ngramcache "
                  "serve` listens on by default)"),
    ("cache:", "address cache: has no port: give HOST:PORT, e.g. cache:50051"),
    ("[::1]", "address [::1] has no port"),
    ("::1", "address ::1: an IPv6 address goes in brackets, with the port after them: [IPv6]:PORT, e.g. [::1]:50051"),
    ("cache:0", "address cache:0: the port must be in 1..65535, got 0"),
    ("cache:99999", "address cache:99999: the port must be in 1..65535, got 99999"),
    ("cache:grpc", "address cache:grpc is not HOST:PORT (e.g. 127.0.0.1:50051)"),
    (" cache:1", "address ' cache:1' has spaces around it; give HOST:PORT"),
    ("", "address must be HOST:PORT (e.g. 127.0.0.1:50051), got ''"),
])
def test_what_a_client_cannot_dial_is_refused_with_the_fix(address: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        check_address(address)
    assert message in str(e.value)


def test_the_message_uses_the_callers_names() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^--server https://h:1: .*; for TLS give --tls-ca$"):
        check_address("https://h:1", "--server", "--tls-ca")


def test_host_port() -> None:
    assert host_port("h:1") == ("h", 1)
    assert host_port("[::1]:2") == ("::1", 2)
    assert host_port("dns:///h:3") == ("h", 3)
    assert host_port("unix:/x") is None and host_port("h") is None and host_port("h:0") is None


@pytest.mark.parametrize("make", [
    lambda a: AdminClient(a),
    lambda a: RemoteDrafter(a, "ns", TOKENIZER),
    lambda a: NgramClient(a, "ns", TOKENIZER, connect_timeout=1),
], ids=["AdminClient", "RemoteDrafter", "NgramClient"])
def test_library_constructors_refuse_a_url_naming_the_argument(make) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^address http://127\.0\.0\.1:50051: no URL scheme is taken"):
        make("http://127.0.0.1:50051")
    with pytest.raises(InvalidArgumentError, match=r"^address 127\.0\.0\.1 has no port"):
        make("127.0.0.1")


def test_ngram_client_names_the_addresses_argument_when_there_are_several() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^addresses grpc://b:2: no URL scheme is taken"):
        NgramClient(["a:1", "grpc://b:2"], "ns", TOKENIZER, connect_timeout=1)
