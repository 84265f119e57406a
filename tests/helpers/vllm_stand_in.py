"""A stand-in for the parts of vLLM 0.34.0 a custom speculator meets, for the contract test of `NgramCacheSpeculator` (vLLM needs CUDA wheels).

Written from vLLM 0.34.0's source (its released wheel, ``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl``),
keeping its module paths, names, signatures and checks, nothing else:

- ``vllm/v1/worker/gpu/spec_decode/speculator_config.py``: ``SpeculatorConfig`` (class attributes,
  ``default_model``, ``configure``, ``apply_options``), ``register_speculative_method`` (refuses a
  built-in name, or a name taken by another config), ``registered_speculative_methods``,
  ``get_custom_speculator_config_class`` (resolves a qualified name; the class must subclass
  ``SpeculatorConfig`` and set ``speculator_class``);
- ``vllm/config/speculative.py`` ``SpeculativeConfig.__post_init__`` for a custom method
  (`speculative_config`): the method moves to ``custom_method``, ``method`` becomes the config's
  ``base_method``, ``model`` its ``default_model``, then ``configure``, the check that
  method-specific options are in ``supported_options``, ``apply_options``;
- ``vllm/v1/worker/gpu/spec_decode/__init__.py`` ``init_speculator``: builds
  ``speculator_class(vllm_config, device)``, with ``req_states=`` when the constructor takes it,
  after checking it subclasses ``BaseSpeculator``;
- ``vllm/v1/worker/gpu/spec_decode/speculator.py`` ``BaseSpeculator``: abstract
  ``init_cudagraph_manager``, ``capture``, ``propose`` (its parameters, by name), hooks with no-op
  defaults;
- ``vllm/v1/worker/gpu/states.py`` ``RequestState`` (`RequestState`): ``all_token_ids.gpu`` int32
  [max_num_reqs, max_model_len], ``total_len.gpu`` int32, ``last_sampled_tokens`` int64
  [max_num_reqs, 1], ``draft_tokens`` int64 [max_num_reqs, num_speculative_steps], slots taken
  from the end of a free list and given back on removal;
- ``model_runner.py`` ``sample_tokens`` (`ModelRunner.step`): the sampled tokens are written into
  the rows (``post_update``), then ``propose`` is called with positional tensors and keyword
  ``num_speculative_tokens``/``dp_sync_state``/``mm_inputs``; columns past this step's
  ``num_speculative_tokens`` are set to -1 and the rows scattered into ``draft_tokens``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from abc import ABC, abstractmethod
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch

BUILTIN_METHODS = ("ngram", "draft_model", "suffix", "eagle", "eagle3", "mtp", "ngram_gpu", "dflash", "dspark",
                   "extract_hidden_states")
METHOD_SPECIFIC_OPTIONS = ("dspark_draft_topk", "draft_lm_head_quantization", "index_share_for_mtp_iteration",
                           "xpress_topc", "speculator_options")


def resolve_obj_by_qualname(qualname: str) -> Any:
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


class SpeculatorConfig:
    base_method: ClassVar[str | None] = None
    speculator_class: ClassVar[str | None] = None
    supported_options: ClassVar[frozenset[str]] = frozenset()
    uses_target_hidden_states: ClassVar[bool] = False
    prefer_dense_token_history: ClassVar[bool] = False
    proposes_draft_tokens: ClassVar[bool] = True
    adaptive_verification_uses_draft_logits: ClassVar[bool] = True

    @classmethod
    def default_model(cls, spec: Any) -> str | None:
        return cls.base_method

    @classmethod
    def configure(cls, spec: Any) -> None:
        spec.prompt_lookup_max = 0
        spec.prompt_lookup_min = 0
        spec.draft_model_config = spec.target_model_config
        spec.draft_parallel_config = spec.target_parallel_config

    @classmethod
    def apply_options(cls, spec: Any) -> None:
        return

    def __init__(self, spec_config: Any) -> None:
        self.spec_config = spec_config

    @property
    def num_speculative_tokens(self) -> int:
        return int(self.spec_config.num_speculative_tokens)


_CUSTOM_CONFIGS: dict[str, type[SpeculatorConfig] | str] = {}


def register_speculative_method(name: str, config_cls: type[SpeculatorConfig] | str) -> None:
    if name in BUILTIN_METHODS:
        raise ValueError(f"'{name}' is a built-in speculative method.")
    if name in _CUSTOM_CONFIGS and _CUSTOM_CONFIGS[name] != config_cls:
        raise ValueError(f"Speculative method '{name}' is already registered.")
    _CUSTOM_CONFIGS[name] = config_cls


def registered_speculative_methods() -> list[str]:
    return sorted(_CUSTOM_CONFIGS)


def get_custom_speculator_config_class(method: str | None) -> type[SpeculatorConfig] | None:
    if method not in _CUSTOM_CONFIGS:
        return None
    config_cls = _CUSTOM_CONFIGS[method]
    if isinstance(config_cls, str):
        config_cls = resolve_obj_by_qualname(config_cls)
    if not (isinstance(config_cls, type) and issubclass(config_cls, SpeculatorConfig)):
        raise TypeError(f"The config of speculative method '{method}' must be a subclass of SpeculatorConfig.")
    if config_cls.speculator_class is None:
        raise ValueError(f"The config of speculative method '{method}' must set speculator_class.")
    return config_cls


def speculative_config(target_model_config: Any, target_parallel_config: Any, *, method: str,
                       num_speculative_tokens: int | None = None, speculator_options: dict[str, Any] | None = None,
                       enable_adaptive_verification: bool = False) -> SimpleNamespace:
    """A ``SpeculativeConfig`` as ``__post_init__`` leaves it for a custom method."""
    if method not in BUILTIN_METHODS and method not in _CUSTOM_CONFIGS:
        raise ValueError(f"Unknown speculative method {method!r}. Built-in methods: {sorted(BUILTIN_METHODS)}; "
                         f"registered custom methods: {registered_speculative_methods()}.")
    spec = SimpleNamespace(method=method, custom_method=None, model=None, num_speculative_tokens=num_speculative_tokens,
                           speculator_options=speculator_options, enable_adaptive_verification=enable_adaptive_verification,
                           prompt_lookup_max=None, prompt_lookup_min=None, target_model_config=target_model_config,
                           target_parallel_config=target_parallel_config, draft_model_config=None,
                           draft_parallel_config=None, dspark_draft_topk=None, draft_lm_head_quantization=None,
                           index_share_for_mtp_iteration=None, xpress_topc=None)
    config_cls = get_custom_speculator_config_class(method)
    assert config_cls is not None, "the stand-in knows custom methods only"
    spec.custom_method = method
    spec.method = config_cls.base_method
    if spec.model is None and spec.num_speculative_tokens is not None:
        spec.model = config_cls.default_model(spec)
    config_cls.configure(spec)
    for option in METHOD_SPECIFIC_OPTIONS:
        if getattr(spec, option) is not None and option not in config_cls.supported_options:
            raise ValueError(f"{option} is not supported with speculative method {spec.custom_method or spec.method!r}.")
    config_cls.apply_options(spec)
    spec.speculator_config = config_cls(spec)
    return spec


class BaseSpeculator(ABC):
    num_query_per_req: int = 1
    supports_mm_inputs: bool = False
    draft_logits: Any = None

    @abstractmethod
    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        pass

    @abstractmethod
    def capture(self) -> None:
        pass

    @abstractmethod
    def propose(self, input_batch: Any, attn_metadata: dict[str, Any], slot_mappings: dict[str, torch.Tensor],
                last_hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                temperature: torch.Tensor, seeds: torch.Tensor, dp_sync_state: Any = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        pass

    def prepare_watermarking(self, sampler: Any, idx_mapping: torch.Tensor) -> None:
        return

    def add_request(self, req_index: int) -> None:
        return

    def on_requests_finished(self, finished_req_ids: set[str]) -> None:
        return

    def reset_state(self) -> None:
        return

    def update_max_model_len(self, max_model_len: int) -> None:
        return


def init_speculator(vllm_config: Any, device: torch.device, req_states: Any) -> BaseSpeculator:
    speculative_config = vllm_config.speculative_config
    qualname = speculative_config.speculator_config.speculator_class
    if qualname is None:
        raise NotImplementedError(f"{speculative_config.method} is not supported yet.")
    speculator_cls = resolve_obj_by_qualname(qualname)
    if not (isinstance(speculator_cls, type) and issubclass(speculator_cls, BaseSpeculator)):
        raise TypeError(f"speculator_class '{qualname}' must be a subclass of BaseSpeculator.")
    if "req_states" in inspect.signature(speculator_cls).parameters:
        return speculator_cls(vllm_config, device, req_states=req_states)  # type: ignore[no-any-return]
    return speculator_cls(vllm_config, device)  # type: ignore[no-any-return]


def install() -> dict[str, types.ModuleType]:
    """The stand-in's modules, by the names vLLM 0.34.0 gives them (put them in ``sys.modules``)."""
    _CUSTOM_CONFIGS.clear()
    names = ["vllm", "vllm.utils", "vllm.utils.import_utils", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
             "vllm.v1.worker.gpu.spec_decode", "vllm.v1.worker.gpu.spec_decode.speculator",
             "vllm.v1.worker.gpu.spec_decode.speculator_config"]
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)
        module.__path__ = []  # type: ignore[attr-defined]  # a package: submodules import
    modules["vllm"].__version__ = "0.34.0"  # type: ignore[attr-defined]
    modules["vllm.utils.import_utils"].resolve_obj_by_qualname = resolve_obj_by_qualname  # type: ignore[attr-defined]
    sc = modules["vllm.v1.worker.gpu.spec_decode.speculator_config"]
    for obj in (SpeculatorConfig, register_speculative_method, registered_speculative_methods,
                get_custom_speculator_config_class):
        setattr(sc, obj.__name__, obj)
    modules["vllm.v1.worker.gpu.spec_decode.speculator"].BaseSpeculator = BaseSpeculator  # type: ignore[attr-defined]
    modules["vllm.v1.worker.gpu.spec_decode"].init_speculator = init_speculator  # type: ignore[attr-defined]
    return modules


