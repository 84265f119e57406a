"""The history mirror's rounds against an in-memory PullHistory (and SubscribeHistory over it): live groups first while the tail is behind, each token
appended once, the group cursor starting at the tail's position, the fallback for a server that ignores groups.

The real service is in tests/integration/test_fleet_history.py (test_group_first_mirror_*)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from ngramcache import InvalidArgumentError
from ngramcache.client._proto.v1 import counts_pb2
from ngramcache.client.sync import ClientConfig
from ngramcache.client.sync.history import HistoryStats, LiveGroups
from ngramcache.client.sync.history_mirror import HistoryMirror
from ngramcache.client.sync.state import SyncState
from ngramcache.client.wire.codec import tokens_to_bytes

FP = b"\x07" * 32


class Store:
    """PullHistory over a list of records: the cursor is the index of the last record scanned, as the service's moves
    past the records a reader skips; ``ignore_groups`` answers like a server that does not know the filter."""

    def __init__(self, ignore_groups: bool = False, refuse_groups: bool = False) -> None:
        self.records: list[counts_pb2.HistoryRecord] = []
        self.ignore_groups = ignore_groups
        self.refuse_groups = refuse_groups
        self.requests: list[counts_pb2.PullHistoryRequest] = []

    def add(self, client: str, seq: int, offset: int, tokens: list[int], group: str) -> None:
        self.records.append(counts_pb2.HistoryRecord(client_id=client, seq=seq, offset=offset, group=group,
                                                     tokens=tokens_to_bytes(np.array(tokens, dtype=np.int32))))

    async def PullHistory(self, request: counts_pb2.PullHistoryRequest, **_: object) -> counts_pb2.PullHistoryResponse:
        self.requests.append(request)
        if self.refuse_groups and request.groups:
            raise InvalidArgumentError("no groups here")
        groups = set() if self.ignore_groups else set(request.groups)
        out: list[counts_pb2.HistoryRecord] = []
        at = int(request.after) if request.after else -1
        for i in range(at + 1, len(self.records)):
            r = self.records[i]
            if r.client_id != request.exclude_client_id and (not groups or r.group in groups):
                if len(out) >= request.max_records:
                    break
                out.append(r)
            at = i
        return counts_pb2.PullHistoryResponse(records=out, cursor=str(at) if at >= 0 else request.after)

    def SubscribeHistory(self, request: counts_pb2.PullHistoryRequest, **_: object) -> Stream:
        return Stream(self, request)


class Stream:
    """A SubscribeHistory stream over `Store`: each read is the PullHistory page after the last cursor it answered."""

    def __init__(self, store: Store, request: counts_pb2.PullHistoryRequest) -> None:
        self.store = store
        self.request = request

    async def read(self) -> counts_pb2.PullHistoryResponse:
        resp = await self.store.PullHistory(self.request)
        following = counts_pb2.PullHistoryRequest()
        following.CopyFrom(self.request)
        following.after = resp.cursor
        self.request = following
        return resp

    def cancel(self) -> None:
        pass


class Drafter:
    def __init__(self) -> None:
        self.added: list[tuple[int, list[int]]] = []

    def add_history(self, source: int, tokens: np.ndarray) -> None:
        self.added.append((source, tokens.tolist()))

    def flush_history(self, idle_seconds: float) -> int:
        return 0

    def tokens(self) -> list[int]:
        return [t for _, part in self.added for t in part]


def mirror_over(store: Store, page: int = 5, **options: Any) -> tuple[HistoryMirror, Drafter, LiveGroups]:
    config = ClientConfig(addresses=("127.0.0.1:1",), namespace="ns", fingerprint=FP, vocab_size=100_000,
                          cache_dir="/tmp", mode="match", history_pull_records=page, **options)
    drafter = Drafter()
    state = SyncState(config, drafter)  # type: ignore[arg-type]

    class Chan:
        counts = store

    chan = Chan()

    async def retrying(what: str, call: Any, until: float | None = None) -> Any:
        return await call(chan)

    state.retrying = retrying  # type: ignore[method-assign]
    live = LiveGroups()
    return HistoryMirror(state, HistoryStats(), live), drafter, live


def backlog_then_sibling(store: Store, noise: int = 40) -> list[int]:
    """``noise`` one-record sequences of other groups, then a sibling's sequence of group "g" in 3 records."""
    for i in range(noise):
        store.add("other", i, 0, [1000 + 10 * i + k for k in range(4)], f"n{i}")
    sibling = list(range(500, 512))
    for k in range(3):
        store.add("sib", 7, 4 * k, sibling[4 * k:4 * k + 4], "g")
    return sibling


def rounds(mirror: HistoryMirror, n: int) -> None:
    async def body() -> None:
        for _ in range(n):
            await mirror.pull()

    asyncio.run(body())
    asyncio.run(mirror.state.channels.close())


