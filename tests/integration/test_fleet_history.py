"""The fleet history through a real service on loopback: PushHistory / PullHistory over the embedded store (and Redis),
two match-mode NgramClients drafting from each other's sequences, and a client's live group pulled before a backlog."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.service import ServiceThread, wait_until

from ngramcache import NgramClient, RemoteDrafter
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.kernel.errors import InvalidArgumentError
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

pytestmark = pytest.mark.integration

FP = b"\x05" * 32
VOCAB = 1000
FAST = {"pull_interval": 0.05, "push_interval": 0.02, "connect_timeout": 5.0, "ready_timeout": 20.0,
        "close_timeout": 5.0, "mode": "match"}


def embedded(tmp_path: Path) -> str:
    return f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0"


def record(seq: int, *tokens: int, offset: int = 0, group: str = "") -> counts_pb2.HistoryRecord:
    return counts_pb2.HistoryRecord(seq=seq, group=group, offset=offset,
                                    tokens=tokens_to_bytes(np.array(tokens, dtype=np.int32)))


def create(ch: grpc.Channel, name: str) -> None:
    admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
        name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)


def test_push_and_pull_history_over_grpc(tmp_path: Path) -> None:
    # Long polls of up to a minute (the default caps them at 5 s): the long poll below waits on its push, not a clock.
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path), history_max_wait_ms=60_000) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        info = admin_pb2_grpc.AdminStub(ch).GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=10)
        assert "counts.history" in info.capabilities
        assert (info.limits.max_history_records, info.limits.max_history_record_tokens,
                info.limits.max_history_wait_ms) == (256, 4096, 60_000)
        create(ch, "h")
        stub = counts_pb2_grpc.CountsStub(ch)

        def push(client: str, seq: int, *records: counts_pb2.HistoryRecord, fp: bytes = FP,
                 ns: str = "h") -> counts_pb2.PushHistoryResponse:
            resp: counts_pb2.PushHistoryResponse = stub.PushHistory(counts_pb2.PushHistoryRequest(
                namespace=ns, tokenizer_fingerprint=fp, client_id=client, seq=seq, records=list(records)), timeout=10)
            return resp

        def pull(after: str = "", timeout: float = 10, **fields: object) -> counts_pb2.PullHistoryResponse:
            resp: counts_pb2.PullHistoryResponse = stub.PullHistory(counts_pb2.PullHistoryRequest(
                namespace="h", tokenizer_fingerprint=FP, after=after, **fields), timeout=timeout)  # type: ignore[arg-type]
            return resp

        first = push("a", 0, record(1, 1, 2, 3, group="g"), record(1, 4, 5, offset=3, group="g"))
        assert (first.duplicate, first.records_stored) == (False, 2)
        again = push("a", 0, record(1, 1, 2, 3, group="g"), record(1, 4, 5, offset=3, group="g"))
        assert again.duplicate and again.records_stored == 0  # the retry stored nothing
        push("b", 0, record(7, 9, 9, group="other"))
        page = pull()
        assert [(r.client_id, r.seq, r.offset, bytes_to_tokens(r.tokens).tolist()) for r in page.records] == [
            ("a", 1, 0, [1, 2, 3]), ("a", 1, 3, [4, 5]), ("b", 7, 0, [9, 9])]
        assert all(abs(r.time_ms - time.time() * 1000) < 60_000 for r in page.records) and not page.gap
        assert [r.client_id for r in pull(exclude_client_id="a").records] == ["b"]
        assert [r.group for r in pull(groups=["g"]).records] == ["g", "g"]
        one = pull(max_records=1)
        assert len(one.records) == 1 and [r.seq for r in pull(one.cursor).records] == [1, 7]

        # A long poll: nothing after the cursor, so the call waits; a push through the replica ends it. The poll would
        # wait a minute on its own, past the test's 30 s: only the push can end it in time.
        got: list[counts_pb2.PullHistoryResponse] = []
        waiter = threading.Thread(target=lambda: got.append(pull(page.cursor, timeout=90, wait_ms=60_000)))
        waiter.start()
        time.sleep(0.3)  # (the push may come first on a loaded machine: the poll then answers at once, as well)
        push("c", 0, record(3, 42))
        waiter.join(30)
        assert not waiter.is_alive(), "the push did not end the long poll"
        assert [r.client_id for r in got[0].records] == ["c"]
        empty = pull(got[0].cursor, wait_ms=200)
        assert empty.records == [] and empty.cursor == got[0].cursor

        def code(call: object) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as caught:
                call()  # type: ignore[operator]
            return caught.value.code()

        assert code(lambda: push("a", 1, record(1, VOCAB))) == grpc.StatusCode.INVALID_ARGUMENT
        assert code(lambda: push("a", 1, record(1))) == grpc.StatusCode.INVALID_ARGUMENT  # no token
        assert code(lambda: push("a", 1, record(1, 1, group="bad group"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert code(lambda: push("a", 1, *[record(1, 1)] * 257)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code(lambda: push("a", 1, record(1, *[1] * 4097))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code(lambda: push("a", 1, record(1, 1), fp=b"\x06" * 32)) == grpc.StatusCode.FAILED_PRECONDITION
        assert code(lambda: push("a", 1, record(1, 1), ns="nope")) == grpc.StatusCode.NOT_FOUND
        assert code(lambda: pull("not a cursor")) == grpc.StatusCode.INVALID_ARGUMENT
        assert push("a", 1, record(1, 6)).records_stored == 1  # nothing refused took seq 1
        ch.close()


def drafts_continuation(client: NgramClient, seq: int, text: np.ndarray, cut: int, timeout: float) -> float:
    """Seconds until ``client``'s drafter drafts ``text[cut:cut+8]`` after ``text[:cut]`` (inf: never)."""
    drafter = client.drafter()
    want = text[cut:cut + 8].tolist()
    drafter.accept(seq, text[:cut])
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if drafter.draft(seq, text[:cut], 8).tolist() == want:
            return time.monotonic() - started
        time.sleep(0.005)
    return float("inf")