class _Rows:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.gpu = tensor


class RequestState:
    """vLLM 0.34.0's request states, as much of them as a speculator reads."""

    def __init__(self, max_num_reqs: int, max_model_len: int, num_speculative_steps: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.num_speculative_steps = num_speculative_steps
        self.device = device
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs))
        self.all_token_ids = _Rows(torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32, device=device))
        self.total_len = _Rows(torch.zeros(max_num_reqs, dtype=torch.int32, device=device))
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int32)
        self.last_sampled_tokens = torch.zeros((max_num_reqs, 1), dtype=torch.int64, device=device)
        self.draft_tokens = torch.zeros((max_num_reqs, num_speculative_steps), dtype=torch.int64, device=device)

    def add_request(self, req_id: str, prompt_len: int, all_token_ids: list[int]) -> int:
        idx = self.free_indices.pop()
        self.req_id_to_index[req_id] = idx
        self.prompt_len[idx] = prompt_len
        self.all_token_ids.gpu[idx, : len(all_token_ids)] = torch.tensor(all_token_ids, dtype=torch.int32)
        self.total_len.gpu[idx] = len(all_token_ids)
        self.draft_tokens[idx].zero_()
        return idx

    def remove_request(self, req_id: str) -> int | None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is not None:
            self.free_indices.append(idx)
        return idx

    def tokens(self, req_id: str) -> list[int]:
        idx = self.req_id_to_index[req_id]
        return [int(t) for t in self.all_token_ids.gpu[idx, : int(self.total_len.gpu[idx])]]


