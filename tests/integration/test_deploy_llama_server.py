"""deploy/k8s/llama-server and deploy/Dockerfile.llama-server: the manifests validate and agree with each other and with
the image, and the pod's command runs here as the pod runs it (a TLS service with tokens, the probes' requests).

No container engine or cluster runs here: the container's command is started with its paths mapped to temporary
folders, the Service's host to loopback, and llama-server replaced by the stand-in of tests/helpers/llama_stand_in.py
(the real one is tests/integration/test_llama_follow.py's and bench_llama_follow's); the probes' HTTP requests are
sent as the kubelet sends them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helpers.auth import token, write_tokens_file
from helpers.service import ServiceThread, wait_until
from helpers.tls import Pki

from ngramcache import AdminClient, build_static_from_tokens, load_tokenizer
from ngramcache.client.tools import cli
from ngramcache.client.tools.llama_follow import check_server_command

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "deploy" / "k8s" / "llama-server"
DOCKERFILE = REPO / "deploy" / "Dockerfile.llama-server"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
STAND_IN = REPO / "tests" / "helpers" / "llama_stand_in.py"
CLI = [sys.executable, "-c", "import sys; from ngramcache.cache_service.entry import main; sys.exit(main())"]


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in yaml.safe_load((FOLDER / "kustomization.yaml").read_text())["resources"]:
        out += [(name, doc) for doc in yaml.safe_load_all((FOLDER / name).read_text()) if doc]
    return out


def resource(kind: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in manifests() if doc["kind"] == kind]
    return found


def container() -> dict[str, Any]:
    (c,) = resource("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def follow_args() -> list[str]:
    c = container()
    assert c["command"] == ["ngramcache"]
    return list(c["args"])


def test_the_kustomization_lists_every_manifest_and_each_validates_strictly():
    k = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in FOLDER.glob("*.yaml") if p.name != "kustomization.yaml")
    assert {i["name"] for i in k["images"]} == {container()["image"]}
    kinds = []
    for version in K8S_VERSIONS:
        for name, doc in manifests():
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']}: {'.'.join(map(str, e.path))}: {e.message}")
            kinds.append(doc["kind"])
    assert sorted(set(kinds)) == ["Deployment", "Secret", "Service"]


def test_the_manifests_agree_with_each_other_and_with_llama_follow():
    deployment, service, secret = resource("Deployment"), resource("Service"), resource("Secret")
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    spec = template["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"requests", "limits"} <= set(c["resources"])
    volumes = {v["name"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert set(mounts.values()) <= volumes
    (var,) = c["env"]
    assert var["name"] == "NGC_TOKEN" and var["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                                                "key": "token"}
    args = follow_args()
    assert "--token" not in args  # read from NGC_TOKEN: a token on the command line is visible to `ps`
    parsed = cli.build_parser().parse_args(args)  # the real parser takes the pod's arguments
    assert parsed.command == "llama-follow"
    server = parsed.server_command[1:] if parsed.server_command[:1] == ["--"] else parsed.server_command
    check_server_command(server)
    host, port = parsed.listen.rsplit(":", 1)
    assert host == "0.0.0.0" and int(port) == ports["http"]
    # The probes: readiness is the server's /health through the proxy, liveness the proxy's own status.
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/ngramcache/status", "port": "http"}
    # Every path the command names lies on a volume (the root filesystem is read-only).
    for path in (parsed.lcs, parsed.cache_dir, parsed.tls_ca, parsed.tokenizer, server[server.index("-m") + 1]):
        assert any(path.startswith(m + "/") for m in mounts), path
    # SIGTERM lets the requests finish: the grace period is longer than --drain-timeout.
    assert spec["terminationGracePeriodSeconds"] > parsed.drain_timeout


def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(" ", 1)[0].upper(), line.split(" ", 1)[1].strip()) for line in map(str.strip, text.splitlines())
            if line and not line.startswith("#")]


def test_the_image_runs_what_the_pod_runs_and_builds_from_what_its_context_holds():
    instructions = dockerfile()
    final = instructions[max(i for i, (name, _) in enumerate(instructions) if name == "FROM"):]
    (entrypoint,) = [json.loads(rest) for name, rest in final if name == "ENTRYPOINT"]
    assert entrypoint == container()["command"]
    assert ("HEALTHCHECK", "NONE") in final  # the ngramcache image's gRPC check does not apply here
    assert any(name == "COPY" and rest.endswith("/usr/local/bin/llama-server") for name, rest in final)
    # The files it copies from the context exist and are not ignored.
    ignore = [line for line in (DOCKERFILE.parent / "Dockerfile.llama-server.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"
    allowed = {line[1:] for line in ignore[1:] if line.startswith("!")}
    for name, rest in instructions:
        if name == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (REPO / source).is_file() and source in allowed, source


def http(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_pods_command_runs_here_and_its_probes_pass(tmp_path):
    """The container's args word for word, its paths mapped here, against a TLS service with tokens."""
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("server")
    tok = load_tokenizer("tiktoken:cl100k_base")
    with ServiceThread(tmp_path / "service", tls_cert=str(cert.cert), tls_key=str(cert.key),
                       tokens_file=str(write_tokens_file(tmp_path / "tokens.toml"))) as svc:
        parsed = cli.build_parser().parse_args(follow_args())
        with AdminClient(f"127.0.0.1:{svc.port}", token=token("admin_all"), tls_ca=str(pki.ca.cert), timeout=30) as admin:
            admin.create_namespace(parsed.namespace, tok)
            gen = tmp_path / "gen1.ngc"
            build_static_from_tokens([tok.encode("def f(x):\n    return x + 1\n" * 50)], gen, vocab_size=tok.vocab_size,
                                     fingerprint=tok.fingerprint, generation=1)
            admin.publish(parsed.namespace, gen)
        port = _free_port()
        work = tmp_path / "work"
        work.mkdir()
        mapping = {"ngramcache:50051": f"127.0.0.1:{svc.port}", "/etc/ngramcache/tls/tls.crt": str(pki.ca.cert),
                   "/models/tokenizer.json": "tiktoken:cl100k_base", "0.0.0.0:8080": f"127.0.0.1:{port}"}
        args = []
        for a in follow_args():
            a = mapping.get(a, a).replace("/var/lib/llama", str(work))
            args += [sys.executable, str(STAND_IN)] if a == "llama-server" else [a]
        proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "NGC_TOKEN": token("draft_all")})
        try:
            def ready() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(proc.communicate()[1])
                try:
                    return http(f"http://127.0.0.1:{port}/health") == 200  # the readinessProbe
                except OSError:
                    return False

            wait_until(ready, 60, "the readiness probe's 200")
            assert http(f"http://127.0.0.1:{port}/ngramcache/status") == 200  # the livenessProbe
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=b"{}",
                                                               headers={"Content-Type": "application/json"})) as r:
                assert r.headers["X-Ngramcache-Generation"] == "1"
                assert json.loads(r.read())["lcs_sha256"] is not None
            assert (work / "static.lcs").is_file() and (work / "generations" / parsed.namespace / "1.ngc").is_file()
            proc.send_signal(signal.SIGTERM)  # what the kubelet sends
            t0 = time.monotonic()
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert time.monotonic() - t0 < 30
            assert err.splitlines()[-1] == "ngramcache llama-follow: SIGTERM: llama-server stopped", err
        finally:
            if proc.poll() is None:
                proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