def share_between_two_clients(address: str, ns: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(20)
    with NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
            NgramClient(address, ns, (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b:
        lags = []
        for trial in range(5):
            text = rng.integers(0, VOCAB, 64, dtype=np.int32)
            a.drafter().accept(trial, text[:16])  # the prompt
            a.drafter().accept(trial, text)  # what it generated
            lags.append(drafts_continuation(b, 1000 + trial, text, 24, timeout=10.0))
        assert max(lags) < 5.0, lags
        # B's last record may still be on its way to A (B drafted A's text before its own push was pulled).
        wait_until(lambda: a.stats()["history_pulled_tokens"] >= 5 * 24, timeout=10, what="A pulling B's records")
        # and A's last records on their way to B (B drafted each text from its first records).
        wait_until(lambda: b.stats()["history_pulled_tokens"] >= 5 * 64, timeout=10, what="B pulling A's records")
        sa = a.stats()
        sb = b.stats()
        assert sa["history"] and sa["history_pushed_tokens"] >= 5 * 64 and sa["history_dropped_tokens"] == 0
        assert sb["history_pulled_tokens"] >= 5 * 64 and sb["history_gaps"] == 0
        assert sb["history_lag_ms_p50"] is not None and sb["history_lag_ms_p99"] < 5000
        assert sb["history_entries"] > sa["history_entries"] - 5 * 64  # B holds A's sequences besides its own
        # Each gets the other's records, never its own back.
        assert sa["history_pulled_tokens"] == sb["history_pushed_tokens"] == 5 * 24


def test_two_match_mode_clients_draft_from_each_others_sequences(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        create(ch, "fleet")
        share_between_two_clients(f"127.0.0.1:{svc.port}", "fleet", tmp_path)
        assert svc.service.metrics is not None
        registry = svc.service.metrics.registry
        assert (registry.get_sample_value("ngramcache_history_pushed_records_total") or 0) >= 5
        assert (registry.get_sample_value("ngramcache_history_served_records_total") or 0) >= 5
        ch.close()


def test_two_clients_share_through_redis(tmp_path: Path, redis_standalone: object) -> None:
    url = redis_standalone.url  # type: ignore[attr-defined]
    with ServiceThread(tmp_path / "data", counts=url) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        ns = f"fleet-{int(time.time() * 1000) % 10**9}"
        create(ch, ns)
        share_between_two_clients(f"127.0.0.1:{svc.port}", ns, tmp_path)
        admin_pb2_grpc.AdminStub(ch).DropNamespace(admin_pb2.DropNamespaceRequest(name=ns), timeout=10)
        ch.close()


def test_two_clients_share_through_a_partitioned_history_on_a_cluster(tmp_path: Path, redis_cluster: object) -> None:
    """The namespace's history in 12 partitions over 3 masters: each client's mirror gets every record of the other
    (from every partition), with no gap, through the service's tail."""
    url = redis_cluster.url  # type: ignore[attr-defined]
    with ServiceThread(tmp_path / "data", counts=url) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        ns = f"fleet-{int(time.time() * 1000) % 10**9}"
        create(ch, ns)
        assert svc.service.runner.store.namespace_info(ns).history_partitions == 12  # type: ignore[union-attr]
        share_between_two_clients(f"127.0.0.1:{svc.port}", ns, tmp_path)
        admin_pb2_grpc.AdminStub(ch).DropNamespace(admin_pb2.DropNamespaceRequest(name=ns), timeout=10)
        ch.close()


def test_group_and_mode_errors(tmp_path: Path) -> None:
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        create(ch, "g")
        address = f"127.0.0.1:{svc.port}"
        with NgramClient(address, "g", (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as nc:
            nc.set_group(1, "prompt-1")
            with pytest.raises(InvalidArgumentError, match="group must be"):
                nc.set_group(1, "no spaces")
        compatible = {**FAST, "mode": "compatible"}
        with pytest.raises(InvalidArgumentError, match="needs mode='match'"):
            NgramClient(address, "g", (FP, VOCAB), cache_dir=tmp_path / "b", history=True, **compatible)
        with NgramClient(address, "g", (FP, VOCAB), cache_dir=tmp_path / "c", **compatible) as nc:
            assert nc.stats()["history"] is False
            with pytest.raises(InvalidArgumentError, match="set_group needs"):
                nc.set_group(1, "x")
        ch.close()


def test_the_service_match_drafter_shares_the_fleet_history(tmp_path: Path) -> None:
    """RemoteDrafter match sessions draft what a client published, and a client drafts what a session accepted."""
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        create(ch, "svc")
        address = f"127.0.0.1:{svc.port}"
        rng = np.random.default_rng(7)
        with NgramClient(address, "svc", (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as client, \
                RemoteDrafter(address, "svc", (FP, VOCAB), mode="match") as remote:
            remote.draft(0, np.array([1, 2, 3], dtype=np.int32), 4)  # the namespace's match drafter exists now
            text = rng.integers(0, VOCAB, 64, dtype=np.int32)
            client.drafter().accept(1, text)
            want = text[24:32].tolist()
            deadline = time.monotonic() + 10
            while remote.draft(2, text[:24], 8).tolist() != want:
                assert time.monotonic() < deadline, "the session never drafted the client's sequence"
                time.sleep(0.02)
            other = rng.integers(0, VOCAB, 64, dtype=np.int32)
            remote.draft(3, other, 1)  # the session accepts the whole sequence
            assert drafts_continuation(client, 4, other, 24, timeout=10.0) < 10.0
        ch.close()


def test_group_first_mirror_drafts_a_siblings_output_before_its_tail_reaches_it(tmp_path: Path) -> None:
    """Behind a backlog of unrelated records, a sibling's sequence of this client's live group is draftable after the
    mirror's first rounds while the tail (8 records a page, slowed by the byte budget) is still far behind; when the
    tail reaches the sibling's records, nothing is appended twice."""
    noise, per_push, length = 600, 200, 8
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        create(ch, "gf")
        stub = counts_pb2_grpc.CountsStub(ch)
        rng = np.random.default_rng(33)

        def push(client: str, seq: int, records: list[counts_pb2.HistoryRecord]) -> None:
            resp = stub.PushHistory(counts_pb2.PushHistoryRequest(
                namespace="gf", tokenizer_fingerprint=FP, client_id=client, seq=seq, records=records), timeout=10)
            assert resp.records_stored == len(records)

        for batch in range(noise // per_push):
            push("others", batch, [record(i, *rng.integers(0, VOCAB, length).tolist(), group=f"req-{i}")
                                   for i in range(batch * per_push, (batch + 1) * per_push)])
        sibling = rng.integers(0, VOCAB, 64, dtype=np.int32)
        push("sibling", 0, [record(1, *sibling[16 * k:16 * k + 16].tolist(), offset=16 * k, group="rollout-1")
                            for k in range(4)])

        options = {**FAST, "history_pull_records": 8, "history_max_bytes_per_s": 4000,
                   "drafter_options": {"match_params": {"history_piece": 1}}}
        with NgramClient(f"127.0.0.1:{svc.port}", "gf", (FP, VOCAB), cache_dir=tmp_path / "c", **options) as nc:
            drafter = nc.drafter()
            nc.set_group(5, "rollout-1")  # the client is about to generate a sibling: the group is live
            want = sibling[24:32].tolist()
            wait_until(lambda: drafter.draft(5, sibling[:24], 8).tolist() == want, timeout=10,
                       what="the sibling's continuation drafted")
            first = nc.stats()
            assert (first["history_group_pulled_records"], first["history_group_pulled_tokens"]) == (4, 64), first
            assert first["history_pulled_records"] < noise / 2, first  # the tail is still far behind
            assert first["history_group_pull"]

            wait_until(lambda: nc.stats()["history_pulled_records"] == noise + 4, timeout=60,
                       what="the tail reaching the sibling's records")
            last = nc.stats()
            assert last["history_pulled_tokens"] == noise * length + 64
            assert last["history_appended_tokens"] == noise * length + 64  # every token once
            assert last["history_repeated_tokens"] == 64  # the sibling's, brought again by the tail
            # history_piece 1: no overlap copied; one separator per text started (600 noise sequences, the sibling).
            assert last["history_entries"] == noise * length + 64 + noise + 1
            assert last["history_size"] == last["history_entries"]  # the old name, still readable
        ch.close()


def test_siblings_prompt_is_stored_once_the_stats_add_up_and_the_sibling_keeps_its_start(tmp_path: Path) -> None:
    """Two siblings publish one prompt (their default group: its hash) and different answers. The store keeps the
    prompt once: the second sibling's copy is counted skipped, in its reply, its client's stats and the service's
    metrics, so what was pushed = what is readable + what was skipped. A third client drafts the second sibling's
    answer from right after the prompt, and so does a RemoteDrafter match session: the prompt is put back in front of
    its sequence.

    The service's metrics count every sender's skips, the service's own included: the match session publishes what it
    accepted (under replica:<id>, every 0.05 s), here the third client's 18 tokens exactly, a near-duplicate of its
    record, skipped. So the metrics' skips are checked before the session (the total came out 2 once under load:
    the session's copy had been published before the metrics were read; not a retry counted twice)."""
    rng = np.random.default_rng(41)
    prompt = rng.integers(0, VOCAB, 16, dtype=np.int32)
    answers = [rng.integers(0, VOCAB, 48, dtype=np.int32) for _ in range(2)]
    with ServiceThread(tmp_path / "data", counts=embedded(tmp_path)) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        create(ch, "sib")
        address = f"127.0.0.1:{svc.port}"
        with NgramClient(address, "sib", (FP, VOCAB), cache_dir=tmp_path / "a", **FAST) as a, \
                NgramClient(address, "sib", (FP, VOCAB), cache_dir=tmp_path / "b", **FAST) as b, \
                NgramClient(address, "sib", (FP, VOCAB), cache_dir=tmp_path / "c", **FAST) as c:
            for client, answer in zip((a, b), answers):
                client.drafter().accept(1, prompt)  # the prompt alone first: it names the group
                wait_until(lambda cl=client: cl.stats()["history_pushed_tokens"] == len(prompt), what="the prompt pushed")
                client.drafter().accept(1, np.concatenate([prompt, answer]))
                wait_until(lambda cl=client: cl.stats()["history_pushed_tokens"] == len(prompt) + 48,
                           what="the answer pushed")
            sa, sb = a.stats(), b.stats()
            for s in (sa, sb):
                assert s["history_pushed_tokens"] == (s["history_stored_tokens"] + s["history_skipped_tokens"]
                                                      + s["history_duplicate_tokens"])
            assert (sa["history_skipped_records"], sa["history_skipped_tokens"]) == (0, 0)
            assert (sb["history_skipped_records"], sb["history_skipped_tokens"]) == (1, len(prompt))
            # C drafts B's answer after the prompt and two of B's tokens: an 18-token match through the prompt (B's
            # answer alone would match 2 tokens, which drafts 2 at most).
            b_text = np.concatenate([prompt, answers[1]])
            assert drafts_continuation(c, 9, b_text, len(prompt) + 2, timeout=10.0) < 10.0
            assert c.stats()["history_restored_tokens"] == len(prompt)
            # The clients' skips, all of them: B's copy of the prompt (C's record, at offset 0 in its own group, is a
            # prompt no one else sent before it: stored).
            assert svc.service is not None and svc.service.metrics is not None
            value = svc.service.metrics.registry.get_sample_value
            assert value("ngramcache_history_skipped_records_total") == 1
            assert value("ngramcache_history_skipped_bytes_total") == 4 * len(prompt)
            # The service's own match drafter (RemoteDrafter sessions) puts the prompt back the same way.
            with RemoteDrafter(address, "sib", (FP, VOCAB), mode="match") as remote:
                cut = len(prompt) + 2
                wait_until(lambda: remote.draft(5, b_text[:cut], 8).tolist() == b_text[cut:cut + 8].tolist(),
                           timeout=10, what="a match session drafting B's answer after the prompt")
        stub = counts_pb2_grpc.CountsStub(ch)
        readable = stub.PullHistory(counts_pb2.PullHistoryRequest(namespace="sib", tokenizer_fingerprint=FP),
                                    timeout=10)
        siblings = {sa["client_id"], sb["client_id"]}  # C published what it drafted from too
        stored = sum(len(bytes_to_tokens(r.tokens)) for r in readable.records if r.client_id in siblings)
        assert stored == sa["history_stored_tokens"] + sb["history_stored_tokens"] == 2 * 48 + len(prompt)
        assert stored + sb["history_skipped_tokens"] == sa["history_pushed_tokens"] + sb["history_pushed_tokens"]
        assert value("ngramcache_history_pushed_bytes_total") == 4 * sum(len(bytes_to_tokens(r.tokens))
                                                                          for r in readable.records)
        ch.close()
