"""deploy/: the Kubernetes base and the compose file validate, the Dockerfile agrees with both, and the
container's command runs here as the image runs it (same entrypoint, same NGC_* environment, read from the files).

No container engine runs here, so the image is never built: the tests start its ENTRYPOINT and
CMD (the `ngramcache` console script of this environment) with the environment the image, the
compose file or the StatefulSet gives it, container paths mapped to temporary folders and
hosts to loopback (a local redis-server for the compose file's Redis), then run the
Dockerfile's HEALTHCHECK and the Kubernetes probes' commands word for word.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helpers.redis_servers import RedisServer, free_port

from ngramcache.cache_service.config import ENV_PREFIX, ServiceConfig
from ngramcache.cache_service.security import new_token, token_sha256
from ngramcache.client.kernel.errors import InvalidArgumentError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "k8s" / "base"
COMPOSE = DEPLOY / "compose.yaml"
# The oldest Kubernetes release the base is written for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
SERVICE = "ngramcache"  # the compose service and the StatefulSet's container
SETTINGS = {f.name for f in dataclasses.fields(ServiceConfig)}


# --- reading the files ------------------------------------------------------------------------

def kustomization() -> dict[str, Any]:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


def manifests(folder: Path = BASE) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, resource) for every document of every file the kustomization lists."""
    for name in yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]:
        for doc in yaml.safe_load_all((folder / name).read_text()):
            if doc:
                yield name, doc


def resource(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def dockerfile() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), " ".join(rest.split())))
    return stages[1:]  # stages[0] holds what precedes the first FROM (ARG)


def instructions(stage: list[tuple[str, str]], name: str) -> list[str]:
    return [rest for instruction, rest in stage if instruction == name]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not the exec form: {rest}"
    return value


def image_command() -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the runtime stage."""
    runtime = dockerfile()[-1]
    return exec_form(instructions(runtime, "ENTRYPOINT")[-1]), exec_form(instructions(runtime, "CMD")[-1])


def image_env() -> dict[str, str]:
    """The runtime stage's ENV (the `KEY=value KEY=value` form)."""
    env: dict[str, str] = {}
    for rest in instructions(dockerfile()[-1], "ENV"):
        for word in shlex.split(rest):
            key, sep, value = word.partition("=")
            assert sep, f"ENV {rest}: use the KEY=value form"
            env[key] = value
    return env


def healthcheck_command() -> list[str]:
    rest = instructions(dockerfile()[-1], "HEALTHCHECK")[-1]
    _, cmd = rest.split(" CMD ", 1)
    return exec_form(cmd)


def server_container() -> dict[str, Any]:
    (container,) = [c for c in resource("StatefulSet", "ngramcache")["spec"]["template"]["spec"]["containers"]
                    if c["name"] == SERVICE]
    return container


def copied_files() -> dict[str, Path]:
    """Paths in the image of the files the runtime stage COPYs from the repository -> their source."""
    out = {}
    for rest in instructions(dockerfile()[-1], "COPY"):
        if rest.startswith("--from"):
            continue
        *sources, target = rest.split()
        for source in sources:
            out[target.rstrip("/") + "/" + Path(source).name if target.endswith("/") else target] = REPO / source
    return out


# --- the Kubernetes base --------------------------------------------------------------------------

def test_kustomization_lists_every_manifest_and_nothing_else():
    k = kustomization()
    assert set(k) <= {"apiVersion", "kind", "labels", "resources", "images", "namespace"}, set(k)
    listed = k["resources"]
    assert len(listed) == len(set(listed))
    on_disk = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    assert {i["name"] for i in k["images"]} == {"ngramcache"}  # the image the StatefulSet and CronJob name


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(version):
    kinds = []
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:  # the CLI only warns: here it is a failure
            pytest.fail(f"{name}: {e.message}")
        kinds.append(doc["kind"])
    assert sorted(set(kinds)) == ["ConfigMap", "CronJob", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service",
                                  "StatefulSet"]


def validate_cli(*files: Path) -> subprocess.CompletedProcess[str]:
    """`kubernetes-validate --strict` as the command line runs it."""
    cli = Path(sys.executable).parent / "kubernetes-validate"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "kubernetes_validate"]
    return subprocess.run([*command, "--strict", "--quiet", "-k", K8S_VERSIONS[0], *map(str, files)],
                          capture_output=True, text=True, timeout=120)


def test_kubernetes_validate_strict_passes_the_base_and_refuses_broken_copies(tmp_path):
    files = [BASE / name for name in kustomization()["resources"]]
    r = validate_cli(*files)
    assert r.returncode == 0 and "ERROR" not in r.stdout, r.stdout + r.stderr

    statefulset = resource("StatefulSet", "ngramcache")
    typo = copy.deepcopy(statefulset)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")  # an unknown field: only strict mode catches it
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    no_selector = copy.deepcopy(statefulset)
    del no_selector["spec"]["selector"]
    for label, broken, field in (("typo", typo, "replica"), ("type", wrong_type, "fifty"),
                                 ("required", no_selector, "selector")):
        with pytest.raises(kubernetes_validate.ValidationError) as e:
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)
        assert field in e.value.message, e.value.message
        path = tmp_path / f"statefulset-{label}.yaml"
        path.write_text(yaml.safe_dump(broken))
        r = validate_cli(path)
        assert r.returncode != 0 and "did not validate" in r.stdout, (label, r.stdout + r.stderr)


