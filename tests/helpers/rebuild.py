"""What the rebuild tests share: namespaces created over gRPC, counts pushed by a client, generations published (over
gRPC or with `ngramcache publish`), rebuilds run with `ngramcache rebuild`, and the counts of the store and of a file."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from helpers.corpus import FP, VOCAB, motif_corpus
from helpers.service import wait_until
from ngramcache import NgramClient, StaticCache, build_static_from_tokens
from ngramcache.client._proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    counts_pb2,
    counts_pb2_grpc,
    static_files_pb2,
    static_files_pb2_grpc,
)
from ngramcache.client.wire.codec import bytes_to_count_rows

__all__ = ["COPY", "OTHER", "base_file", "corpus", "create", "file_pairs", "gen_path", "publish", "publish_cli", "push_all",
           "rebuild_cli", "store_pairs"]


def corpus(seed: int, n: int = 3000) -> np.ndarray:
    """About `n` tokens of 10 motifs repeated (the same seed, the same tokens): n-grams recur as in real text."""
    return motif_corpus(seed, n, motifs=10)


def create(address: str, prefix: str = "r-") -> str:
    """A new namespace of the FP/VOCAB tokenizer on the service at `address`, named `prefix` + 8 hex digits."""
    name = prefix + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(address) as ch:
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name=name, tokenizer_fingerprint=FP, vocab_size=VOCAB), timeout=10)
    return name


def store_pairs(address: str, namespace: str, n: int = 2) -> Counter[tuple[int, ...]]:
    """The store's counts of n-grams of size n: (key..., follower) -> count."""
    with grpc.insecure_channel(address) as ch:
        chunks = counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(namespace=namespace,
                                                                            tokenizer_fingerprint=FP), timeout=30)
        rows = np.concatenate([bytes_to_count_rows(c.rows) for c in chunks])
    return Counter({(*r[1:1 + n], r[5]): int(r[6]) for r in rows.tolist() if r[0] == n})


def file_pairs(path: Path) -> Counter[tuple[int, ...]]:
    """A static file's counts: (key..., follower) -> count."""
    return Counter({(*r[1:1 + r[0]], r[5]): int(r[6]) for r in StaticCache.open(path).to_rows().tolist()})


def publish(address: str, namespace: str, path: Path) -> None:
    """The file at `path` published over gRPC (StaticFiles.Publish) as the generation its header names."""
    data = path.read_bytes()

    def requests():  # type: ignore[no-untyped-def]
        yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
            namespace=namespace, generation=StaticCache.open(path).generation, size=len(data),
            sha256=hashlib.sha256(data).digest()))
        yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=0, data=data))

    with grpc.insecure_channel(address) as ch:
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(requests(), timeout=30)


def rebuild_cli(address: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`ngramcache rebuild --namespace NAMESPACE --server ADDRESS ARGS`, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", "rebuild", "--namespace", namespace,
                           "--server", address, *args], capture_output=True, text=True, timeout=120)


def push_all(client: NgramClient, tokens: np.ndarray) -> None:
    """`tokens` accepted by the client's drafter; returns once the service acknowledged every push."""
    before = client.stats()["drained_count"]
    client.drafter().accept(1, tokens)
    wait_until(lambda: client.stats()["pending_rows"] == 0
               and client.stats()["acked_count"] == client.stats()["drained_count"] > before, what="pushes acknowledged")
    client.drafter().reset(1)


def publish_cli(address: str, namespace: str, path: Path) -> subprocess.CompletedProcess[str]:
    """`ngramcache publish PATH --namespace NAMESPACE --server ADDRESS`, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "ngramcache.cache_service.cli", "publish", str(path), "--namespace",
                           namespace, "--server", address], capture_output=True, text=True, timeout=120)


COPY = np.random.default_rng(29).permutation(40).astype(np.int32)  # 40 distinct tokens: one follower per 2-gram
OTHER = (40 + np.random.default_rng(30).permutation(24)).astype(np.int32)  # what the fleet writes: tokens 40..63


def base_file(tmp_path: Path, generation: int = 1, name: str = "code") -> Path:
    """A corpus generation as `ngramcache build` makes it: COPY four times, with a corpus index."""
    path = tmp_path / f"{name}-{generation}.ngc"
    build_static_from_tokens([np.tile(COPY, 4)], str(path), vocab_size=VOCAB, ngram_size=2, fingerprint=FP,
                             generation=generation, corpus_index=True)
    return path


def gen_path(data: Path, ns: str, generation: int) -> Path:
    """Where the replica whose data folder is `data` keeps `generation` of `ns`."""
    return data / "static" / ns / f"{generation:020d}.ngc"
