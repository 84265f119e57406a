"""vLLM adapter: an ngramcache drafter as the proposer of vLLM's ``custom_class`` speculative method (0.22 to 0.33).

vLLM 0.34 removed ``custom_class``: there the drafter is the ``ngramcache`` speculative method,
registered by `register` (this package's ``vllm.general_plugins`` entry point) and run by
`ngramcache.client.adapters.vllm_speculator.NgramCacheSpeculator`; both read `ProposerConfig`.

Usage (vLLM 0.22 to 0.33, whose V1 model runner has the ``custom_class`` method; the interface is
pinned to 0.33.0 by ``tests/unit/test_adapter_vllm_contract.py``)::

    NGC_VLLM_STATIC=/data/gen-7.ngc vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "ngramcache.client.adapters.vllm.NgramCacheProposer",
          "num_speculative_tokens": 8}'

vLLM imports the class named by ``speculative_config.model`` in each worker and builds it as
``NgramCacheProposer(vllm_config)``; its model runner then calls, after every step,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)`` with the rows of
its persistent batch and no request ids (see `ProposerConfig` for how the drafter is chosen, and
`ngramcache.client.adapters.batch_rows.BatchRows` for how rows become drafter sequences).

Row i of the batch is ``token_ids_cpu[i, :num_tokens_no_spec[i]]``, the request's prompt and every
verified token (the tokens sampled this step included); ``sampled_token_ids[i]`` are the tokens
sampled this step (the accepted drafted ones and one more), empty for a row that sampled nothing
(a prefill not finished): such a row gets no draft. ``slot_mappings`` (KV cache slots) is not
used. The answer holds one list of token ids per row, empty where nothing is drafted, at most
``num_speculative_tokens`` long and never past ``max_model_len``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import MAX_DRAFT
from ngramcache.client.adapters.batch_rows import BatchRows
from ngramcache.client.adapters.draft_length import best_length
from ngramcache.client.adapters.sequence_feed import CAPPED_AUTO_DRAFT, UNCAPPED_MAX_COST, DrafterLike, DraftStats
from ngramcache.client.adapters.step_costs import AUTO, UNSCORED_ODDS, StepCosts
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["METHOD", "NgramCacheProposer", "ProposerConfig", "open_drafter", "register"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_MODES = ("compatible", "match")
# speculator_options keys (vLLM 0.34+): the fields of ProposerConfig but the token, which vLLM would log with its config.
_OPTIONS = ("static", "service", "namespace", "remote", "tokenizer", "tls_ca", "tls_cert", "tls_key", "cache_dir", "mode",
            "n_draft", "max_parked")
METHOD = "ngramcache"  # the speculative method `register` adds to vLLM 0.34+


@dataclasses.dataclass(frozen=True)
class ProposerConfig:
    """Which drafter an `NgramCacheProposer` drafts with, read from ``NGC_VLLM_*`` variables.

    vLLM builds the proposer from its own config only, in worker processes of its own, so the
    drafter is configured through the environment (inherited by the workers) or by a subclass
    that overrides `NgramCacheProposer.make_drafter`.

    Attributes:
        static: ``NGC_VLLM_STATIC``: a static generation file drafted from by a local `Drafter`.
        service: ``NGC_VLLM_SERVICE``: ``host:port`` of an ngramcache service (comma-separated for
            several): an `NgramClient` keeps a local drafter in sync with it.
        namespace: ``NGC_VLLM_NAMESPACE``: the service's namespace (needed with a service).
        remote: ``NGC_VLLM_REMOTE=1``: draft through the service (`RemoteDrafter`, one round
            trip per row and step) instead of a synced local drafter.
        tokenizer: ``NGC_VLLM_TOKENIZER``: a tokenizer spec (``tokenizer.json``, a folder holding
            one, or ``tiktoken:<encoding>``) for a service; default: the model's tokenizer folder.
        token: ``NGC_VLLM_TOKEN``: a bearer token for the service, or None.
        tls_ca: ``NGC_VLLM_TLS_CA``: PEM file of the CA certificates to trust: reach the service
            over TLS (None: plaintext).
        tls_cert, tls_key: ``NGC_VLLM_TLS_CERT``, ``NGC_VLLM_TLS_KEY``: PEM files of a client
            certificate and its key, for a service that requires mutual TLS (with ``tls_ca``).
        cache_dir: ``NGC_VLLM_CACHE_DIR``: the node's generation cache of an `NgramClient`
            (default: its own, ``$XDG_CACHE_HOME/ngramcache``).
        mode: ``NGC_VLLM_MODE``: "match" (default: the longest matches over the request, earlier
            requests and a static file's corpus index, each draft copied as far as the engine's
            width, since vLLM verifies on a GPU where a long draft costs about what a short one
            does) or "compatible" (llama.cpp's drafts, token for token, cut by its thresholds).
        n_draft: ``NGC_VLLM_N_DRAFT``: most tokens drafted per row and step (default and upper
            bound: vLLM's ``num_speculative_tokens``), or "auto": `NgramCacheProposer` (vLLM
            0.22-0.33, where a shorter draft is a cheaper step) cuts each row's draft to the
            length worth its verify cost, learned from the time between its calls (one engine step
            each); vLLM 0.34 verifies ``num_speculative_tokens`` slots a row whatever is drafted, so
            there "auto" fills them all.
        max_parked: ``NGC_VLLM_MAX_PARKED``: sequences kept while their request is out of the
            batch (default: vLLM's ``max_num_seqs``).

    With neither a static file nor a service, the drafter drafts from each request's own tokens
    only (its context table), as vLLM's ``ngram`` method does from the prompt.
    """

    static: str | None = None
    service: tuple[str, ...] = ()
    namespace: str | None = None
    remote: bool = False
    tokenizer: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    cache_dir: str | None = None
    mode: str = "match"
    n_draft: int | str | None = None
    max_parked: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise InvalidArgumentError(f"NGC_VLLM_MODE must be 'compatible' or 'match', got {self.mode!r}")
        if isinstance(self.n_draft, str) and self.n_draft != AUTO:
            raise InvalidArgumentError(f"NGC_VLLM_N_DRAFT must be 'auto' or a whole number, got {self.n_draft!r}")
        if isinstance(self.n_draft, int) and not 1 <= self.n_draft <= MAX_DRAFT:
            raise InvalidArgumentError(f"NGC_VLLM_N_DRAFT must be in 1..{MAX_DRAFT}, got {self.n_draft}")
        if self.max_parked is not None and self.max_parked < 0:
            raise InvalidArgumentError(f"NGC_VLLM_MAX_PARKED must be >= 0, got {self.max_parked}")
        if self.static and self.service:
            raise InvalidArgumentError("set NGC_VLLM_STATIC or NGC_VLLM_SERVICE, not both: a service brings its own "
                                       "static generation")
        if self.service and not self.namespace:
            raise InvalidArgumentError("NGC_VLLM_SERVICE needs NGC_VLLM_NAMESPACE (the namespace to draft from)")
        if self.remote and not self.service:
            raise InvalidArgumentError("NGC_VLLM_REMOTE=1 needs NGC_VLLM_SERVICE (the service that drafts)")
        tls = [name for name, value in (("NGC_VLLM_TLS_CA", self.tls_ca), ("NGC_VLLM_TLS_CERT", self.tls_cert),
                                        ("NGC_VLLM_TLS_KEY", self.tls_key)) if value]
        if tls and not self.service:
            raise InvalidArgumentError(f"{tls[0]} needs NGC_VLLM_SERVICE (TLS is how the service is reached)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgumentError("NGC_VLLM_TLS_CERT and NGC_VLLM_TLS_KEY go together (a client certificate and "
                                       "its key, for mutual TLS)")
        if self.tls_cert and not self.tls_ca:
            raise InvalidArgumentError("NGC_VLLM_TLS_CERT and NGC_VLLM_TLS_KEY (mutual TLS) need NGC_VLLM_TLS_CA (the "
                                       "CA certificates that signed the service's certificate)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProposerConfig:
        """Reads the ``NGC_VLLM_*`` variables of `env` (default: ``os.environ``), when called.

        Raises:
            InvalidArgumentError: a variable has a bad value, or they contradict each other.
        """
        env = os.environ if env is None else env

        def text(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def whole(name: str) -> int | None:
            value = text(name)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise InvalidArgumentError(f"{name} must be a whole number, got {value!r}") from None

        remote = text("NGC_VLLM_REMOTE")
        if remote not in (None, "0", "1"):
            raise InvalidArgumentError(f"NGC_VLLM_REMOTE must be 0 or 1, got {remote!r}")
        service = tuple(a.strip() for a in (text("NGC_VLLM_SERVICE") or "").split(",") if a.strip())
        n_draft: int | str | None = AUTO if text("NGC_VLLM_N_DRAFT") == AUTO else whole("NGC_VLLM_N_DRAFT")
        return cls(static=text("NGC_VLLM_STATIC"), service=service, namespace=text("NGC_VLLM_NAMESPACE"),
                   remote=remote == "1", tokenizer=text("NGC_VLLM_TOKENIZER"), token=text("NGC_VLLM_TOKEN"),
                   tls_ca=text("NGC_VLLM_TLS_CA"), tls_cert=text("NGC_VLLM_TLS_CERT"), tls_key=text("NGC_VLLM_TLS_KEY"),
                   cache_dir=text("NGC_VLLM_CACHE_DIR"),
                   mode=text("NGC_VLLM_MODE") or "match", n_draft=n_draft,
                   max_parked=whole("NGC_VLLM_MAX_PARKED"))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ProposerConfig:
        """The ``NGC_VLLM_*`` variables of `env` (`from_env`) overridden by vLLM 0.34's
        ``speculator_options`` (keys: the attribute names, e.g. ``{"static": "/data/gen-7.ngc"}``).

        Raises:
            InvalidArgumentError: an unknown option or one of the wrong type, the token given as an
                option (vLLM logs its config: use ``NGC_VLLM_TOKEN``), or settings that contradict.
        """
        base = cls.from_env(env)
        if not options:
            return base
        if not isinstance(options, Mapping):
            raise InvalidArgumentError(f"speculator_options must be a JSON object, got {options!r}")
        if "token" in options:
            raise InvalidArgumentError("speculator_options: give the bearer token in NGC_VLLM_TOKEN, not as an option "
                                       "(vLLM logs its config)")
        values: dict[str, Any] = {}
        for key, value in options.items():
            if key not in _OPTIONS:
                raise InvalidArgumentError(f"speculator_options: unknown option {key!r} (known: {', '.join(_OPTIONS)})")
            if key == "service":
                items = value.split(",") if isinstance(value, str) else value
                if not isinstance(items, (list, tuple)) or not all(isinstance(a, str) for a in items):
                    raise InvalidArgumentError(f"speculator_options: service must be 'host:port' (or a list of them), "
                                               f"got {value!r}")
                values[key] = tuple(a.strip() for a in items if a.strip())
            elif key == "remote":
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"speculator_options: remote must be true or false, got {value!r}")
                values[key] = value
            elif key in ("n_draft", "max_parked"):
                if not (isinstance(value, int) and not isinstance(value, bool)) and not (key == "n_draft" and value == AUTO):
                    hint = "'auto' or a whole number" if key == "n_draft" else "a whole number"
                    raise InvalidArgumentError(f"speculator_options: {key} must be {hint}, got {value!r}")
                values[key] = value
            else:
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"speculator_options: {key} must be a string, got {value!r}")
                values[key] = value.strip() or None
        try:
            return dataclasses.replace(base, **values)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"speculator_options (over NGC_VLLM_*): {e}") from None


def register() -> None:
    """Checks the ``NGC_VLLM_*`` variables and adds the ``ngramcache`` speculative method to vLLM 0.34+
    (``speculative_config={"method": "ngramcache", ...}``; vLLM 0.22-0.33 use ``custom_class``).

    vLLM calls it in each of its processes, as this package's ``vllm.general_plugins`` entry point,
    the first one before it starts its engine: a bad variable stops vLLM there, with this package's
    one-line message as the error's last line, not from a worker process whose error vLLM wraps in
    its own. Calling it again does nothing more.

    Raises:
        InvalidArgumentError: a bad ``NGC_VLLM_*`` value, or ``NGC_VLLM_STATIC`` naming no file.
    """
    config = ProposerConfig.from_env()
    if config.static and not os.path.isfile(config.static):
        raise InvalidArgumentError(f"NGC_VLLM_STATIC {config.static} is not a file")
    try:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method
    except ImportError:
        return
    try:
        register_speculative_method(METHOD, "ngramcache.client.adapters.vllm_method.NgramCacheSpeculatorConfig")
    except ValueError as e:  # another plugin took the name: vLLM must still start
        log.warning("ngramcache: vLLM speculative method %r not registered: %s", METHOD, e)


def _spec_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    n = getattr(spec, "num_speculative_tokens", None)
    if spec is None or n is None:
        raise InvalidArgumentError("NgramCacheProposer needs vllm_config.speculative_config.num_speculative_tokens "
                                   "(give num_speculative_tokens in --speculative-config)")
    if not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"num_speculative_tokens must be a whole number >= 1, got {n!r}")
    return n


def open_drafter(cfg: ProposerConfig, vllm_config: Any, own: Callable[[Any], Any]) -> DrafterLike:
    """The drafter `cfg` names: a `Drafter` over ``cfg.static``, a drafter kept in sync with
    ``cfg.service`` (or a `RemoteDrafter` with ``cfg.remote``), else a context-only `Drafter` of the
    model's vocabulary. Clients it opens are handed to `own` (whose caller closes them).

    Raises:
        InvalidArgumentError: a missing file, an unknown tokenizer or vocabulary size.
        TokenizerMismatchError: a static file of another tokenizer than ``cfg.tokenizer``.
    """
    from ngramcache.client._core import UNTAGGED, Drafter, StaticCache

    if cfg.static:
        if not os.path.isfile(cfg.static):
            raise InvalidArgumentError(f"NGC_VLLM_STATIC {cfg.static} is not a file")
        static = StaticCache.open(cfg.static)
        if cfg.tokenizer:  # then the file must be that tokenizer's (Drafter checks the fingerprint)
            return Drafter(static, fingerprint=bytes(_tokenizer(cfg, vllm_config).fingerprint), mode=cfg.mode)
        return Drafter(static, mode=cfg.mode)
    if cfg.service:
        tokenizer = _tokenizer(cfg, vllm_config)
        if cfg.remote:
            from ngramcache.client.sync.remote import RemoteDrafter

            remote = RemoteDrafter(cfg.service[0], str(cfg.namespace), tokenizer, token=cfg.token, mode=cfg.mode,
                                   tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
            own(remote)
            return remote
        from ngramcache.client.sync import NgramClient

        client = NgramClient(cfg.service, str(cfg.namespace), tokenizer, cache_dir=cfg.cache_dir, token=cfg.token,
                             mode=cfg.mode, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        own(client)
        return client.drafter()
    return Drafter(fingerprint=UNTAGGED, vocab_size=_vocab_size(vllm_config), mode=cfg.mode)


def _tokenizer(cfg: ProposerConfig, vllm_config: Any) -> Any:
    from ngramcache.client.kernel.tokenizer import load_tokenizer

    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    spec = getattr(getattr(vllm_config, "model_config", None), "tokenizer", None)
    hint = "set NGC_VLLM_TOKENIZER (a tokenizer.json, or the folder holding it)"
    if not spec:
        raise InvalidArgumentError(f"NGC_VLLM_SERVICE needs the model's tokenizer: {hint}")
    try:
        return load_tokenizer(str(spec))
    except InvalidArgumentError as e:  # a hub name rather than a folder, say
        raise InvalidArgumentError(f"the model's tokenizer {spec!r} is not a local tokenizer.json ({e}): {hint}") from None


def _vocab_size(vllm_config: Any) -> int:
    model_config = getattr(vllm_config, "model_config", None)
    getter = getattr(model_config, "get_vocab_size", None)
    vocab = getter() if callable(getter) else None
    if not isinstance(vocab, int) or vocab < 1:
        raise InvalidArgumentError("the model's vocabulary size is unknown (vllm_config.model_config."
                                   "get_vocab_size()): set NGC_VLLM_STATIC or NGC_VLLM_SERVICE")
    return vocab


class NgramCacheProposer:
    """A vLLM ``custom_class`` proposer drafting with an ngramcache drafter.

    Not thread-safe: vLLM's model runner calls `propose` from one thread. The drafter it makes
    (`make_drafter`) is its own; `close` releases it (and runs at interpreter exit when a client
    to a service was opened).

    Args:
        vllm_config: vLLM's ``VllmConfig``; read: ``speculative_config.num_speculative_tokens``,
            ``model_config.max_model_len``, ``scheduler_config.max_num_seqs`` and, for the
            drafter, ``model_config`` (tokenizer folder, vocabulary size).
        config: the drafter's settings (default: `ProposerConfig.from_env()`).

    Raises:
        InvalidArgumentError: a bad setting (vLLM reports it when it builds the proposer).
    """

    def __init__(self, vllm_config: Any, config: ProposerConfig | None = None) -> None:
        self.config = ProposerConfig.from_env() if config is None else config
        self.vllm_config = vllm_config
        spec_tokens = _spec_tokens(vllm_config)
        fixed = self.config.n_draft if isinstance(self.config.n_draft, int) else None
        # A longer draft than num_speculative_tokens would not fit vLLM's verification buffers.
        self.n_draft = min(spec_tokens, fixed or spec_tokens, MAX_DRAFT)
        # n_draft "auto": each step's drafts cut by verify costs learned from the time between two
        # calls (one engine step, which verified the drafts of the first).
        self.step_costs: StepCosts | None = StepCosts(self.n_draft) if self.config.n_draft == AUTO else None
        self.clock: Callable[[], float] = time.perf_counter
        self._last_call: float | None = None
        self._last_sent = 0  # tokens drafted per decoding row at the last call (rounded mean)
        model_config = getattr(vllm_config, "model_config", None)
        max_len = getattr(model_config, "max_model_len", None)
        self.max_model_len: int | None = int(max_len) if max_len is not None else None
        max_parked = self.config.max_parked
        if max_parked is None:
            max_parked = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 256) or 256)
        self._owned: list[Any] = []  # clients this proposer opened (closed by close())
        self.drafter: DrafterLike = self.make_drafter(vllm_config)
        self.rows = BatchRows(self.drafter, max_parked=max_parked)
        self.stats = DraftStats()

    def make_drafter(self, vllm_config: Any) -> DrafterLike:
        """The drafter to draft with, from `self.config` (`open_drafter`); override it in a subclass to bring your own.

        A subclass names itself in ``speculative_config.model`` (``"mypkg.MyProposer"``) and hands
        what it opens to `own` to have `close` close it.
        """
        return open_drafter(self.config, vllm_config, self.own)

    def own(self, obj: _T) -> _T:
        """Makes `close` (and interpreter exit) close `obj` (a client `make_drafter` opened); returns it."""
        if not self._owned:
            atexit.register(self.close)
        self._owned.append(obj)
        return obj

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: NDArray[np.integer[Any]],
                token_ids_cpu: NDArray[np.integer[Any]], slot_mappings: Any = None) -> list[list[int]]:
        """Drafts for every row of the batch (see the module docstring for the arguments).

        Returns:
            One list of draft token ids per row of `sampled_token_ids` (empty: no draft).
        """
        del slot_mappings  # KV cache slots say nothing about which request a row holds
        now = self.clock()
        n_rows = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(n_rows)]
        rows: list[int] = []
        tokens: list[NDArray[np.int32]] = []
        held: list[int] = []
        limits: list[int] = []
        for i in range(n_rows):
            sampled = sampled_token_ids[i]
            if not sampled:
                held.append(i)
                continue
            n = int(num_tokens_no_spec[i])
            row = np.asarray(token_ids_cpu[i, :n])
            if row.dtype != np.int32:
                row = row.astype(np.int32)
            rows.append(i)
            tokens.append(row)
            limits.append(self.n_draft if self.max_model_len is None else min(self.n_draft, self.max_model_len - n))
            self.stats.steps += 1
            self.stats.tokens += len(sampled)
            self.stats.accepted += len(sampled) - 1  # vLLM samples the accepted drafted tokens and one more
        seqs = self.rows.assign(rows, tokens, held)
        wanted = [k for k, limit in enumerate(limits) if limit > 0]
        if self.step_costs is not None:
            return self._propose_auto(out, rows, seqs, tokens, limits, wanted, now)
        if not wanted:
            return out
        drafts = self._draft([seqs[k].seq_id for k in wanted], [tokens[k] for k in wanted])
        for k, draft in zip(wanted, drafts, strict=True):
            chosen = draft[: limits[k]].tolist()
            self.stats.drafted += len(chosen)
            out[rows[k]] = chosen
        return out

    def _propose_auto(self, out: list[list[int]], rows: list[int], seqs: Sequence[Any], tokens: list[NDArray[np.int32]],
                      limits: list[int], wanted: list[int], now: float) -> list[list[int]]:
        """n_draft "auto": records the step since the last call, then sends each row the prefix of
        its draft with the most expected tokens per unit of verify cost (`best_length`)."""
        costs = self.step_costs
        assert costs is not None
        if self._last_call is not None:
            costs.record(self._last_sent, now - self._last_call)
        # A call with no row sampling (all prefilling) is not a decoding step: the next interval is not timed.
        self._last_call = now if rows else None
        sent = 0
        if wanted and not costs.needs_baseline():  # else: a step with no drafts, to time one
            scored = getattr(self.drafter, "draft_scored", None)
            from ngramcache.client._core import Drafter

            uncapped = self.config.mode == "match" and isinstance(self.drafter, Drafter)
            for k in wanted:
                n = limits[k]
                if not (costs.measured and costs(n) <= UNCAPPED_MAX_COST):
                    # Long drafts dear (a CPU) or their cost not known yet: as a fixed n_draft of
                    # CAPPED_AUTO_DRAFT does, the drafter's own draft, whole (sequence_feed says why).
                    m = min(n, CAPPED_AUTO_DRAFT)
                    chosen = np.asarray(self.drafter.draft(seqs[k].seq_id, tokens[k], m), dtype=np.int32)[:m].tolist()
                    sent += len(chosen)
                    self.stats.drafted += len(chosen)
                    out[rows[k]] = chosen
                    continue
                if callable(scored):
                    full, odds = scored(seqs[k].seq_id, tokens[k], n, uncapped=uncapped) if uncapped else \
                        scored(seqs[k].seq_id, tokens[k], n)
                else:
                    full = np.asarray(self.drafter.draft(seqs[k].seq_id, tokens[k], n), dtype=np.int32)
                    odds = np.full(len(full), UNSCORED_ODDS, dtype=np.float32)
                chosen = np.asarray(full[: min(n, len(full))])[: best_length(odds[:n], costs)].tolist()
                sent += len(chosen)
                self.stats.drafted += len(chosen)
                out[rows[k]] = chosen
        self._last_sent = round(sent / len(rows)) if rows else 0
        return out

    def _draft(self, seq_ids: list[int], tokens: list[NDArray[np.int32]]) -> list[NDArray[np.int32]]:
        batch = getattr(self.drafter, "draft_batch", None)
        if callable(batch):
            from ngramcache.client._core import Drafter

                        # One call for the whole batch, with the GIL released throughout (Drafter). In the match
            # mode each copy runs to the width (uncapped): vLLM verifies it in the step it runs anyway.
            if self.config.mode == "match" and isinstance(self.drafter, Drafter):
                drafts, lengths = self.drafter.draft_batch(seq_ids, tokens, self.n_draft, uncapped=True)
            else:
                drafts, lengths = batch(seq_ids, tokens, self.n_draft)
            return [drafts[k, : int(lengths[k])] for k in range(len(seq_ids))]
        return [np.asarray(self.drafter.draft(s, t, self.n_draft), dtype=np.int32) for s, t in zip(seq_ids, tokens, strict=True)]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM calls it when it loads the target model)."""

    def close(self) -> None:
        """Frees the sequences and closes the clients this proposer opened (idempotent)."""
        owned, self._owned = self._owned, []
        rows: BatchRows | None = getattr(self, "rows", None)  # None: the constructor failed after opening a client
        if rows is not None and (owned or rows.live or rows.parked):
            try:
                rows.forget()
            except Exception:  # a remote drafter whose service is gone: its sessions are gone too
                log.debug("ngramcache vLLM proposer: freeing sequences failed", exc_info=True)
        for obj in owned:
            obj.close()
