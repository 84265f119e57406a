"""Unit tests of counts.schema: the Redis key names."""

from __future__ import annotations

from redis.crc import key_slot

from ngramcache.cache_service.counts import schema


def test_shard_tags_spread_evenly_over_slots_and_keys_of_a_shard_share_a_slot() -> None:
    tags = schema.shard_tags("ns", "0123abcd", 64)
    slots = [key_slot(t.encode()) for t in tags]
    assert [s * 64 // 16384 for s in slots] == list(range(64))
    keys = schema.shard_keys("ngc", "ns", "0123abcd", 64)[5]
    names = [keys.state, keys.changes, keys.history, keys.index, keys.dedup("client-1"), keys.bucket(12345)]
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert schema.bucket_of_key(keys.bucket(12345).encode()) == 12345