def pod_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for _, doc in manifests():
        if doc["kind"] == "StatefulSet":
            yield doc["metadata"]["name"], doc["spec"]["template"]
        elif doc["kind"] == "CronJob":
            yield doc["metadata"]["name"], doc["spec"]["jobTemplate"]["spec"]["template"]


def matches(selector: dict[str, str]) -> list[str]:
    return [name for name, t in pod_templates() if selector.items() <= t["metadata"]["labels"].items()]


def test_references_between_manifests_resolve():
    docs = [doc for _, doc in manifests()]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {})) for d in docs
               if d["kind"] == "Secret"}
    claims = {d["metadata"]["name"]: {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
              for d in docs if d["kind"] == "StatefulSet"}
    for name, template in pod_templates():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert {"requests", "limits"} <= set(c["resources"]), (name, c["name"])
            for ref in c.get("envFrom", []):
                assert ("ConfigMap", ref["configMapRef"]["name"]) in names
            for var in c.get("env", []):
                if "secretKeyRef" in var.get("valueFrom", {}):
                    ref = var["valueFrom"]["secretKeyRef"]
                    assert ref["key"] in secrets[ref["name"]], (name, var["name"])
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes.keys() | claims.get(name, set()), (name, mount["name"])
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, (name, v["name"])
    for d in docs:
        kind, spec = d["kind"], d.get("spec", {})
        if kind == "Service":
            assert matches(spec["selector"]), d["metadata"]["name"]
        elif kind == "PodDisruptionBudget":
            assert matches(spec["selector"]["matchLabels"]) == ["ngramcache"]
        elif kind == "NetworkPolicy":
            assert matches(spec["podSelector"]["matchLabels"]) == ["ngramcache-redis"]
            for rule in spec["ingress"]:
                for peer in rule["from"]:
                    assert matches(peer["podSelector"]["matchLabels"]) == ["ngramcache"]
        elif kind == "StatefulSet":
            assert ("Service", spec["serviceName"]) in names
    peers = resource("Service", resource("StatefulSet", "ngramcache")["spec"]["serviceName"])
    assert peers["spec"]["clusterIP"] == "None"  # headless: a stable name per replica

    # Every NGC_* name is a setting of the service (a typo would be ignored silently), the scrape
    # annotations name the metrics port, the Services' targetPorts are the container's ports.
    config = resource("ConfigMap", "ngramcache")["data"]
    container = server_container()
    ngc = [*config, *(v["name"] for v in container["env"] if v["name"].startswith(ENV_PREFIX))]
    assert [n for n in ngc if n[len(ENV_PREFIX):].lower() not in SETTINGS] == []
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(config["NGC_PORT"]) and ports["metrics"] == int(config["NGC_METRICS_PORT"])
    annotations = resource("StatefulSet", "ngramcache")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == ports["metrics"]
    for svc in ("ngramcache", "ngramcache-peers"):
        assert {p["targetPort"] for p in resource("Service", svc)["spec"]["ports"]} <= set(ports)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == config["NGC_DATA_DIR"]
    assert config["NGC_TLS_CERT"].startswith(mounts["tls"] + "/") and config["NGC_TOKENS_FILE"].startswith(mounts["tokens"] + "/")


def test_the_cronjob_asks_the_service_for_a_rebuild():
    """It calls `ngramcache rebuild --server HOST:PORT --namespace NS --token ...` in the image (not run here)."""
    job = resource("CronJob", "ngramcache-rebuild")["spec"]
    assert job["concurrencyPolicy"] == "Forbid"
    (container,) = job["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    entrypoint, _ = image_command()
    assert container["command"] == entrypoint
    args = container["args"]
    assert args[0] == "rebuild" and args[args.index("--namespace") + 1]
    port = resource("ConfigMap", "ngramcache")["data"]["NGC_PORT"]
    assert args[args.index("--server") + 1] == f"ngramcache:{port}"  # the clients' Service
    token = args[args.index("--token") + 1]
    (var,) = [v for v in container["env"] if f"$({v['name']})" == token]
    assert var["valueFrom"]["secretKeyRef"]["name"] == "ngramcache-rebuild"


def test_the_placeholder_secrets_are_refused_at_start(tmp_path):
    """A base applied without its Secrets replaced fails closed, naming the file: no well-known key, no open door."""
    tls = resource("Secret", "ngramcache-tls")["stringData"]
    (tmp_path / "tls.crt").write_text(tls["tls.crt"])
    (tmp_path / "tls.key").write_text(tls["tls.key"])
    with pytest.raises(InvalidArgumentError, match="tls_cert"):
        ServiceConfig(host="0.0.0.0", data_dir=str(tmp_path), tls_cert=str(tmp_path / "tls.crt"),
                      tls_key=str(tmp_path / "tls.key"))
    (tmp_path / "tokens.toml").write_text(resource("Secret", "ngramcache-tokens")["stringData"]["tokens.toml"])
    with pytest.raises(InvalidArgumentError, match="no \\[\\[token\\]\\] entries"):
        ServiceConfig(data_dir=str(tmp_path), tokens_file=str(tmp_path / "tokens.toml"))


# --- the compose file ---------------------------------------------------------------------------

def docker_compose(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is missing: tests/run_all.sh installs it (apt-get install docker-compose)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY)


def test_docker_compose_config_validates_and_refuses_a_broken_copy(tmp_path):
    r = docker_compose("-f", str(COMPOSE), "config", "-q")
    assert r.returncode == 0, r.stderr

    # A copy elsewhere, its build context made absolute so only the planted error can fail it.
    doc = compose()
    doc["services"][SERVICE]["build"]["context"] = str(REPO)
    good = tmp_path / "compose.yaml"
    good.write_text(yaml.safe_dump(doc))
    r = docker_compose("-f", str(good), "config", "-q")
    assert r.returncode == 0, r.stderr
    doc["services"][SERVICE]["restart_policy"] = "always"  # not a service key (that is deploy.restart_policy)
    bad = tmp_path / "broken.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = docker_compose("-f", str(bad), "config", "-q")
    assert r.returncode != 0 and "restart_policy" in r.stderr, r.stderr


def test_compose_runs_the_image_as_built():
    services = compose()["services"]
    service, worker, redis = services[SERVICE], services["worker"], services["redis"]
    entrypoint, cmd = image_command()
    assert service.get("entrypoint", entrypoint) == entrypoint and service["command"] == cmd
    assert worker["image"] == service["image"]  # the worker runs the same image, another entrypoint
    assert worker["entrypoint"][1] in copied_files()
    assert [n for n in service["environment"] if n[len(ENV_PREFIX):].lower() not in SETTINGS] == []
    env = service["environment"]
    assert env["NGC_COUNTS"].startswith("redis://redis:")
    assert any(v.endswith(":" + env["NGC_DATA_DIR"]) for v in service["volumes"])
    assert service["read_only"] is True and worker["read_only"] is True and redis["read_only"] is True
    assert all(p.startswith("127.0.0.1:") for p in service["ports"])  # plaintext: the host's loopback only
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert redis["command"][redis["command"].index("--maxmemory-policy") + 1] == "noeviction"


# --- the Dockerfile -----------------------------------------------------------------------------

def test_dockerfile_builds_a_wheel_and_runs_it_unprivileged():
    stages = dockerfile()
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert instructions(build, "FROM")[0].endswith(" AS build")
    assert any("pip wheel" in r and "/wheels" in r for r in instructions(build, "RUN"))
    assert any("from=build" in r and "--no-index" in r and "/wheels/" in r for r in instructions(runtime, "RUN"))
    assert not any(r for r in instructions(runtime, "RUN") if "build-essential" in r)  # no compiler at run time
    (user,) = instructions(runtime, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000  # numeric, so runAsNonRoot can check it
    assert int(uid) == resource("StatefulSet", "ngramcache")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    # Every file the stages COPY exists, and the health check is one of them.
    for stage in stages:
        for rest in instructions(stage, "COPY"):
            if not rest.startswith("--from"):
                for source in rest.split()[:-1]:
                    assert (REPO / source).exists(), source
    hc = healthcheck_command()
    assert hc[0] == "python" and hc[1] in copied_files()
    # What the deployments run is the image's ENTRYPOINT and CMD.
    entrypoint, cmd = image_command()
    assert entrypoint == ["ngramcache"] and cmd == ["serve"]
    container = server_container()
    assert container["command"] == entrypoint and container["args"] == cmd
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][:2] == hc  # the HEALTHCHECK, with flags for TLS and liveness
    # The data volume and the ports agree.
    (volume,) = instructions(runtime, "VOLUME")
    data_dir = exec_form(volume)[0]
    assert image_env()["NGC_DATA_DIR"] == data_dir == compose()["services"][SERVICE]["environment"]["NGC_DATA_DIR"]
    assert resource("ConfigMap", "ngramcache")["data"]["NGC_DATA_DIR"] == data_dir
    exposed = {int(p) for rest in instructions(runtime, "EXPOSE") for p in rest.split()}
    assert {p["containerPort"] for p in container["ports"]} == exposed
    assert {int(p.rsplit(":", 1)[1]) for p in compose()["services"][SERVICE]["ports"]} == exposed


# --- the container's command, run here --------------------------------------------------------

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