def test_a_live_groups_records_come_in_the_first_round_and_once_when_the_tail_reaches_them() -> None:
    store = Store()
    sibling = backlog_then_sibling(store)
    mirror, drafter, live = mirror_over(store)
    live.touch("g")
    rounds(mirror, 1)
    assert drafter.tokens()[:12] == sibling  # the group pull went first
    assert mirror.cursor == "4" and mirror.behind  # the tail: one page of 5 of 43 records
    assert list(store.requests[0].groups) == ["g"] and store.requests[0].wait_ms == 0
    assert (mirror.stats.group_pulled_records, mirror.stats.group_pulled_tokens) == (3, 12)
    rounds(mirror, 10)
    tokens = drafter.tokens()
    assert len(tokens) == len(set(tokens)) == 40 * 4 + 12  # every token once
    assert mirror.stats.repeated_tokens == 12 and mirror.stats.appended_tokens == 40 * 4 + 12
    assert not mirror.behind and mirror.cursor == "42"


def test_no_group_pull_while_the_tail_is_at_the_head_or_nothing_is_live() -> None:
    store = Store()
    backlog_then_sibling(store, noise=2)
    mirror, _, live = mirror_over(store, page=100)
    rounds(mirror, 1)  # nothing live: the tail alone
    assert [list(r.groups) for r in store.requests] == [[]]
    live.touch("g")
    store.add("sib", 7, 12, [600, 601], "g")
    rounds(mirror, 1)  # live, but the last tail page was not full: the tail brings it
    assert [list(r.groups) for r in store.requests] == [[], []]
    assert mirror.group_cursor == "4" and mirror.stats.group_pulls == 0


def test_a_group_newly_live_starts_at_the_tails_position() -> None:
    store = Store()
    for i in range(20):
        store.add("other", i, 0, [2000 + i], "h" if i == 2 else f"n{i}")
    mirror, drafter, live = mirror_over(store, page=5)
    live.touch("g")
    rounds(mirror, 1)  # g pulled from "" (the tail's position then); the tail reads records 0..4
    assert store.requests[0].after == "" and mirror.group_cursor == "19"
    live.touch("h")  # h's record 2 was brought by the tail already; the group cursor starts again at the tail's
    rounds(mirror, 1)
    assert store.requests[2].after == "4" and list(store.requests[2].groups) == ["h", "g"]
    assert drafter.tokens().count(2002) == 1


def test_a_server_that_ignores_groups_turns_group_pulls_off_and_loses_nothing() -> None:
    store = Store(ignore_groups=True)
    sibling = backlog_then_sibling(store, noise=8)
    mirror, drafter, live = mirror_over(store, page=5)
    live.touch("g")
    rounds(mirror, 6)
    assert mirror.groups_per_pull == 0 and mirror.stats.group_pulls == 1
    tokens = drafter.tokens()
    assert len(tokens) == len(set(tokens)) == 8 * 4 + 12 and set(sibling) <= set(tokens)


def test_a_server_that_refuses_groups_turns_group_pulls_off_and_the_tail_goes_on() -> None:
    store = Store(refuse_groups=True)
    backlog_then_sibling(store, noise=8)
    mirror, drafter, live = mirror_over(store, page=5)
    live.touch("g")
    rounds(mirror, 4)
    assert mirror.groups_per_pull == 0 and mirror.stats.group_pulls == 0
    assert [list(r.groups) for r in store.requests] == [["g"], [], [], [], []]
    assert len(drafter.tokens()) == 8 * 4 + 12


def test_live_groups_most_recent_first_bounded_and_expiring() -> None:
    live = LiveGroups(ttl=10.0)
    live.touch("a", now=0.0)
    live.touch("b", now=1.0)
    live.touch("", now=1.5)  # no group
    live.touch("a", now=2.0)
    live.touch("c", now=3.0)
    assert live.recent(8, now=3.0) == ["c", "a", "b"]
    assert live.recent(2, now=3.0) == ["c", "a"]
    assert live.recent(8, now=11.5) == ["c", "a"]  # b was last used at 1.0
    assert live.recent(8, now=20.0) == []


def test_the_byte_budget_paces_the_reads_of_the_stream() -> None:
    store = Store()
    for i in range(20):
        store.add("other", i, 0, list(range(1000 + 50 * i, 1050 + 50 * i)), f"n{i}")  # about 230 bytes a record
    mirror, drafter, _ = mirror_over(store, page=5, history_max_bytes_per_s=4000)
    started = time.monotonic()
    rounds(mirror, 4)
    took = time.monotonic() - started
    pulled = mirror.stats.pulled_bytes
    assert len(drafter.tokens()) == 20 * 50 and mirror.stats.tail_streams == 1  # one stream, every record once
    assert pulled / 4000 * 0.9 <= took < pulled / 4000 + 1.0, (pulled, took)  # about a second per 4,000 bytes
