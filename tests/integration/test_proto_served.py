"""The contract as run: proto/generate.py --check in a child process finds the generated code current, and a real gRPC server answers health and reflection for every service."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest

from ngramcache.client._proto.v1 import admin_pb2, counts_pb2, drafting_pb2, static_files_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generate_check_passes() -> None:
    pytest.importorskip("grpc_tools")
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                          capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr



def test_health_and_reflection_serve_the_contract() -> None:
    """grpc.health.v1 and reflection (from grpcio-health-checking and grpcio-reflection) describe our services."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    names = [service.full_name for pb2 in (admin_pb2, counts_pb2, drafting_pb2, static_files_pb2)
             for service in pb2.DESCRIPTOR.services_by_name.values()]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            db = ProtoReflectionDescriptorDatabase(channel)
            assert set(names) <= set(db.get_services())
            fdp = db.FindFileContainingSymbol("ngramcache.v1.Counts")
            assert fdp.name == "ngramcache/client/_proto/v1/counts.proto"
            pull = next(m for m in fdp.service[0].method if m.name == "Pull")
            assert pull.server_streaming and not pull.client_streaming
    finally:
        server.stop(None)
