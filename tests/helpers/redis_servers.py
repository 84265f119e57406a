"""Real redis-server processes for tests and benchmarks: loopback only, free ports, temp dirs, stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

import redis

__all__ = ["RedisClusterProcesses", "RedisServer", "free_port", "require_redis_binaries"]


def require_redis_binaries() -> tuple[str, str]:
    """Paths of redis-server and redis-cli, or RuntimeError saying how to install them."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError("redis-server and redis-cli are needed (Debian/Ubuntu: apt-get install redis-server)")
    return server, cli


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, port + 10000 free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and (not cluster_bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One redis-server on 127.0.0.1. `stop`/`kill` signal its PID only; `start` again reuses port and dir."""

    def __init__(self, *, args: Sequence[str] = (), port: int | None = None, cluster: bool = False,
                 directory: str | None = None) -> None:
        self.server_bin, _ = require_redis_binaries()
        self.port = port or free_port(cluster_bus=cluster)
        self.dir = directory or tempfile.mkdtemp(prefix="ngc-redis-")
        self._own_dir = directory is None
        self.cluster = cluster
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [self.server_bin, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
               "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
               "--logfile", os.path.join(self.dir, "redis.log")]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000"]
        return cmd + self.args

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, password=self._password())
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log")
                try:
                    if client.ping():
                        return self
                except redis.BusyLoadingError:
                    pass
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _password(self) -> str | None:
        if "--requirepass" in self.args:
            return self.args[self.args.index("--requirepass") + 1]
        return None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self._password(), **kwargs)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL by PID: no shutdown save, no AOF rewrite; what was fsynced survives."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case a test left it stopped
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisClusterProcesses:
    """A Redis Cluster of ``masters`` redis-server processes on loopback, no replicas."""

    def __init__(self, masters: int = 3, args: Sequence[str] = ()) -> None:
        _, self.cli_bin = require_redis_binaries()
        self.nodes = [RedisServer(cluster=True, args=args) for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([self.cli_bin, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
                       stdin=subprocess.DEVNULL)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports cluster_state:ok and sees every master."""
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            for node in self.nodes:
                client = node.client(socket_timeout=1)
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    known = sum(1 for line in client.execute_command("CLUSTER", "NODES").decode().splitlines()
                                if "master" in line and "fail" not in line)
                    ok = ok and "cluster_state:ok" in text and known == len(self.nodes)
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    ok = False
                finally:
                    client.close()
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def __enter__(self) -> RedisClusterProcesses:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
