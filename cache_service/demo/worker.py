"""A demo worker process (one node's inference worker, driven by JSON lines on stdin) and `WorkerProcess`, the demo's handle on it."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError

VOCAB = 256  # byte tokens
PROBE_TIMEOUT = 10.0  # seconds a worker watches for one probe's n-gram
REPLAY_TIMEOUT = 300.0  # seconds one worker step may take at most


def _mapped_generation_files() -> list[str]:
    """The static generation files this process maps (from /proc/self/maps; empty where there is none)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split(None, 5)[5].strip() for line in f
                           if line.count(" ") >= 5 and line.rstrip().endswith(".ngc")})
    except (OSError, IndexError):
        return []


class _WorkerState:
    """The clients of one worker process and the commands it answers (see `worker_main`)."""

    def __init__(self) -> None:
        from ngramcache import NgramClient

        self.clients: dict[str, NgramClient] = {}
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def handle(self, msg: dict[str, Any]) -> Iterator[dict[str, Any]]:
        cmd = msg["cmd"]
        if cmd == "connect":
            yield self.connect(msg["address"], msg["namespace"], msg["cache_dir"], msg.get("mode", "compatible"))
        elif cmd == "replay":
            yield self.replay(msg["namespace"], msg["files"], msg["n_ctx"], msg["n_draft"], msg.get("after"))
        elif cmd == "flush":
            yield self.flush(msg["namespace"])
        elif cmd == "flush_history":
            yield self.flush_history(msg["namespace"])
        elif cmd == "wait_history":
            yield self.wait_history(msg["namespace"], msg["tokens"])
        elif cmd == "mark":
            yield self.mark(msg["namespace"], msg["tokens"])
        elif cmd == "watch":
            yield from self.watch(msg["namespace"], msg["probe"], msg["follower"])
        elif cmd == "close":
            self.close()
            yield {"closed": True}
        else:
            raise InvalidArgumentError(f"unknown command {cmd!r}")

    def connect(self, address: str, namespace: str, cache_dir: str, mode: str = "compatible") -> dict[str, Any]:
        from ngramcache import UNTAGGED, NgramClient

        t0 = time.perf_counter()
        client = NgramClient(address, namespace, (UNTAGGED, VOCAB), cache_dir=cache_dir, mode=mode)
        self.clients[namespace] = client
        s = client.stats()
        return {"seconds": time.perf_counter() - t0, "generation": s["generation"], "downloads": s["downloads"],
                "downloaded_bytes": s["downloaded_bytes"], "mapped": _mapped_generation_files(),
                "push_interval": client.config.push_interval, "pull_interval": client.config.pull_interval}

    def wait_for_pulls(self, namespace: str, pulls: int) -> None:
        """Returns after `pulls` mirror pulls completed since the call: the first may have started earlier, so two
        guarantee one that began after everything acknowledged before the call."""
        client = self.clients[namespace]
        seen: set[float] = set()
        since = time.monotonic()
        deadline = since + 30.0
        while len(seen) < pulls:
            lag = client.stats()["mirror_lag_seconds"]
            now = time.monotonic()
            if lag is not None and now - lag > since:
                seen.add(round(now - lag, 3))
            if now > deadline:
                raise NgramCacheError(f"the mirror of {namespace} did not pull for 30 s")
            time.sleep(0.01)

    def replay(self, namespace: str, files: list[str], n_ctx: int, n_draft: int,
               after: dict[str, Any] | None = None) -> dict[str, Any]:
        """Replays `files` as a model generating them would be drafted for (llama-lookup-stats' simulation):
        each file in requests of `n_ctx` tokens starting from its first token; per step, draft, accept the
        drafted prefix that matches the text plus the model's own next token. Starts after two mirror pulls
        and, with `after` ({"probe", "follower"}: another worker's last accept), once it drafts that n-gram."""
        self.wait_for_pulls(namespace, 2)
        if after is not None:
            seen = list(self.watch(namespace, after["probe"], after["follower"]))[-1]  # "clash": drafted already
            if seen.get("t") is None and "clash" not in seen:
                raise NgramCacheError(f"the other worker's last n-gram did not reach {namespace} within {PROBE_TIMEOUT:g} s")
        drafter = self.clients[namespace].drafter()
        t_draft = 0.0
        per_file = []
        t_start = time.perf_counter()
        for path in files:
            tokens = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8).astype(np.int32)
            drafted = accepted = steps = generated = 0
            for start in range(0, len(tokens) - 1, n_ctx):
                chunk = tokens[start:start + n_ctx]
                truth = chunk.tolist()
                end = len(truth)
                if end < 2:
                    continue
                seq = self.next_seq()
                n = 1
                drafter.accept(seq, chunk[:1])
                while n < end:
                    t0 = time.perf_counter()
                    draft = drafter.draft(seq, chunk[:n], n_draft)
                    t_draft += time.perf_counter() - t0
                    ok = 0
                    for token in draft.tolist()[: end - n]:
                        if token != truth[n + ok]:
                            break
                        ok += 1
                    drafted += len(draft)
                    accepted += ok
                    steps += 1
                    n = min(n + ok + 1, end)  # the accepted draft tokens and the model's own next token
                    drafter.accept(seq, chunk[:n])
                generated += end - 1
                drafter.reset(seq)
            per_file.append([drafted, accepted, steps, generated])
        return {"files": per_file, "t_draft": t_draft, "seconds": time.perf_counter() - t_start}

    def flush(self, namespace: str) -> dict[str, Any]:
        """Waits until everything accepted so far is pushed and acknowledged (applied exactly once)."""
        client = self.clients[namespace]
        time.sleep(2 * client.config.push_interval)  # the next drain takes what was accepted
        deadline = time.monotonic() + 30.0
        while True:
            s = client.stats()
            if s["pending_rows"] == 0 and s["acked_count"] == s["drained_count"]:
                return {"acked_rows": s["acked_rows"], "acked_count": s["acked_count"], "dropped_rows": s["dropped_rows"]}
            if s["dropped_rows"] or time.monotonic() > deadline:
                raise NgramCacheError(f"pushes to {namespace} not acknowledged: {s['acked_count']:,} of "
                                      f"{s['drained_count']:,} counts, {s['dropped_rows']:,} rows dropped")
            time.sleep(0.01)

    def flush_history(self, namespace: str) -> dict[str, Any]:
        """Waits until every token accepted so far is published to the fleet history (acknowledged)."""
        client = self.clients[namespace]
        time.sleep(2 * client.config.history_push_interval)  # the next drain takes what was accepted
        deadline = time.monotonic() + 30.0
        while True:
            s = client.stats()
            if s["history_pending_tokens"] == 0 and s["history_pushed_tokens"] >= s["history_drained_tokens"]:
                return {"tokens": s["history_pushed_tokens"], "records": s["history_pushed_records"],
                        "dropped_tokens": s["history_dropped_tokens"]}
            if time.monotonic() > deadline:
                raise NgramCacheError(f"the fleet history of {namespace} not published within 30 s: "
                                      f"{s['history_pushed_tokens']:,} of {s['history_drained_tokens']:,} tokens")
            time.sleep(0.01)

    def wait_history(self, namespace: str, tokens: int) -> dict[str, Any]:
        """Waits until this client's history mirror pulled `tokens` tokens (another worker's, published), or pulled
        some and then nothing more for a second (the store keeps a repeated prompt once, so a few published tokens
        are never pulled), 30 s at most."""
        client = self.clients[namespace]
        now = time.monotonic()
        deadline, pulled, changed = now + 30.0, -1, now
        while True:
            s = client.stats()
            now = time.monotonic()
            if s["history_pulled_tokens"] != pulled:
                pulled, changed = s["history_pulled_tokens"], now
            if pulled >= tokens or (pulled > 0 and now - changed > 1.0) or now > deadline:
                return {"pulled_tokens": s["history_pulled_tokens"], "pulled_bytes": s["history_pulled_bytes"],
                        "lag_ms_p50": s["history_lag_ms_p50"], "lag_ms_p99": s["history_lag_ms_p99"]}
            time.sleep(0.01)

    def mark(self, namespace: str, tokens: list[int]) -> dict[str, Any]:
        """Accepts `tokens` in a new sequence; answers the time it did (CLOCK_MONOTONIC: one clock for every process
        of the machine, so B's time of seeing it can be subtracted)."""
        drafter = self.clients[namespace].drafter()
        seq = self.next_seq()
        t = time.monotonic()
        drafter.accept(seq, np.array(tokens, dtype=np.int32))
        drafter.reset(seq)
        return {"t": t}

    def watch(self, namespace: str, probe: list[int], follower: int) -> Iterator[dict[str, Any]]:
        """Drafts after `probe` until the draft is `follower`; answers once when watching, once when seen."""
        drafter = self.clients[namespace].drafter()
        seq = self.next_seq()
        tokens = np.array(probe, dtype=np.int32)
        try:
            if drafter.draft(seq, tokens, 1).tolist() == [follower]:
                yield {"clash": True}  # drafted before anyone accepted it: not a new n-gram here
                return
            yield {"watching": True}
            deadline = time.monotonic() + PROBE_TIMEOUT
            while time.monotonic() < deadline:
                if drafter.draft(seq, tokens, 1).tolist() == [follower]:
                    yield {"t": time.monotonic()}
                    return
                time.sleep(0.001)
            yield {"t": None}
        finally:
            drafter.reset(seq)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()


