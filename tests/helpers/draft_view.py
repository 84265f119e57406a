"""Reading a namespace's draft view from a service with a plain Pull, for the draft view's integration tests."""

from __future__ import annotations

import time

import grpc

from helpers.corpus import FP
from ngramcache import CountTable
from ngramcache.client._proto.v1 import counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows

__all__ = ["pull_view", "settled_view"]


def pull_view(address: str, namespace: str) -> tuple[str, int, CountTable]:
    """The whole draft view as one plain Pull answers it: (view_id, version, its rows in a table)."""
    with grpc.insecure_channel(address) as ch:
        chunks = list(counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(
            namespace=namespace, tokenizer_fingerprint=FP, view=counts_pb2.PULL_VIEW_DRAFT), timeout=30))
    table = CountTable()
    for c in chunks:
        table.assign_rows(bytes_to_count_rows(c.rows), zero_removes=True)
    assert chunks[-1].complete and all(c.reset for c in chunks)
    return chunks[-1].view_id, chunks[-1].version, table


def settled_view(address: str, namespace: str) -> tuple[str, int, CountTable]:
    """The view once the service's mirror has applied every push (its version stops moving)."""
    last = pull_view(address, namespace)
    while True:
        time.sleep(0.3)  # six refreshes of the service's mirror
        now = pull_view(address, namespace)
        if now[:2] == last[:2]:
            return now
        last = now
