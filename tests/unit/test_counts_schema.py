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


def test_history_partitions_take_one_slice_of_slots_each_and_partition_0_is_the_old_stream() -> None:
    for namespace in ("ns", "demo", "a.b", "x" * 64):
        for partitions in (2, 3, 12, 64):
            tags = schema.history_partition_tags(namespace, "0123abcd", partitions)
            assert tags[0] == namespace
            slices = sorted(-(-(2 * key_slot(t.encode()) + 1) * partitions // 32768) - 1 for t in tags)
            assert slices == list(range(partitions))
    # On a 3-master Cluster made by redis-cli (0-5460, 5461-10922, 10923-16383) 12 partitions are 4 a master.
    slots = [key_slot(t.encode()) for t in schema.history_partition_tags("ns", "0123abcd", 12)]
    assert sorted(sum(lo <= s <= hi for s in slots) for lo, hi in ((0, 5460), (5461, 10922), (10923, 16383))) == [4, 4, 4]
    keys = schema.history_partition_keys("ngc", "ns", "0123abcd", 3)
    assert keys[0].all() == schema.history_keys("ngc", "ns") and keys[0].guard == schema.meta_key("ngc", "ns")
    assert keys[1].guard == keys[1].stat and len({key_slot(n.encode()) for n in keys[2].all()}) == 1
