"""A fleet on one machine for the fault test and the soak benchmark: `ngramcache serve` replica
processes (as nodes would run them) and worker threads drafting real text through NgramClient."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np

from helpers.redis_servers import free_port
from ngramcache import NgramClient

NS = "fleet"


class Replica:
    """One `ngramcache serve` process, as a node would run it."""

    def __init__(self, tmp: Path, index: int, counts: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.data_dir = tmp / f"replica-{index}"
        self.log = tmp / f"replica-{index}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ngramcache.cache_service.cli", "serve", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), "--counts", counts, "--mirror-interval", "0.25",
                 "--peer-sync-interval", "0.5", "--rebuild-lease-seconds", "6", *extra,
                 *(["--log-calls"] if os.environ.get("NGC_FLEET_DEBUG") else [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while "serving ngramcache.v1" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {index} did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def generation_file(self, generation: int) -> Path:
        return self.data_dir / "static" / NS / f"{generation:020d}.ngc"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def stdlib_texts() -> list[np.ndarray]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 4000)[:120]
    return [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int32) for p in files]


class Worker(threading.Thread):
    """A client drafting and accepting real text, as an inference worker does, counting failures and stalls."""

    def __init__(self, index: int, client: NgramClient, texts: list[np.ndarray], stop: threading.Event) -> None:
        super().__init__(name=f"worker-{index}", daemon=True)
        self.index, self.client, self.texts, self.stop_event = index, client, texts, stop
        self.drafts = self.failures = self.accepted = 0
        self.slowest = 0.0
        self.errors: list[str] = []

    def run(self) -> None:
        drafter = self.client.drafter()
        k = self.index * 17
        seq = self.index * 1_000_000
        while not self.stop_event.is_set():
            text = self.texts[k % len(self.texts)]
            k += 1
            seq += 1
            for pos in range(64, len(text), 48):
                if self.stop_event.is_set():
                    break
                prefix = text[:pos]
                t0 = time.perf_counter()
                try:
                    draft = drafter.draft(seq, prefix, 8)
                    drafter.accept(seq, prefix)
                except Exception as e:  # a failed draft is what this test exists to catch
                    self.failures += 1
                    self.errors.append(f"{type(e).__name__}: {e}")
                    continue
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                self.drafts += 1
                truth = text[pos:pos + len(draft)]
                self.accepted += int(np.sum(np.cumprod(draft[:len(truth)] == truth)))
                time.sleep(0.002)
            drafter.reset(seq)


