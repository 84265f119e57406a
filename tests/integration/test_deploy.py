"""deploy/: the Kubernetes base and the compose file validate, and the Dockerfile agrees with both.

The container's command is run here, as the image runs it, in test_deploy_container.py; deploy/ is read
through helpers/deploy.py."""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helpers.deploy import (
    BASE,
    COMPOSE,
    DEPLOY,
    REPO,
    SERVICE,
    compose,
    copied_files,
    dockerfile,
    exec_form,
    healthcheck_command,
    image_command,
    image_env,
    instructions,
    kustomization,
    manifests,
    resource,
    server_container,
)

from ngramcache.cache_service.config import ENV_PREFIX, ServiceConfig
from ngramcache.client.kernel.errors import InvalidArgumentError

pytestmark = pytest.mark.integration


# The oldest Kubernetes release the base is written for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())


SETTINGS = {f.name for f in dataclasses.fields(ServiceConfig)}


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
