"""A llama-server process for benchmarks: started on a free loopback port, asked over HTTP, stopped by its pid."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ServerError(Exception):
    """llama-server did not start, answered an error, or answered something unexpected (the message says which)."""


@dataclass(frozen=True)
class Timings:
    """The `timings` of one /completion response: llama-server's own clock and draft counters."""

    prompt_n: int  # prompt tokens evaluated (those not reused from the slot's cache)
    prompt_ms: float
    predicted_n: int  # tokens generated, the first (from the prompt's logits) included
    predicted_ms: float  # from the end of the prompt to the last token
    predicted_per_second: float  # (predicted_n - 1) / predicted_ms: the first token costs no decode step
    draft_n: int  # drafted tokens the model verified (0 when nothing was drafted)
    draft_n_accepted: int

    @property
    def steps(self) -> int:
        """Decode steps after the first token: each yields one token of the model plus the drafted tokens it kept."""
        return max(self.predicted_n - 1 - self.draft_n_accepted, 0)

    @property
    def ms_per_step(self) -> float:
        return self.predicted_ms / self.steps if self.steps else 0.0


def parse_timings(response: dict[str, Any]) -> Timings:
    """The timings of a /completion response (llama-server leaves out draft_n and draft_n_accepted when it drafted nothing).

    Raises:
        ServerError: the response has no `timings` object, or a field is missing or not a number.
    """
    t = response.get("timings")
    if not isinstance(t, dict):
        raise ServerError(f"the response has no timings object (keys: {sorted(response)})")

    def num(key: str, default: float | None = None) -> float:
        value = t.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ServerError(f"timings.{key} is {value!r}, not a number")
        return float(value)

    return Timings(prompt_n=int(num("prompt_n")), prompt_ms=num("prompt_ms"), predicted_n=int(num("predicted_n")),
                   predicted_ms=num("predicted_ms"), predicted_per_second=num("predicted_per_second"),
                   draft_n=int(num("draft_n", 0)), draft_n_accepted=int(num("draft_n_accepted", 0)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Completion:
    text: str
    tokens: list[int]
    timings: Timings
    seconds: float  # the HTTP request's wall time, seen by the client


class LlamaServer:
    """One llama-server process on 127.0.0.1; `ready_seconds` is the time from exec to /health answering 200.

    Not thread-safe: one caller at a time (the benchmark sends one request at a time to its one slot).
    """

    def __init__(self, binary: Path, model: Path, args: list[str], log: Path, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_seconds = time.perf_counter() - t0

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.perf_counter() > deadline:
                raise ServerError(f"llama-server was not ready within the timeout:\n{self.tail()}")
            time.sleep(0.02)

    def rss_mb(self) -> float:
        """The process's resident memory (VmRSS of /proc/<pid>/status) in MB, 0 where /proc is not there."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def complete(self, prompt: list[int], n_predict: int, timeout: float = 600.0) -> Completion:
        """Greedy completion of the token ids `prompt` (temperature 0), reusing the slot's cached prefix."""
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True,
                           "return_tokens": True, "stream": False}).encode()
        req = urllib.request.Request(f"{self.url}/completion", data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                payload = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"/completion answered {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ServerError(f"/completion failed: {e}\n{self.tail()}") from None
        seconds = time.perf_counter() - t0
        return Completion(str(payload.get("content", "")), [int(x) for x in payload.get("tokens") or []],
                          parse_timings(payload), seconds)

    def stop(self) -> None:
        """SIGTERM to this process (by its pid), SIGKILL if it has not exited within 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
