"""bench_fleet_load.py's load: the client processes (each running many NgramClients in match mode, paced by one driver
thread to an offered rate in tokens/s, a group of 8 siblings at a time) and the marker (push-to-draftable between two
clients on different replicas)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ngramcache import NgramClient

NS = "fleet"  # helpers.fleet.Replica's namespace
FP = hashlib.sha256(b"bench-fleet-load").digest()
VOCAB = 32_000
SIBLINGS = 8
N_DRAFT = 8
CLIENT_OPTIONS = {"mode": "match", "connect_timeout": 30.0, "ready_timeout": 60.0, "close_timeout": 60.0}
SUMMED = ("acked_rows", "acked_count", "drained_rows", "drained_count", "dropped_rows", "dropped_count", "overloaded",
          "pending_rows", "unconfirmed_rows", "unconfirmed_count", "pulled_bytes", "history_drained_tokens", "history_drained_records",
          "history_stored_records", "history_stored_tokens", "history_skipped_records", "history_skipped_tokens",
          "history_duplicate_records", "history_duplicate_tokens", "history_dropped_records", "history_dropped_tokens",
          "history_unconfirmed_tokens", "history_pending_tokens", "history_pulled_bytes", "history_pulled_tokens",
          "history_group_pulled_bytes")


def summed(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The SUMMED fields of several clients' stats, added up."""
    return {k: float(sum(s.get(k) or 0 for s in stats)) for k in SUMMED}


class Group:
    """One client's current group: 8 siblings of one prompt, each advancing by 1-8 tokens a step."""

    def __init__(self, rng: np.random.Generator, first_seq: int, name: str) -> None:
        prompt = (rng.zipf(1.3, int(rng.integers(64, 129))) % VOCAB).astype(np.int32)
        base = (rng.zipf(1.3, 400) % VOCAB).astype(np.int32)
        self.name = name
        self.texts = []
        for _ in range(SIBLINGS):  # siblings sampled at a temperature: mostly the same tokens
            own = base.copy()
            change = rng.random(len(own)) < 0.3
            own[change] = (rng.zipf(1.3, int(change.sum())) % VOCAB).astype(np.int32)
            self.texts.append(np.concatenate([prompt, own[:int(rng.integers(200, 401))]]))
        self.prompt = len(prompt)
        self.seqs = [first_seq + i for i in range(SIBLINGS)]
        self.pos = [0] * SIBLINGS  # tokens accepted so far; 0: not started


