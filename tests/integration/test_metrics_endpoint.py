"""The Prometheus endpoint on a real loopback port: it serves a scrape, stops answering once closed, and a port in use is an OSError."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ngramcache.cache_service.metrics import (
    Metrics,
    start_metrics_http_server,
)


def test_http_server_serves_metrics_on_a_free_loopback_port() -> None:
    m = Metrics()
    m.drafted(2)
    server, port = start_metrics_http_server(m, "127.0.0.1", 0)
    try:
        assert port > 0 and server.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
        scraped = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
        assert scraped["ngramcache_drafted_tokens_total"] == 2
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError, match="Connection refused"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    server.close()  # twice is fine



def test_http_server_port_in_use_raises_oserror() -> None:
    first, port = start_metrics_http_server(Metrics())
    try:
        with pytest.raises(OSError, match="Address already in use"):
            start_metrics_http_server(Metrics(), "127.0.0.1", port)
    finally:
        first.close()
