"""ServiceConfig: every setting of the gRPC service, from defaults, a TOML file, NGC_* variables and flags.

Precedence, lowest first: the defaults below, a config file (``--config FILE``, TOML with
the same keys), ``NGC_<KEY>`` environment variables (``NGC_PORT=50051``), command-line
flags. Nothing is read at import time: `ServiceConfig.load` is called by ``ngramcache
serve`` and tests build a `ServiceConfig` directly.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ngramcache.client.kernel.errors import InvalidArgumentError

from .counts import CountsStoreConfig, redact_url
from .draft_view import ViewPolicy
from .security import load_tokens, read_tls_files
from .toml_files import tomllib

ENV_PREFIX = "NGC_"

# NGC_* variables that are not settings of the service but are read elsewhere, so `serve` must not refuse them
# (tests/unit/test_config.py fails on a name spelled in the code, tests or deploy files and missing here):
# the admin commands' defaults, the vLLM adapter's configuration, the counts store library's
# (CountsStoreConfig.from_env: NGC_COUNTS_URL and NGC_COUNTS_<OPTION>, added below), the build's
# native-arch switch (pyproject.toml), and the test harness's (NGC_TEST_* as a prefix, plus the names listed).
OTHER_ENV = frozenset({
    "NGC_SERVER", "NGC_TOKEN",
    "NGC_VLLM_STATIC", "NGC_VLLM_SERVICE", "NGC_VLLM_NAMESPACE", "NGC_VLLM_REMOTE", "NGC_VLLM_TOKENIZER",
    "NGC_VLLM_TOKEN", "NGC_VLLM_CACHE_DIR", "NGC_VLLM_MODE", "NGC_VLLM_N_DRAFT", "NGC_VLLM_MAX_PARKED",
    "NGC_VLLM_TLS_CA", "NGC_VLLM_TLS_CERT", "NGC_VLLM_TLS_KEY",
    "NGC_COUNTS_URL",
    "NGC_NATIVE_ARCH",
    "NGC_ENGINE_CHILD_REPORTS", "NGC_ENGINE_CHILD_TIMEOUT", "NGC_FLEET_SECONDS", "NGC_FLEET_DEBUG",
    "NGC_OVERLOAD_SECONDS",
})
OTHER_ENV_PREFIXES = ("NGC_TEST_",)


# Upper bounds of the numeric settings: what gRPC's int32 channel arguments take, and intervals past
# which a setting no longer does its job (a mirror refreshed once a day is no mirror).
_INT_MAX = {"max_message_bytes": 2**31 - 1, "max_streams_per_connection": 2**31 - 1, "max_sessions": 10**7,
            "max_sessions_per_client": 10**7, "store_threads": 1024, "workers": 256, "view_top_k": 64,
            "keep_generations": 10**6,
            "history_tail_bytes": 1 << 40, "history_max_wait_ms": 60_000}
_SECONDS_MAX = {"session_idle_timeout": 7 * 86400.0, "mirror_interval": 60.0, "store_probe_interval": 60.0, "grace_period": 3600.0,
                "rebuild_lease_seconds": 3600.0, "peer_sync_interval": 3600.0, "rebuild_every": 30 * 86400.0, "history_poll_interval": 10.0}


@dataclasses.dataclass
class ServiceConfig:
    """Settings of one service process (see ``ngramcache serve --help`` for each)."""

    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: str = "./ngramcache-data"
    counts: str | None = None  # counts store URL; None: embedded, snapshotted in data_dir
    counts_min_replicas: int = 0  # counts and history pushes acknowledged once this many Redis replicas hold them
    allow_insecure_remote: bool = False  # plaintext on a non-loopback address
    # Security (docs/security.md)
    tls_cert: str | None = None  # PEM certificate chain; with tls_key: TLS
    tls_key: str | None = None  # PEM private key of tls_cert, unencrypted
    tls_client_ca: str | None = None  # PEM CA certificates: clients need a certificate they signed (mutual TLS)
    tokens_file: str | None = None  # TOML file of token hashes and grants; None: no authentication
    # Sessions and drafting
    max_sessions: int = 10_000
    max_sessions_per_client: int = 1_000  # per bearer token, or per client address without tokens
    max_streams_per_connection: int = 100  # concurrent calls on one HTTP/2 connection
    session_idle_timeout: float = 300.0  # seconds
    max_session_tokens: int = 1 << 20
    max_step_tokens: int = 65_536
    max_draft_tokens: int = 65_536
    session_memory: int = 1 << 30  # bytes of session context tables per namespace
    # Counts
    max_push_rows: int = 1 << 20
    max_chunk_rows: int = 65_536
    push_batch_window_ms: float = 0.0  # how long a group of pushes waits for more (0: until the store is free)
    push_group_rows: int = 0  # most rows summed into one store unit (0: the store's max_batch_rows)
    push_queue_rows: int = 1 << 18  # rows of pushes waiting per namespace; more are shed (OVERLOADED)
    store_probe_interval: float = 1.0  # seconds between two checks that the counts store answers (health)
    mirror_interval: float = 0.25  # seconds between two changes_since of a namespace's mirror (and draft view updates)
    # The fleet history's tail on this replica (cache_service/history_tail.py)
    history_poll_interval: float = 0.05  # seconds between two store reads of a pulled namespace's history tail
    history_tail_bytes: int = 8 << 20  # bytes of newest records a namespace's tail keeps in memory
    history_max_wait_ms: int = 5000  # longest PullHistory long poll
    # The draft view clients mirror (cache_service/draft_view.py)
    view_top_k: int = 8  # followers kept per key
    view_min_change_pct: int = 25  # a published count is updated when it moves by more than this %
    view_max_rows: int = 2_000_000  # rows in the view; over it, its key minimum doubles
    view_max_rows_per_second: int = 20_000  # rows logged per second (each client's pull); over it, the same
    # Rebuilds (cache_service/rebuild.py)
    corpus_root: str | None = None  # folders (":"-separated) a rebuild request may name corpus files under; "": none
    keep_generations: int = 3  # generations a replica keeps per namespace (rebuilds' default, and after a fetch)
    rebuild_every: float = 0.0  # seconds between scheduled rebuilds of every namespace (0: only on request)
    rebuild_lease_seconds: float = 30.0  # a rebuild's lease without renewal (renewed every third of it)
    advertise_address: str = ""  # host:port other replicas reach this one at (default: host:port it binds)
    peer_sync_interval: float = 1.0  # seconds between two checks for a generation another replica committed
    peer_token: str | None = None  # bearer token (draft role) for fetching from peers
    peer_tls_ca: str | None = None  # PEM CA certificates to reach peers with TLS (default: plaintext)
    # Transport
    max_message_bytes: int = 64 << 20
    max_file_bytes: int = 16 << 30
    grace_period: float = 10.0  # seconds given to in-flight calls on SIGTERM
    store_threads: int = 8
    metrics_host: str = "127.0.0.1"  # where /metrics (Prometheus) listens; it has no authentication
    metrics_port: int = -1  # -1: no metrics endpoint; 0: a free port
    log_calls: bool = False  # log every call at INFO (default: only failed ones)
    workers: int = 1  # server processes sharing the port (SO_REUSEPORT); > 1 needs a shared counts store
    reuse_port: bool = False  # share the port with other processes (set for the workers of --workers)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidArgumentError naming the first setting out of range (or its file, for the TLS and
        token files, which are read and checked here)."""
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in 0..65535 (0: any free port), got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgumentError(f"metrics_port must be in -1..65535 (-1: off, 0: any free port), got {self.metrics_port}")
        for name in ("max_sessions", "max_sessions_per_client", "max_streams_per_connection", "max_session_tokens", "max_step_tokens", "max_draft_tokens", "session_memory",
                     "max_push_rows", "push_queue_rows", "max_chunk_rows", "max_message_bytes", "max_file_bytes", "store_threads",
                     "workers", "view_top_k", "view_max_rows", "view_max_rows_per_second", "keep_generations",
                     "history_tail_bytes", "history_max_wait_ms"):
            value = getattr(self, name)
            top = _INT_MAX.get(name, 1 << 62)
            if not isinstance(value, int) or not 1 <= value <= top:
                raise InvalidArgumentError(f"{name} must be an integer in 1..{top}, got {value!r}")
        if not math.isfinite(self.rebuild_every) or not 0 <= self.rebuild_every <= _SECONDS_MAX["rebuild_every"]:
            raise InvalidArgumentError(f"rebuild_every must be a number of seconds in 0..{_SECONDS_MAX['rebuild_every']:g} "
                                       f"(0: off), got {self.rebuild_every!r}")
        for name in ("session_idle_timeout", "mirror_interval", "grace_period", "rebuild_lease_seconds",
                     "peer_sync_interval", "store_probe_interval", "history_poll_interval"):
            value = getattr(self, name)
            longest = _SECONDS_MAX[name]
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= longest:
                raise InvalidArgumentError(f"{name} must be a number of seconds in (0, {longest:g}], got {value!r}")
        if not 1 <= self.view_top_k <= 64:
            raise InvalidArgumentError(f"view_top_k must be in 1..64, got {self.view_top_k!r}")
        if not isinstance(self.view_min_change_pct, int) or self.view_min_change_pct < 0:
            raise InvalidArgumentError(f"view_min_change_pct must be an integer >= 0, got {self.view_min_change_pct!r}")
        if not math.isfinite(self.push_batch_window_ms) or self.push_batch_window_ms < 0:
            raise InvalidArgumentError(f"push_batch_window_ms must be a number >= 0, got {self.push_batch_window_ms!r}")
        if not isinstance(self.push_group_rows, int) or self.push_group_rows < 0:
            raise InvalidArgumentError(f"push_group_rows must be an integer >= 0 (0: the store's limit), got "
                                       f"{self.push_group_rows!r}")
        if not isinstance(self.counts_min_replicas, int) or not 0 <= self.counts_min_replicas <= 64:
            raise InvalidArgumentError(f"counts_min_replicas must be an integer in 0..64 (0: the master's answer "
                                       f"suffices), got {self.counts_min_replicas!r}")
        if not self.data_dir:
            raise InvalidArgumentError("data_dir must name a folder")
        if self.peer_tls_ca and not os.access(self.peer_tls_ca, os.R_OK):
            raise InvalidArgumentError(f"peer_tls_ca {self.peer_tls_ca}: no such readable file")
        self.check_workers()
        tls = read_tls_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.tokens_file:
            load_tokens(self.tokens_file)
        if tls is None and not self.is_loopback() and not self.allow_insecure_remote:
            raise InvalidArgumentError(
                f"host {self.host!r} is not a loopback address: serving the network needs TLS (tls_cert and "
                "tls_key), or allow_insecure_remote (--allow-insecure-remote) for plaintext")

    def view_policy(self) -> ViewPolicy:
        return ViewPolicy(top_k=self.view_top_k, min_change_pct=self.view_min_change_pct, max_rows=self.view_max_rows,
                          max_rows_per_second=self.view_max_rows_per_second, log_rows=2 * self.view_max_rows)

    def check_workers(self) -> None:
        """Several workers share counts only through a shared store: refuse the embedded one."""
        if self.workers > 1 and not (self.counts or "").startswith(("redis://", "rediss://", "redis+cluster://",
                                                                    "rediss+cluster://", "redis+sentinel://",
                                                                    "rediss+sentinel://")):
            raise InvalidArgumentError(
                f"--workers {self.workers} runs {self.workers} processes, each with its own embedded counts store; "
                "give them a shared one: --counts redis://HOST:PORT (or redis+cluster://...)")

    def is_loopback(self) -> bool:
        if self.host in ("localhost", ""):
            return self.host == "localhost"
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False

    @property
    def counts_url(self) -> str:
        """The counts store URL: the configured one (with ``min_replicas`` in its query when counts_min_replicas is
        set: it wins over the URL's), or the embedded store snapshotted in data_dir."""
        if self.counts:
            if not self.counts_min_replicas:
                return self.counts
            joiner = "&" if "?" in self.counts else "?"
            return f"{self.counts}{joiner}min_replicas={self.counts_min_replicas}"
        return "embedded://" + str((Path(self.data_dir) / "counts.snapshot").resolve())

    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def describe(self) -> dict[str, Any]:
        """The settings as a dict fit for a log line: no secret (the store URL is redacted)."""
        d = dataclasses.asdict(self)
        d["counts"] = redact_url(self.counts_url)
        return d

    @classmethod
    def load(cls, *, file: str | None = None, environ: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> ServiceConfig:
        """Defaults, then `file` (TOML), then NGC_* variables of `environ`, then `overrides` (flags)."""
        values: dict[str, Any] = {}
        if file:
            values.update(_read_file(file))
        values.update(_from_env(os.environ if environ is None else environ))
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**values)