def client_process(conn: Connection, index: int, n_clients: int, addresses: list[str], cache_dir: str,
                   niceness: int = 0) -> None:
    """Runs ``n_clients`` NgramClients and one driver paced by ("rate", tokens/s) messages; answers ("stats",) and
    ("stop",) with the clients' summed stats (stop closes them first). ``niceness`` is added to the process's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops this process
    if niceness:
        os.nice(niceness)
    clients = []
    for i in range(n_clients):
        k = index * n_clients + i
        order = [addresses[(k + j) % len(addresses)] for j in range(len(addresses))]
        clients.append(NgramClient(order, NS, (FP, VOCAB), cache_dir=cache_dir, **CLIENT_OPTIONS))
    drafters = [c.drafter() for c in clients]
    rng = np.random.default_rng(1000 + index)
    next_seq = [1] * n_clients
    groups: list[Group | None] = [None] * n_clients
    fed = drafts = failures = 0
    busy = 0.0  # seconds the driver spent in draft and accept calls
    rate, t_base, fed_base = 0.0, time.monotonic(), 0
    # A fleet already running: each client's first group starts part-way through its outputs (not counted as fed),
    # so the steps measure the steady mix of prompts and steps, not every sequence's prompt at once.
    for c in range(n_clients):
        group = groups[c] = Group(rng, next_seq[c], f"p{index}c{c}g{next_seq[c]}")
        next_seq[c] += SIBLINGS
        phase = group.prompt + int(rng.integers(0, 200))
        for s, seq in enumerate(group.seqs):
            clients[c].set_group(seq, group.name)
            drafters[c].accept(seq, group.texts[s][:phase])
            group.pos[s] = phase
    conn.send(("ready", os.getpid()))
    cursor = 0
    while True:
        if conn.poll(0 if rate else 0.05):
            msg = conn.recv()
            if msg[0] == "rate":
                rate, t_base, fed_base = float(msg[1]), time.monotonic(), fed
            elif msg[0] == "stats":
                conn.send((summed([c.stats() for c in clients]), fed, drafts, failures, busy))
            elif msg[0] == "stop":
                for c in clients:
                    c.close()
                conn.send((summed([c.stats() for c in clients]), fed, drafts, failures, busy))
                return
            continue
        if not rate:
            continue
        ahead = t_base + (fed - fed_base) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(min(ahead, 0.05))
            continue
        if ahead < -1.0:  # behind by more than a second: what was not fed is not offered again
            t_base, fed_base = time.monotonic(), fed
        c = cursor % n_clients
        cursor += 1
        current = groups[c]
        if current is None or all(p >= len(t) for p, t in zip(current.pos, current.texts)):
            if current is not None:
                for seq in current.seqs:
                    drafters[c].reset(seq)
            current = groups[c] = Group(rng, next_seq[c], f"p{index}c{c}g{next_seq[c]}")
            next_seq[c] += SIBLINGS
        group = current
        t_step = time.perf_counter()
        for s, seq in enumerate(group.seqs):  # one step of every live sibling
            text, pos = group.texts[s], group.pos[s]
            if pos >= len(text):
                continue
            try:
                if pos == 0:
                    clients[c].set_group(seq, group.name)
                    drafters[c].accept(seq, text[:group.prompt])
                    group.pos[s] = pos = group.prompt
                    fed += pos
                drafters[c].draft(seq, text[:pos], N_DRAFT)
                drafts += 1
                end = min(len(text), pos + int(rng.integers(1, 9)))
                drafters[c].accept(seq, text[:end])
                fed += end - pos
                group.pos[s] = end
            except Exception:  # a failed draft or accept is what this benchmark counts
                failures += 1
                group.pos[s] = len(text)
        busy += time.perf_counter() - t_step


class Marker(threading.Thread):
    """A marker sequence accepted by client A, timed until client B drafts its continuation, over and over."""

    def __init__(self, a: NgramClient, b: NgramClient, timeout: float, pause: float = 0.5) -> None:
        super().__init__(name="marker", daemon=True)
        self.a, self.b, self.timeout, self.pause = a, b, timeout, pause
        self.samples: list[tuple[float, float]] = []  # (monotonic time of the accept, seconds to draftable or inf)
        self.stop_event = threading.Event()

    def run(self) -> None:
        da, db = self.a.drafter(), self.b.drafter()
        rng = np.random.default_rng(7)
        trial = 0
        while not self.stop_event.is_set():
            trial += 1
            text = rng.integers(0, VOCAB, 64, dtype=np.int32)  # random: only A's sequence can draft it
            want = text[40:48].tolist()
            group = f"marker{trial}"
            self.a.set_group(2 * trial, group)
            self.b.set_group(2 * trial + 1, group)
            db.accept(2 * trial + 1, text[:40])
            started = time.monotonic()
            da.accept(2 * trial, text[:16])
            da.accept(2 * trial, text)
            took = float("inf")
            while time.monotonic() - started < self.timeout and not self.stop_event.is_set():
                if db.draft(2 * trial + 1, text[:40], N_DRAFT).tolist() == want:
                    took = time.monotonic() - started
                    break
                time.sleep(0.001)
            da.reset(2 * trial)
            db.reset(2 * trial + 1)
            if not self.stop_event.is_set():
                self.samples.append((started, took))
            self.stop_event.wait(self.pause)  # a light load of its own (about 100 tokens a trial), not counted

    def between(self, t0: float, t1: float) -> list[float]:
        return [took for started, took in self.samples if t0 <= started < t1]

