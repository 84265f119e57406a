"""deploy/: the container's command runs here as the image runs it (same entrypoint, same NGC_* environment, read
from the files).

No container engine runs here, so the image is never built: the tests start its ENTRYPOINT and
CMD (the `ngramcache` console script of this environment) with the environment the image, the
compose file or the StatefulSet gives it, container paths mapped to temporary folders and
hosts to loopback (a local redis-server for the compose file's Redis), then run the
Dockerfile's HEALTHCHECK and the Kubernetes probes' commands word for word. test_deploy.py
validates the files themselves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.deploy import (
    DEPLOY,
    SERVICE,
    compose,
    copied_files,
    dockerfile,
    healthcheck_command,
    image_command,
    image_env,
    instructions,
    resource,
    server_container,
)
from helpers.redis_servers import RedisServer, free_port

from ngramcache.cache_service.config import ENV_PREFIX
from ngramcache.cache_service.security import new_token, token_sha256

pytestmark = pytest.mark.integration


class Container:
    """A container's filesystem mapped into `root`: /var/lib/ngramcache, /tmp, /etc/ngramcache become folders under
    it; /opt/ngramcache is deploy/ (the files the Dockerfile copies there)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = {"/opt/ngramcache": str(DEPLOY)}
        for inside in ("/var/lib/ngramcache", "/tmp", "/etc/ngramcache"):
            local = root / inside.strip("/").replace("/", "-")
            local.mkdir(parents=True, exist_ok=True)
            self.paths[inside] = str(local)
        for image_path, source in copied_files().items():
            assert self.local(image_path) == str(source), image_path
        self.hosts: dict[str, str] = {}

    def local(self, value: str) -> str:
        for inside, local in self.paths.items():
            if value == inside or value.startswith(inside + "/"):
                return local + value[len(inside):]
        for inside, local in self.hosts.items():
            value = value.replace(inside, local)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        """A command of the image as run here: its programs are this environment's."""
        program = {"python": sys.executable, "ngramcache": str(Path(sys.executable).parent / "ngramcache")}
        return [program.get(argv[0], argv[0]), *(self.local(a) for a in argv[1:])]

    def environment(self, *layers: dict[str, str]) -> dict[str, str]:
        """This process's environment without NGC_* variables, then the image's ENV, then `layers`, localized."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        for layer in (image_env(), *layers):
            env.update({k: self.local(str(v)) for k, v in layer.items()})
        return env


def loopback(env: dict[str, str]) -> dict[str, str]:
    """The listening settings made local: 127.0.0.1 (servers here listen on loopback only) and free ports."""
    out = dict(env)
    for key in ("NGC_HOST", "NGC_METRICS_HOST"):
        if key in out:
            out[key] = "127.0.0.1"
    out["NGC_PORT"] = str(free_port())
    if "NGC_METRICS_PORT" in out:
        out["NGC_METRICS_PORT"] = str(free_port())
    return out


def start_service(container: Container, env: dict[str, str], argv: list[str] | None = None) -> subprocess.Popen[str]:
    entrypoint, cmd = image_command()
    workdir = container.local(instructions(dockerfile()[-1], "WORKDIR")[-1])
    return subprocess.Popen(container.argv(argv or [*entrypoint, *cmd]), env=env, cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_service(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    return proc.returncode, err


def run_until(argv: list[str], env: dict[str, str], want: int, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Runs a health check every 0.2 s until it exits with `want`; returns that run (or the last one)."""
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        if r.returncode == want or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_the_compose_service_runs_here_healthy_and_serves_the_demo_worker(tmp_path):
    services = compose()["services"]
    box = Container(tmp_path)
    with RedisServer() as redis_server:
        redis_url = services[SERVICE]["environment"]["NGC_COUNTS"]
        box.hosts[redis_url] = redis_server.url  # the compose network's `redis` is the local redis-server
        env = loopback(box.environment(services[SERVICE]["environment"]))
        address = f"127.0.0.1:{env['NGC_PORT']}"
        box.hosts[f"{SERVICE}:{services[SERVICE]['environment']['NGC_PORT']}"] = address
        proc = start_service(box, env)
        try:
            r = run_until(box.argv(healthcheck_command()), env, want=0)
            assert r.returncode == 0 and r.stdout.strip() == f"healthy: {address}: SERVING", (r.stdout, r.stderr)

            worker = services["worker"]
            argv = box.argv([*worker["entrypoint"], *worker["command"]])
            assert address in argv
            w = subprocess.run([*argv, "--seconds", "4", "--report-every", "1"], env=box.environment(worker.get("environment", {})),
                               capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert w.returncode == 0, w.stdout + w.stderr
            assert "created namespace demo" in w.stdout
            last = w.stdout.strip().splitlines()[-1]
            m = re.search(r"([\d,]+) accepted .*pushed ([\d,]+) rows acknowledged, 0 dropped", last)
            assert m and int(m.group(1).replace(",", "")) > 0 and int(m.group(2).replace(",", "")) > 0, w.stdout

            # The counts went through the service into Redis, and /metrics says so.
            assert redis_server.client().dbsize() > 0
            with urllib.request.urlopen(f"http://127.0.0.1:{env['NGC_METRICS_PORT']}/metrics", timeout=10) as page:
                metrics = page.read().decode()
            pushed = re.search(r"^ngramcache_pushed_rows_total (\S+)$", metrics, re.MULTILINE)
            assert pushed and float(pushed.group(1)) > 0
        finally:
            rc, err = stop_service(proc)
    assert rc == 0, err
    assert "Traceback" not in err
    assert list(Path(env["NGC_DATA_DIR"]).iterdir())  # it wrote to its volume (the static store's folder)


def test_the_health_check_tells_ready_from_alive(tmp_path):
    """Store down: the HEALTHCHECK fails (1, NOT_SERVING) while liveness passes; the service gone: 2."""
    box = Container(tmp_path)
    environment = dict(compose()["services"][SERVICE]["environment"])
    environment["NGC_COUNTS"] = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    env = loopback(box.environment(environment))
    proc = start_service(box, env)
    hc = box.argv(healthcheck_command())
    try:
        r = run_until([*hc, "--live"], env, want=0)
        assert r.returncode == 0 and r.stdout.strip().endswith("NOT_SERVING"), r.stdout + r.stderr
        r = subprocess.run(hc, env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and r.stdout.startswith("unhealthy: ") and r.stdout.strip().endswith("NOT_SERVING")
    finally:
        rc, err = stop_service(proc)
    # `docker stop` / a pod's deletion while the store is down: SIGTERM stops it, no SIGKILL after the grace period.
    assert rc == 0 and "SIGTERM before the counts store answered: stopped" in err, (rc, err[-2000:])
    r = subprocess.run([*hc, "--timeout", "1"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "UNAVAILABLE" in r.stdout, r.stdout


def self_signed(folder: Path, names: list[str]) -> tuple[Path, Path]:
    """A throwaway P-256 certificate naming `names` (DNS) and its key."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={names[0]}",
                    "-addext", "subjectAltName=" + ",".join(f"DNS:{n}" for n in names)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_the_statefulset_container_runs_here_with_tls_and_tokens_and_its_probes_pass(tmp_path):
    """The StatefulSet's environment (ConfigMap, Secret, downward API) with a real certificate and tokens file in the
    Secrets' places: the readiness and liveness probes' commands, word for word, get SERVING over TLS."""
    box = Container(tmp_path)
    container = server_container()
    config = resource("ConfigMap", "ngramcache")["data"]
    mounts = {m["name"]: box.local(m["mountPath"]) for m in container["volumeMounts"]}
    for name in ("tls", "tokens"):
        Path(mounts[name]).mkdir(parents=True, exist_ok=True)
    cert, key = self_signed(Path(mounts["tls"]), ["ngramcache", "ngramcache-peers"])
    assert (str(cert), str(key)) == (box.local(config["NGC_TLS_CERT"]), box.local(config["NGC_TLS_KEY"]))
    token = new_token()
    Path(box.local(config["NGC_TOKENS_FILE"])).write_text(
        f'[[token]]\nname = "ops"\nsha256 = "{token_sha256(token)}"\nnamespaces = ["*"]\nroles = ["admin"]\n')

    with RedisServer() as redis_server:
        fields = {"metadata.name": "ngramcache-0", "metadata.namespace": "default"}
        env_vars: dict[str, str] = {}
        for var in container["env"]:
            source = var.get("valueFrom", {})
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = resource("Secret", ref["name"])["stringData"][ref["key"]]
                value = redis_server.url if ref["name"] == "ngramcache-redis" else value
            elif "fieldRef" in source:
                value = fields[source["fieldRef"]["fieldPath"]]
            else:  # $(VAR) refers to variables defined before it, as the kubelet expands them
                value = re.sub(r"\$\((\w+)\)", lambda m: env_vars[m.group(1)], var["value"])
            env_vars[var["name"]] = value
        assert env_vars["NGC_ADVERTISE_ADDRESS"] == f"ngramcache-0.ngramcache-peers.default.svc:{config['NGC_PORT']}"
        env = loopback(box.environment(config, env_vars))
        proc = start_service(box, env, [*container["command"], *container["args"]])
        try:
            ready = run_until(box.argv(container["readinessProbe"]["exec"]["command"]), env, want=0)
            assert ready.returncode == 0 and ready.stdout.strip().endswith(": SERVING"), ready.stdout + ready.stderr
            live = subprocess.run(box.argv(container["livenessProbe"]["exec"]["command"]), env=env,
                                  capture_output=True, text=True, timeout=30)
            assert live.returncode == 0, live.stdout + live.stderr
            # The check really speaks TLS: in plaintext the server does not answer it.
            plain = subprocess.run([*box.argv(healthcheck_command()), "--tls-ca", "", "--timeout", "1"], env=env,
                                   capture_output=True, text=True, timeout=30)
            assert plain.returncode == 2, plain.stdout
        finally:
            rc, err = stop_service(proc)
    assert rc == 0, err
    assert "TLS on" in err and "Traceback" not in err
