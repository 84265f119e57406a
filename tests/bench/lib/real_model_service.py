"""bench_real_model.py's service: a real `ngramcache serve` subprocess, and waits on its clients' pushes and mirrors."""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ngramcache import NgramClient
from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, static_files_pb2, static_files_pb2_grpc


class Service:
    """A real `ngramcache serve` subprocess (loopback, embedded store); stopped by its pid."""

    def __init__(self, workdir: Path) -> None:
        self.log = workdir / "service.log"
        code = "import sys; from ngramcache.cache_service.cli import main; sys.exit(main())"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", "0", "--data-dir",
                                          str(workdir / "service")], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.log.read_text(errors="replace"))
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the service did not start:\n{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port}"

    def create_namespace(self, name: str, fingerprint: bytes, vocab_size: int, static: Path) -> None:
        """A namespace bound to the tokenizer, with `static` published as generation 1."""
        data = static.read_bytes()
        channel = grpc.insecure_channel(self.address)
        try:
            admin_pb2_grpc.AdminStub(channel).CreateNamespace(admin_pb2.CreateNamespaceRequest(
                name=name, tokenizer_fingerprint=fingerprint, vocab_size=vocab_size), timeout=30)

            def chunks() -> Iterator[static_files_pb2.PublishRequest]:
                yield static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                    namespace=name, generation=1, size=len(data), sha256=hashlib.sha256(data).digest()))
                for i in range(0, len(data), 1 << 20):
                    yield static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(offset=i, data=data[i:i + (1 << 20)]))

            static_files_pb2_grpc.StaticFilesStub(channel).Publish(chunks(), timeout=120)
        finally:
            channel.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def flush(client: NgramClient) -> dict[str, Any]:
    """Waits until everything the client's drafter accepted is pushed and acknowledged."""
    time.sleep(2 * client.config.push_interval)  # the next drain takes what was accepted
    deadline = time.monotonic() + 60
    while True:
        s = client.stats()
        if s["pending_rows"] == 0 and s["acked_count"] == s["drained_count"]:
            return s
        if s["dropped_rows"] or time.monotonic() > deadline:
            raise SystemExit(f"pushes not acknowledged: {s['acked_count']:,} of {s['drained_count']:,} counts, "
                             f"{s['dropped_rows']:,} rows dropped")
        time.sleep(0.02)


def wait_visible(client: NgramClient, rows: np.ndarray, timeout: float = 60.0) -> tuple[int, int, float]:
    """Waits until the (4-gram, follower) pairs counted at least twice in `rows` (a context table of another
    client) are in `client`'s mirror; returns (visible, probed, seconds)."""
    probe = [(tuple(int(t) for t in r[1:5]), int(r[5])) for r in rows if r[0] == 4 and r[6] >= 2]
    t0 = time.monotonic()
    while True:
        table = client.drafter().dynamic
        seen = 0
        if table is not None:
            for key, follower in probe:
                tokens, _ = table.lookup(key)
                seen += int(follower in tokens.tolist())
        if seen == len(probe) or time.monotonic() - t0 > timeout:
            return seen, len(probe), time.monotonic() - t0
        time.sleep(0.05)