def worker_main() -> int:
    """A demo worker process: reads one JSON command per line on stdin, writes its answers as JSON lines on
    stdout; logs go to stderr. Ends on the close command or at the end of stdin (the demo is gone)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = _WorkerState()
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                for reply in state.handle(msg):
                    sys.stdout.write(json.dumps(reply) + "\n")
                    sys.stdout.flush()
            except NgramCacheError as e:
                sys.stdout.write(json.dumps({"error": str(e)}) + "\n")
                sys.stdout.flush()
            if msg["cmd"] == "close":
                break
    finally:
        state.close()
    return 0


class WorkerProcess:
    """A worker started as ``python -c``, in a session of its own: the terminal's Ctrl-C (or ``timeout -s INT``,
    which signals the whole process group) reaches only the demo, which stops the worker in `stop`."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # closed in stop()
        argv = [sys.executable, "-c",
                "import sys; from ngramcache.cache_service.demo import worker_main; sys.exit(worker_main())"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, start_new_session=True)
        self.pid = self.proc.pid
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"demo-worker-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for line in self.proc.stdout:
                self._replies.put(json.loads(line))
        self._replies.put(None)

    def _exited(self) -> NgramCacheError:
        try:
            code: int | str = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = "none yet"
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log_path.read_text().splitlines() if ln.strip()]
            if lines:
                return NgramCacheError(f"worker {self.name} (pid {self.pid}) exited, code {code}: {lines[-1].strip()}")
        return NgramCacheError(f"worker {self.name} (pid {self.pid}) exited, code {code}")

    def send(self, cmd: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise self._exited() from None

    def reply(self, timeout: float = REPLAY_TIMEOUT) -> dict[str, Any]:
        """The worker's next answer.

        Raises:
            NgramCacheError: it answered with an error, exited, or gave no answer within `timeout` seconds.
        """
        try:
            r = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise NgramCacheError(f"worker {self.name} (pid {self.pid}) gave no answer within {timeout:g} s") from None
        if r is None:
            raise self._exited()
        if "error" in r:
            raise NgramCacheError(f"worker {self.name}: {r['error']}")
        return r

    def request(self, cmd: str, timeout: float = REPLAY_TIMEOUT, **fields: Any) -> dict[str, Any]:
        self.send(cmd, **fields)
        return self.reply(timeout)

    def close(self) -> None:
        """Closes the worker's clients (flushing their pushes) and waits for it to exit."""
        self.request("close", timeout=30.0)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            raise NgramCacheError(f"worker {self.name} (pid {self.pid}) did not exit 10 s after closing") from None

    def stop(self) -> None:
        """Terminates the worker if it still runs (SIGTERM, then SIGKILL after 3 s) and reaps it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if pipe is not None:
                    pipe.close()
        self._log.close()