class ModelRunner:
    """The speculator's side of vLLM 0.34.0's GPU model runner: requests in and out, and `step`."""

    def __init__(self, vllm_config: Any, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.vllm_config = vllm_config
        self.num_speculative_steps = int(vllm_config.speculative_config.num_speculative_tokens)
        self.req_states = RequestState(vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.max_model_len,
                                       self.num_speculative_steps, self.device)
        self.speculator = init_speculator(vllm_config, self.device, self.req_states)

    def add_request(self, req_id: str, prompt: list[int], prefill: list[int] | None = None) -> int:
        """A new request (or one resumed after preemption, `prefill` its prompt and outputs so far)."""
        idx = self.req_states.add_request(req_id, len(prompt), prefill if prefill is not None else prompt)
        self.speculator.add_request(idx)
        return idx

    def finish_requests(self, finished: set[str], preempted: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        if finished:
            self.speculator.on_requests_finished(finished)
        for req_id in sorted(finished | preempted):
            self.req_states.remove_request(req_id)

    def step(self, sampled: dict[str, list[int]], batch: list[str], num_spec_tokens: int | None = None,
             dummy_run: bool = False) -> dict[str, list[int]]:
        """One step over `batch` (request ids in batch order; a request missing from `sampled`
        is a prefill chunk not finished): the drafts each request gets, -1 past this step's width."""
        k = self.num_speculative_steps if num_spec_tokens is None else num_spec_tokens
        states = self.req_states
        idx_np = np.array([states.req_id_to_index[r] for r in batch], dtype=np.intp)
        idx = torch.as_tensor(idx_np, dtype=torch.int64, device=self.device)
        num_sampled = torch.tensor([len(sampled.get(r, [])) for r in batch], dtype=torch.int32, device=self.device)
        for r in batch:  # post_update
            toks = sampled.get(r, [])
            if toks:
                i, n = states.req_id_to_index[r], int(states.total_len.gpu[states.req_id_to_index[r]])
                states.all_token_ids.gpu[i, n: n + len(toks)] = torch.tensor(toks, dtype=torch.int32)
                states.total_len.gpu[i] = n + len(toks)
                states.last_sampled_tokens[i, 0] = toks[-1]
        input_batch = SimpleNamespace(req_ids=list(batch), num_reqs=len(batch), idx_mapping=idx, idx_mapping_np=idx_np)
        zeros = torch.zeros(len(batch), dtype=torch.int32, device=self.device)
        if dummy_run:
            drafts = self.speculator.propose(input_batch=input_batch, attn_metadata={}, slot_mappings={},
                                             last_hidden_states=None, aux_hidden_states=None, num_sampled=num_sampled,
                                             num_rejected=zeros, last_sampled=states.last_sampled_tokens,
                                             next_prefill_tokens=None, temperature=None, seeds=None, dp_sync_state=None,
                                             dummy_run=True, skip_attn_for_dummy_run=False, mm_inputs=None, is_profile=False)
        else:
            drafts = self.speculator.propose(input_batch, {}, {}, None, None, num_sampled, zeros,
                                             states.last_sampled_tokens, None, None, None, num_speculative_tokens=k,
                                             dp_sync_state=None, mm_inputs=None)
        assert isinstance(drafts, torch.Tensor) and drafts.dtype == torch.int64
        assert tuple(drafts.shape) == (len(batch), self.num_speculative_steps)
        if k < self.num_speculative_steps:
            drafts[:, k:] = -1
        states.draft_tokens[idx] = drafts
        return {r: [int(t) for t in states.draft_tokens[states.req_id_to_index[r]]] for r in batch}


def vllm_modules() -> list[str]:
    """The names of the stand-in's modules and of the adapter modules bound to it (to drop after a test)."""
    return [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")] + [
        "ngramcache.client.adapters.vllm_method", "ngramcache.client.adapters.vllm_speculator"]
