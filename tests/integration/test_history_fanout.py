"""What a replica spends per client on the fleet history: the tail's records are put in wire form once, whatever the
number of clients that pull them (every client of a fleet pulls every record)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.corpus import FP, VOCAB
from helpers.service import ServiceThread, wait_until

from ngramcache.cache_service.servicers import counts as counts_servicer
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

pytestmark = pytest.mark.integration

RECORDS = 40
READERS = 8


def test_a_record_is_encoded_once_for_all_the_clients_that_pull_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = []

    def counting(tokens: np.ndarray) -> bytes:
        encoded.append(len(tokens))
        return tokens_to_bytes(tokens)

    monkeypatch.setattr(counts_servicer, "tokens_to_bytes", counting)
    with ServiceThread(tmp_path / "data", counts=f"embedded://{tmp_path / 'counts.snapshot'}?epoch_seconds=0") as svc, \
            grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(admin_pb2.CreateNamespaceRequest(
            name="h", tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
        stub = counts_pb2_grpc.CountsStub(ch)

        def pull(reader: int) -> counts_pb2.PullHistoryResponse:
            resp: counts_pb2.PullHistoryResponse = stub.PullHistory(counts_pb2.PullHistoryRequest(
                namespace="h", tokenizer_fingerprint=FP, after="", exclude_client_id=f"reader-{reader}"), timeout=10)
            return resp

        pull(0)  # the replica's tail of "h" starts: from now on its ring holds what is pushed
        records = [counts_pb2.HistoryRecord(seq=i, group="g", offset=0, tokens=tokens_to_bytes(
            np.arange(i, i + 5, dtype=np.int32))) for i in range(RECORDS)]
        stub.PushHistory(counts_pb2.PushHistoryRequest(namespace="h", tokenizer_fingerprint=FP, client_id="writer",
                                                       seq=0, records=records), timeout=10)
        wait_until(lambda: len(pull(0).records) == RECORDS, 10.0, "the records in the tail")
        time.sleep(0.2)
        encoded.clear()
        pages = [pull(r) for r in range(READERS)]
        for page in pages:  # every reader gets every record, whole
            assert [(r.client_id, r.seq, bytes_to_tokens(r.tokens).tolist()) for r in page.records] == [
                ("writer", i, list(range(i, i + 5))) for i in range(RECORDS)]
        # Before, each answer encoded its records again: READERS x RECORDS (320) encodings.
        assert len(encoded) <= RECORDS, f"{len(encoded)} encodings for {READERS} readers of {RECORDS} records"
