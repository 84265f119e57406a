"""`ngramcache serve` as a user runs it: a real process, health, a push, SIGTERM, restart."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.service import SERVE_CLI, start_serve, stop_serve

from ngramcache.client._proto.v1 import admin_pb2, admin_pb2_grpc, counts_pb2, counts_pb2_grpc
from ngramcache.client.wire.codec import bytes_to_count_rows, delta_rows_to_bytes

pytestmark = pytest.mark.integration

FP = bytes(32)
CLI = SERVE_CLI
start, stop = start_serve, stop_serve


def test_serve_health_push_sigterm_restart_keeps_acknowledged_counts(tmp_path):
    p, port = start(tmp_path / "data")
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(service="")).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="ns", tokenizer_fingerprint=FP, vocab_size=100))
        rows = np.array([[2, 5, 6, -1, -1, 7, 3]], dtype=np.int32)
        ack = counts_pb2_grpc.CountsStub(ch).Push(counts_pb2.PushRequest(
            namespace="ns", tokenizer_fingerprint=FP, client_id="c", seq=1, rows=delta_rows_to_bytes(rows)))
        assert not ack.duplicate
        ch.close()
    finally:
        rc, err = stop(p)
    assert rc == 0, err
    assert "SIGTERM: draining" in err and "Traceback" not in err
    assert "answers again" not in err  # its first answer is no recovery: nothing was down

    # The acknowledged push survived the graceful stop (the embedded store's snapshot).
    p, port = start(tmp_path / "data")
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        pulled = list(counts_pb2_grpc.CountsStub(ch).Pull(counts_pb2.PullRequest(namespace="ns", tokenizer_fingerprint=FP), timeout=10))
        got = np.concatenate([bytes_to_count_rows(r.rows) for r in pulled])
        assert got.tolist() == [[2, 5, 6, -1, -1, 7, 3]]
        ch.close()
    finally:
        rc, err = stop(p, signal.SIGINT)
    assert rc == 130, err


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "port must be in 0..65535"),
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
    (["--max-sessions", "0"], "max_sessions must be an integer in 1..10000000"),
    (["--max-sessions", "99999999999999999999999"], "max_sessions must be an integer in 1..10000000"),
    (["--max-message-bytes", "9999999999999999999"], "max_message_bytes must be an integer in 1..2147483647"),
    (["--grace-period", "9" * 30], "grace_period must be a number of seconds in (0, 3600]"),
    (["--mirror-interval", "9" * 30], "mirror_interval must be a number of seconds in (0, 60]"),
    (["--mirror-interval", "nan"], "mirror_interval must be a number of seconds"),
    (["--tokens-file", "BINARY"], "not a text (TOML) file"),
])
def test_serve_refuses_bad_settings_in_one_line(tmp_path, args, message):
    if "BINARY" in args:
        binary = tmp_path / "x.ngc"
        binary.write_bytes(bytes(range(256)) * 4)
        args = [str(binary) if a == "BINARY" else a for a in args]
    r = subprocess.run([*CLI, "serve", "--data-dir", str(tmp_path), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr


def test_serve_reads_environment_and_config_file(tmp_path):
    cfg = tmp_path / "ngc.toml"
    cfg.write_text('max_sessions = 7\nmirror_interval = 0.5\n')
    env = dict(os.environ, NGC_MAX_STEP_TOKENS="123")
    p = subprocess.Popen([*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path / "d"), "--config", str(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        port = int(re.search(r":(\d+)", p.stdout.readline()).group(1))  # type: ignore[union-attr]
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        info = admin_pb2_grpc.AdminStub(ch).GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=10)
        assert info.limits.max_sessions == 7 and info.limits.max_step_tokens == 123
        ch.close()
    finally:
        stop(p)


def test_workers_share_one_port_and_stop_together(tmp_path, redis_standalone):
    p = subprocess.Popen([*CLI, "serve", "--workers", "2", "--port", "0", "--data-dir", str(tmp_path / "d"),
                          "--counts", redis_standalone.url + "?prefix=workers"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+) \(2 workers, pids (\d+), (\d+)\)", line)
        assert m, line
        port, pids = int(m.group(1)), [int(m.group(2)), int(m.group(3))]
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
        admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(name="w", tokenizer_fingerprint=FP, vocab_size=10))
        for _ in range(20):  # new connections land on either worker; both see the namespace (shared store)
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            assert admin_pb2_grpc.AdminStub(ch).GetNamespace(admin_pb2.GetNamespaceRequest(name="w"), timeout=10)
            ch.close()
    finally:
        rc, err = stop(p)
    assert rc == 0, err
    assert err.count("SIGTERM: draining") == 2
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in pids)


def test_workers_refuse_the_embedded_store(tmp_path):
    r = subprocess.run([*CLI, "serve", "--workers", "2", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "needs" not in r.stdout and "--counts redis://" in r.stderr


def test_store_down_at_start_serves_not_serving_until_it_comes(tmp_path):
    from helpers.redis_servers import RedisServer, free_port

    redis_port = free_port()
    port = 0
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path / "d"),
                             "--counts", f"redis://127.0.0.1:{redis_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ch = None
        deadline = time.monotonic() + 20
        # The interim server answers health before the store is up; its port is in the log.
        while ch is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
            for candidate in _listening_ports(proc.pid):
                ch = grpc.insecure_channel(f"127.0.0.1:{candidate}")
                port = candidate
        health = health_pb2_grpc.HealthStub(ch)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with RedisServer(port=redis_port):
            assert proc.stdout is not None
            line = proc.stdout.readline()  # printed once the store answered and the service is up
            assert f"listening on 127.0.0.1:{port}" in line, line
            deadline = time.monotonic() + 20
            while health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            admin_pb2_grpc.AdminStub(ch).CreateNamespace(
                admin_pb2.CreateNamespaceRequest(name="late", tokenizer_fingerprint=FP, vocab_size=10), timeout=10)
            ch.close()
            rc, err = stop(proc)
        assert rc == 0, err
        assert "unreachable" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_signal_while_the_store_is_down_stops_at_once(tmp_path, sig, code, workers):
    """The start waits for an unreachable store as long as it takes; SIGTERM or Ctrl-C meanwhile stops it in one
    line each, at once (not after the 30 s grace period that ends in a SIGKILL)."""
    from helpers.redis_servers import free_port

    proc = subprocess.Popen([*CLI, "serve", "--workers", str(workers), "--port", "0", "--data-dir", str(tmp_path / "d"),
                             "--counts", f"redis://127.0.0.1:{free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [proc.pid]
    try:
        deadline = time.monotonic() + 20
        while len(pids) <= (workers if workers > 1 else 0) or not any(_listening_ports(p) for p in pids):
            assert time.monotonic() < deadline and proc.poll() is None  # waiting for the interim health server(s)
            time.sleep(0.1)
            pids = [proc.pid, *_children(proc.pid)]
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        for pid in pids[::-1]:  # the workers too: they hold the pipes open
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == code and took < 5, (proc.returncode, took, err[-2000:])
    assert err.count(f"{sig.name} before the counts store answered: stopped") == workers, err
    assert "Traceback" not in err and "listening" not in out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _listening_ports(pid: int) -> list[int]:
    """TCP ports process `pid` listens on (from /proc: its sockets' inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_published_generations_are_mapped_after_a_restart_without_a_client(tmp_path):
    import hashlib

    from helpers.service import ServiceThread, wait_until

    from ngramcache import build_static_from_tokens
    from ngramcache.client._proto.v1 import static_files_pb2, static_files_pb2_grpc

    static = tmp_path / "g.ngc"
    build_static_from_tokens([np.arange(100, dtype=np.int32) % 7], static, vocab_size=10, fingerprint=FP, generation=3)
    data = static.read_bytes()
    counts = f"embedded://{tmp_path / 'counts.snapshot'}"
    with ServiceThread(tmp_path / "data", counts=counts) as svc:
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        admin_pb2_grpc.AdminStub(ch).CreateNamespace(
            admin_pb2.CreateNamespaceRequest(name="g", tokenizer_fingerprint=FP, vocab_size=10))
        static_files_pb2_grpc.StaticFilesStub(ch).Publish(iter([
            static_files_pb2.PublishRequest(header=static_files_pb2.PublishHeader(
                namespace="g", generation=3, size=len(data), sha256=hashlib.sha256(data).digest())),
            static_files_pb2.PublishRequest(chunk=static_files_pb2.FileChunk(data=data))]), timeout=10)
        ch.close()
    with ServiceThread(tmp_path / "data", counts=counts) as svc:  # a restart
        service = svc.service
        assert service is not None

        def mapped() -> bool:  # in the background, once health says SERVING
            live = service.registry.live()
            return "g" in live and live["g"].generation == 3

        wait_until(mapped, 15, "generation 3 of g to be mapped")
        ch = grpc.insecure_channel(f"127.0.0.1:{svc.port}")
        ns = admin_pb2_grpc.AdminStub(ch).GetNamespace(admin_pb2.GetNamespaceRequest(name="g"), timeout=10).namespace
        assert ns.latest_generation == 3
        ch.close()


def test_a_second_server_on_the_same_data_directory_exits_2_in_one_line(tmp_path):
    p, _ = start(tmp_path / "data")
    try:
        second = subprocess.run([*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path / "data")],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use by another ngramcache serve" in lines[0] and str(p.pid) in lines[0], lines
        assert p.poll() is None
    finally:
        rc, err = stop(p)
    assert rc == 0, err
    # Once the first has stopped, the directory is free again.
    p, port = start(tmp_path / "data")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        rc, err = stop(p)
    assert rc == 0, err


def _wait_until_importing(pid: int, timeout: float = 30.0) -> None:
    """Returns once process ``pid`` has numpy mapped: the interpreter's own start is over and the console script's
    guarded imports are under way (a SIGINT inside CPython's site initialisation is a fatal error no program can
    catch: that window, a few tens of ms, is not the command's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps") as f:
                if "numpy" in f.read():
                    return
        except OSError:
            return  # it exited already: the assertions below say how
        time.sleep(0.002)
    raise AssertionError(f"process {pid} did not start importing within {timeout:g} s")


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.3, 0.8])
def test_ctrl_c_at_any_moment_of_the_start_is_one_line_and_130(tmp_path, delay):
    """Ctrl-C while Python is still importing (numpy, grpc, the core: the console script's first half second) or
    just after, when the server starts."""
    script = os.path.join(os.path.dirname(sys.executable), "ngramcache")
    assert os.path.exists(script), "the console script is installed by pip install -e (tests/run_all.sh)"
    p = subprocess.Popen([script, "serve", "--port", "0", "--data-dir", str(tmp_path / "d")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_importing(p.pid)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # a failed test leaves no server running
            p.kill()
            p.communicate()
    assert p.returncode == 130, (p.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert len([line for line in err.splitlines() if not line[:4].isdigit()]) <= 2, err  # log lines aside


def test_a_start_cancelled_after_the_bind_stops_the_grpc_server(tmp_path, monkeypatch):
    """Ctrl-C is a cancellation of create_server; one that lands after the grpc server exists (here: while the
    first store check waits) stops that server, so nothing is left for its __del__ to schedule on the
    closed loop ("Event loop is closed" traceback, "AioServer.shutdown was never awaited")."""
    import asyncio
    import gc
    import socket
    import threading
    import warnings

    from ngramcache.cache_service import server as server_module
    from ngramcache.cache_service.config import ServiceConfig

    checking = asyncio.Event()
    ports: list[int] = []

    async def never_done(service, timeout=5.0):  # stands in for a store check that hangs: the start waits here
        ports.append(service.port)
        checking.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(server_module.Service, "check_store", never_done)

    async def main() -> None:
        task = asyncio.create_task(server_module.create_server(ServiceConfig(port=0, data_dir=str(tmp_path / "d"))))
        await checking.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        runs.start()
        runs.join(60)  # a server left running would keep asyncio.run from returning
        assert not runs.is_alive(), "the cancelled start left something running"
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
    with socket.socket() as s:  # the port was bound while the store check waited; it is closed now
        assert s.connect_ex(("127.0.0.1", ports[0])) != 0


# --- --log-level, --log-json and NGC_* typos -------------------------------------------------

ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _calls(port: int) -> None:
    """One call that succeeds (logged at DEBUG) and one that fails (NOT_FOUND, logged at INFO)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            admin.GetNamespace(admin_pb2.GetNamespaceRequest(name="missing"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("level", ["debug", "info", "warning"])
def test_log_level_sets_what_is_logged(tmp_path, level):
    p, port = start(tmp_path / "data", "--log-level", level)
    try:
        _calls(port)
    finally:
        rc, err = stop(p)
    assert rc == 0, err
    ok = "rpc /ngramcache.v1.Admin/GetServerInfo OK" in err
    failed = "rpc /ngramcache.v1.Admin/GetNamespace NOT_FOUND" in err
    started = "serving ngramcache.v1 on 127.0.0.1" in err
    assert (ok, failed, started) == {"debug": (True, True, True), "info": (False, True, True),
                                     "warning": (False, False, False)}[level], err
    assert "SIGTERM: draining" in err  # serve's own lines are not log records: every level shows them


def _json_lines(text: str) -> list[dict[str, object]]:
    records = []
    for line in text.splitlines():
        record = json.loads(line)  # every line, or this fails naming it
        assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= set(record), line
        assert ISO_UTC.fullmatch(str(record["time"])), line
        when = datetime.datetime.strptime(str(record["time"]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
        assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 300, line  # UTC, not local
        records.append(record)
    return records


def test_log_json_writes_only_json_lines_with_iso_8601_utc_times(tmp_path):
    # A zone far from UTC: a local time labelled Z would be hours off.
    env = dict(os.environ, TZ="Asia/Kolkata")
    p = subprocess.Popen([*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path / "d"), "--log-json",
                          "--log-level", "debug"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        first = p.stdout.readline()
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", first).group(1))  # type: ignore[union-attr]
        _calls(port)
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert [r["message"] for r in _json_lines(first + out)] == [f"ngramcache serve: listening on 127.0.0.1:{port}"]
    records = _json_lines(err)
    messages = [str(r["message"]) for r in records]
    assert any(m.startswith("serving ngramcache.v1 on 127.0.0.1") for m in messages), messages
    assert any(m.startswith("ngramcache serve: SIGTERM: draining") for m in messages), messages
    calls = {r["grpc_method"]: r for r in records if "grpc_method" in r}
    assert calls["/ngramcache.v1.Admin/GetNamespace"]["grpc_code"] == "NOT_FOUND"
    assert calls["/ngramcache.v1.Admin/GetServerInfo"]["level"] == "DEBUG"


@pytest.mark.parametrize("log_json", [False, True], ids=["text", "json"])
def test_serve_refuses_an_unknown_ngc_variable_naming_the_closest(tmp_path, log_json):
    env = dict(os.environ, NGC_PROT="5")
    r = subprocess.run([*CLI, "serve", "--data-dir", str(tmp_path), *(["--log-json"] if log_json else [])],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    message = _json_lines(lines[0])[0]["message"] if log_json else lines[0]
    assert message == ("ngramcache serve: error: unknown environment variable NGC_PROT (did you mean NGC_PORT?): "
                       "fix the name or unset it (NGC_<SETTING> variables are listed by ngramcache serve --help)")


def test_workers_log_json_at_the_level_given(tmp_path, redis_standalone):
    p = subprocess.Popen([*CLI, "serve", "--workers", "2", "--port", "0", "--data-dir", str(tmp_path / "d"),
                          "--counts", redis_standalone.url + "?prefix=logjson", "--log-json", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        first = p.stdout.readline()
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+) \(2 workers", first).group(1))  # type: ignore[union-attr]
        _calls(port)
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    _json_lines(first + out)
    records = _json_lines(err)
    assert [r["message"] for r in records if r["level"] == "INFO"] == ["ngramcache serve: SIGTERM: draining (up to 10 s)..."] * 2
    assert not any("grpc_method" in r for r in records)  # the NOT_FOUND call is logged at INFO: below warning


def test_a_loopback_redis_that_is_down_is_met_with_how_to_start_one(tmp_path):
    """A user trying the fleet quickstart without a Redis saw only 'unreachable ... retrying' every few seconds."""
    from helpers.redis_servers import free_port

    port = free_port()
    p = subprocess.Popen([*SERVE_CLI, "serve", "--port", "0", "--data-dir", str(tmp_path / "data"), "--counts",
                          f"redis://127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()  # the first warning comes at once
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert "unreachable" in line and f"on one machine: redis-server --port {port} --daemonize yes" in line, line