_FIELDS = {f.name: f for f in dataclasses.fields(ServiceConfig)}


def _coerce(name: str, raw: Any, source: str) -> Any:
    default = _FIELDS[name].default
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return None if raw in (None, "") else str(raw)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{source}: {raw!r} is not a valid value for {name}") from None


def known_env() -> frozenset[str]:
    """Every NGC_* variable name something in ngramcache reads (the settings' and `OTHER_ENV`)."""
    counts = {"NGC_COUNTS_" + f.name.upper() for f in dataclasses.fields(CountsStoreConfig) if f.init and f.name != "url"}
    return frozenset({ENV_PREFIX + name.upper() for name in _FIELDS} | OTHER_ENV | counts)


def check_env_names(environ: Mapping[str, str]) -> None:
    """Refuses NGC_* variables nothing reads: a typo (NGC_PROT=5) would otherwise be ignored silently, as an
    unknown key of the TOML file is not.

    Raises:
        InvalidArgumentError: one line naming each unknown variable with the closest known name.
    """
    known = known_env()
    unknown = sorted(k for k in environ
                     if k.startswith(ENV_PREFIX) and k not in known and not k.startswith(OTHER_ENV_PREFIXES))
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        named.append(f"{key} (did you mean {close[0]}?)" if close else key)
    raise InvalidArgumentError(f"unknown environment variable{'s' if len(unknown) > 1 else ''} {', '.join(named)}: "
                               f"fix the name or unset it ({ENV_PREFIX}<SETTING> variables are listed by "
                               "ngramcache serve --help)")


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    check_env_names(environ)
    out: dict[str, Any] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            out[name] = _coerce(name, environ[key], key)
    return out


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"--config {path}: is a folder, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgumentError(f"--config {path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"--config {path}: not a text (TOML) file") from None
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise InvalidArgumentError(f"--config {path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    return {k: _coerce(k, v, f"--config {path}") for k, v in doc.items()}
