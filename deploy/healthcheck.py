"""The container health check: asks the gRPC health service of the `ngramcache serve` beside it.

Run in the container (Docker's HEALTHCHECK, Kubernetes exec probes), with the service's own
NGC_* environment, so it needs no flags: it dials 127.0.0.1 on ``NGC_PORT`` (default 50051),
and when ``NGC_TLS_CERT`` is set it speaks TLS and trusts exactly that certificate (the
check runs next to the server, so the server's own certificate is the one to pin).

    python healthcheck.py              # exit 0 when the service says SERVING
    python healthcheck.py --live       # exit 0 when it answers at all (liveness: a store outage is no reason to restart)

Exit status: 0 healthy, 1 the service answered another status, 2 no answer (down, refused,
TLS failure, timeout). One line on stdout says which.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def default_address() -> str:
    """127.0.0.1 (or the configured host, when it is a specific one) and the configured port."""
    host = os.environ.get("NGC_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in _ANY_ADDRESS else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{os.environ.get('NGC_PORT', '50051')}"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=default_address(), help="HOST:PORT of the service (default: %(default)s)")
    p.add_argument("--service", default="", help='the health service name to ask for (default "": the whole server)')
    p.add_argument("--live", action="store_true", help="healthy when the service answers any status (liveness)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    p.add_argument("--tls-ca", default=os.environ.get("NGC_TLS_CERT") or None,
                   help="PEM certificates to trust; setting it turns TLS on (default: $NGC_TLS_CERT, the server's own)")
    p.add_argument("--server-name", default="localhost",
                   help="a name the server's certificate holds (subjectAltName), checked instead of the address's "
                        "(default localhost)")
    p.add_argument("--client-cert", help="PEM client certificate, for a server with tls_client_ca (mutual TLS)")
    p.add_argument("--client-key", help="PEM private key of --client-cert")
    args = p.parse_args(argv)

    try:
        if args.tls_ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=_read(args.tls_ca),
                                                       private_key=_read(args.client_key),
                                                       certificate_chain=_read(args.client_cert))
            channel = grpc.secure_channel(args.address, credentials,
                                          options=[("grpc.ssl_target_name_override", args.server_name)])
        else:
            channel = grpc.insecure_channel(args.address)
    except OSError as e:
        print(f"unhealthy: {e}")
        return 2
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"unhealthy: {args.address}: {e.code().name}: {e.details()}")
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    healthy = args.live or reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{'healthy' if healthy else 'unhealthy'}: {args.address}: {status}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
