"""Health follows the counts store at any time: a replica whose redis-server dies says NOT_SERVING and names the outage as such, and says SERVING again once it is back."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.counts import FP, VOCAB, batch, row
from helpers.redis_servers import RedisServer
from helpers.service import ServiceThread, wait_until

from ngramcache.cache_service.status import store_outage_message
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import delta_rows_to_bytes

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(channel: grpc.Channel) -> int:
    try:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)
    except grpc.RpcError:
        return -1


def push(channel: grpc.Channel, seq: int) -> counts_pb2.PushResponse:
    rows = delta_rows_to_bytes(batch([row([1, 2], 3, 1)]))
    return counts_pb2_grpc.CountsStub(channel).Push(counts_pb2.PushRequest(
        namespace="h", tokenizer_fingerprint=FP, client_id="health-test", seq=seq, rows=rows), timeout=20)


def test_health_follows_a_redis_outage_and_its_end(tmp_path: Path) -> None:
    with RedisServer(args=["--appendonly", "yes", "--appendfsync", "always"]) as redis_server, \
            ServiceThread(tmp_path, counts=redis_server.url, store_probe_interval=0.2) as service, \
            grpc.insecure_channel(f"127.0.0.1:{service.port}") as ch:
        wait_until(lambda: health(ch) == SERVING, 10, "SERVING at start")
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="h", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        assert push(ch, 1).applied_units == 1

        redis_server.kill()
        down = time.monotonic()
        wait_until(lambda: health(ch) == NOT_SERVING, 10, "NOT_SERVING during the outage")
        assert time.monotonic() - down < 5
        with pytest.raises(grpc.RpcError) as caught:
            push(ch, 2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details().startswith("the counts store is unavailable (redis://"), caught.value.details()
        assert "ConnectionError" not in caught.value.details(), caught.value.details()  # no redis-py class name
        assert service.service is not None and service.service.store_ok is False

        redis_server.start()
        up = time.monotonic()
        wait_until(lambda: health(ch) == SERVING, 15, "SERVING after the outage")
        assert time.monotonic() - up < 5
        assert push(ch, 2).applied_units == 1
        assert push(ch, 1).duplicate  # the push acknowledged before the outage survived it (AOF)


def test_store_outage_messages_name_the_store() -> None:
    said = store_outage_message("redis://127.0.0.1:6379/0 is unavailable: BusyLoadingError: Redis is loading the "
                                "dataset in memory")
    assert said == ("the counts store is unavailable (redis://127.0.0.1:6379/0: loading its data after a restart: "
                    "Redis is loading the dataset in memory)")
    said = store_outage_message("redis+cluster://h:1,h:2 is unavailable: CLUSTERDOWN The cluster is down")
    assert said == "the counts store is unavailable (redis+cluster://h:1,h:2: CLUSTERDOWN The cluster is down)"
    assert store_outage_message("the service is stopping") == "the service is stopping"
