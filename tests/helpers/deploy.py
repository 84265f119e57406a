"""deploy/ as the deployment tests read it: the Kubernetes base's manifests (those its kustomization lists), the
compose file, and the Dockerfile's stages, instructions, command and environment."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = ["BASE", "COMPOSE", "DEPLOY", "REPO", "SERVICE", "compose", "copied_files", "dockerfile", "exec_form",
           "healthcheck_command", "image_command", "image_env", "instructions", "kustomization", "manifests", "resource",
           "server_container"]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "k8s" / "base"
COMPOSE = DEPLOY / "compose.yaml"
SERVICE = "ngramcache"  # the compose service and the StatefulSet's container


def kustomization() -> dict[str, Any]:
    """deploy/k8s/base/kustomization.yaml."""
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


def manifests(folder: Path = BASE) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, resource) for every document of every file the kustomization lists."""
    for name in yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]:
        for doc in yaml.safe_load_all((folder / name).read_text()):
            if doc:
                yield name, doc


def resource(kind: str, name: str) -> dict[str, Any]:
    """The one resource of `kind` named `name` in the base."""
    found = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def compose() -> dict[str, Any]:
    """deploy/compose.yaml."""
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
    """The arguments of each `name` instruction of `stage`."""
    return [rest for instruction, rest in stage if instruction == name]


def exec_form(rest: str) -> list[str]:
    """An instruction's arguments in the exec form (a JSON array of strings)."""
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
    """The service's container in the StatefulSet."""
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
