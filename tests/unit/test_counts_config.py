"""Unit tests of counts.config: options from URLs and the environment, the URL parsed once, passwords redacted."""

from __future__ import annotations

import pytest

from ngramcache.cache_service.counts.config import CountsStoreConfig, parse_url, redact_url
from ngramcache.client.kernel.errors import InvalidArgumentError


def test_config_from_url_and_env() -> None:
    config = CountsStoreConfig.from_url("redis://h:1/0?epoch_seconds=0.5&prefix=x&default_shards=none")
    assert (config.epoch_seconds, config.prefix, config.default_shards) == (0.5, "x", None)
    assert config.epoch_ms == 500
    assert CountsStoreConfig.from_url(None).url is None
    env = {"NGC_COUNTS_URL": "redis+cluster://a:1,b:2", "NGC_COUNTS_HISTORY_EPOCHS": "7",
           "NGC_COUNTS_PREFIX": "p"}
    config = CountsStoreConfig.from_env(env)
    assert (config.url, config.history_epochs, config.prefix) == ("redis+cluster://a:1,b:2", 7, "p")
    for bad in ("http://x", "redis://h?epoch_seconds=abc", "redis://h?default_buckets=1000"):
        with pytest.raises(InvalidArgumentError):
            CountsStoreConfig.from_url(bad)
    with pytest.raises(InvalidArgumentError):
        CountsStoreConfig.from_url(None, no_such_option=1)


def test_the_url_is_parsed_once_into_the_config() -> None:
    config = CountsStoreConfig.from_url("redis+cluster://u:pw@a:1,b:2?prefix=x")
    assert config.address.kind == "cluster" and config.address.hosts == (("a", 1), ("b", 2))
    assert config.address.redacted == "redis+cluster://u:***@a:1,b:2"
    assert CountsStoreConfig().address.kind == "embedded" and CountsStoreConfig().address.path is None
    embedded = CountsStoreConfig.from_url("embedded:///tmp/a%20b.snap?snapshot_seconds=0")
    assert (embedded.address.kind, embedded.address.path, embedded.snapshot_seconds) == \
        ("embedded", "/tmp/a b.snap", 0)
    with pytest.raises(InvalidArgumentError):  # a bad URL fails when the config is built, not later
        CountsStoreConfig(url="redis://h:port")


def test_passwords_are_redacted_everywhere() -> None:
    assert redact_url("redis://:hunter2@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://user:hunter2@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("rediss://hunter2@h:1") == "rediss://***@h:1"
    assert redact_url("redis+cluster://u:p%40ss@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("redis://h:1") == "redis://h:1" and redact_url(None) is None
    config = CountsStoreConfig.from_url("redis://user:hunter2@h:1/0")
    assert "hunter2" not in repr(config) and "hunter2" not in str(config)
    assert "hunter2" not in repr(config.address)
    with pytest.raises(InvalidArgumentError) as caught:
        CountsStoreConfig.from_url("http://user:hunter2@h")
    assert "hunter2" not in str(caught.value)


def test_parse_url_forms() -> None:
    parts = parse_url("rediss://us%3Aer:p%40ss@host:6380/3")
    assert (parts.ssl, parts.hosts, parts.db, parts.username, parts.password) == \
        (True, (("host", 6380),), 3, "us:er", "p@ss")
    parts = parse_url("redis+cluster://:pw@a:1,b:2,[::1]:3/?prefix=x")
    assert parts.kind == "cluster" and parts.hosts == (("a", 1), ("b", 2), ("::1", 3)) and parts.password == "pw"
    assert parse_url("redis://h").hosts == (("h", 6379),)
    for bad in ("redis://a:1,b:2", "redis://h:port", "redis://", "redis://h:1/db"):
        with pytest.raises(InvalidArgumentError):
            parse_url(bad)


def test_parse_sentinel_urls() -> None:
    parts = parse_url("rediss+sentinel://u:p%40ss@a:1,b/my-master/2?min_replicas=1")
    assert (parts.kind, parts.hosts, parts.master, parts.db, parts.ssl, parts.username, parts.password) == \
        ("sentinel", (("a", 1), ("b", 26379)), "my-master", 2, True, "u", "p@ss")
    assert parts.redacted == "rediss+sentinel://u:***@a:1,b/my-master/2"
    assert parse_url("redis+sentinel://h:26380/m").db == 0
    config = CountsStoreConfig.from_url("redis+sentinel://h/m?min_replicas=2&replica_timeout=0.5&sentinel_auth=yes")
    assert (config.min_replicas, config.replica_timeout_ms, config.sentinel_auth) == (2, 500, True)
    for bad, says in (("redis+sentinel://h:1", "no master name"), ("redis+sentinel://h:1/", "no master name"),
                      ("redis+sentinel:///m", "no host"), ("redis+sentinel://h/m/x", "bad database number"),
                      ("redis+sentinel://h:port/m", "bad port")):
        with pytest.raises(InvalidArgumentError, match=says) as caught:
            parse_url(bad)
        assert "\n" not in str(caught.value)


def test_replica_options_are_checked() -> None:
    assert CountsStoreConfig(socket_timeout=0.3).replica_timeout_ms == 150  # WAIT answers before the socket gives up
    for bad in ({"min_replicas": -1}, {"min_replicas": 65}, {"replica_timeout": 0}):
        with pytest.raises(InvalidArgumentError):
            CountsStoreConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        CountsStoreConfig.from_url("redis://h?sentinel_auth=maybe")
