"""ServiceConfig's NGC_* variables: a name nothing reads is refused in one line with the closest known one, as an unknown key of the TOML file is; every name the project reads is accepted."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ngramcache.cache_service import config as service_config
from ngramcache.cache_service.config import ServiceConfig
from ngramcache.client.kernel.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]

# Names the tests below (and test_serve_cli.py) use on purpose as typos.
TYPOS = {"NGC_PROT", "NGC_TOKNE", "NGC_ZQXJW", "NGC_MAX_SESION", "NGC_SERVR"}  # misspelt on purpose by tests


def refusal(environ: dict[str, str]) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        ServiceConfig.load(environ=environ)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_typo_is_refused_naming_the_variable_and_the_closest_setting() -> None:
    message = refusal({"NGC_PROT": "5"})
    assert message.startswith("unknown environment variable NGC_PROT (did you mean NGC_PORT?): fix the name or unset it")


def test_every_unknown_variable_is_named_with_its_own_suggestion() -> None:
    message = refusal({"NGC_TOKNE": "t", "NGC_MAX_SESION": "3", "NGC_PORT": "5", "PATH": "/bin"})
    assert ("unknown environment variables NGC_MAX_SESION (did you mean NGC_MAX_SESSIONS?), "
            "NGC_TOKNE (did you mean NGC_TOKEN?):") in message
    assert "NGC_PORT" not in message.split(":")[0]


def test_a_name_close_to_nothing_is_named_without_a_guess() -> None:
    message = refusal({"NGC_ZQXJW": "1"})
    assert message.startswith("unknown environment variable NGC_ZQXJW: fix the name or unset it")
    assert "did you mean" not in message


def test_settings_client_variables_and_the_test_harness_are_accepted() -> None:
    config = ServiceConfig.load(environ={
        "NGC_PORT": "5", "NGC_SERVER": "127.0.0.1:1", "NGC_TOKEN": "t", "NGC_COUNTS_URL": "redis://x",
        "NGC_COUNTS_PREFIX": "p", "NGC_VLLM_STATIC": "/x.ngc", "NGC_TEST_ANYTHING": "1", "NGC_NATIVE_ARCH": "ON",
        "NGC_FLEET_SECONDS": "5", "NGCX": "not ours", "PATH": "/bin"})
    assert config.port == 5 and config.counts is None  # NGC_COUNTS_URL is the counts store library's, not serve's
    service_config.check_env_names(os.environ)  # the environment these tests run in


def _names_in(folders: list[str]) -> dict[str, str]:
    """Every NGC_<NAME> spelled out in the files under `folders` (the repository's), with a file it is in."""
    found: dict[str, str] = {}
    pattern = re.compile(r"\bNGC_[A-Z0-9_]*[A-Z0-9]\b")
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", "") or not path.is_file():
                continue
            if "__pycache__" in path.parts or ".venv" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for name in pattern.findall(text):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_project_reads_or_documents_is_accepted() -> None:
    """An NGC_ name anywhere in the code, tests, deploy files or pyproject.toml is read by something: serve must not
    refuse it (a variable added without adding it to config.OTHER_ENV fails here, not in a user's container)."""
    found = _names_in(["client", "cache_service", "tests", "deploy"])
    found.update({n: "pyproject.toml" for n in re.findall(r"\bNGC_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / "pyproject.toml").read_text())})
    assert {"NGC_TOKEN", "NGC_PORT", "NGC_VLLM_STATIC", "NGC_COUNTS_URL", "NGC_TEST_COMMAND_STARTED"} <= set(found)
    refused = []
    for name, where in sorted(found.items()):
        if name in TYPOS:
            continue
        try:
            service_config.check_env_names({name: "1"})
        except InvalidArgumentError as e:
            refused.append(f"{name} (in {where}): {e}")
    assert refused == []
    known = service_config.known_env()
    assert "NGC_SERVER" in known and "NGC_COUNTS_HISTORY_MAX_BYTES" in known and "NGC_PROT" not in known


def test_counts_min_replicas_rides_in_the_counts_url() -> None:
    assert ServiceConfig(counts="redis://h:1/0").counts_url == "redis://h:1/0"
    config = ServiceConfig(counts="redis+sentinel://h/m?prefix=x", counts_min_replicas=1)
    assert config.counts_url == "redis+sentinel://h/m?prefix=x&min_replicas=1"
    assert ServiceConfig(counts="redis://h", counts_min_replicas=2).counts_url == "redis://h?min_replicas=2"
    with pytest.raises(InvalidArgumentError, match="counts_min_replicas"):
        ServiceConfig(counts_min_replicas=-1)
