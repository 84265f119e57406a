"""The ``ngramcache`` speculative method of vLLM 0.34+: its ``SpeculatorConfig``, which vLLM imports in every one of its processes (no torch here).

`ngramcache.client.adapters.vllm.register` (the ``vllm.general_plugins`` entry point) registers
it by name; ``speculative_config={"method": "ngramcache", "num_speculative_tokens": 8,
"speculator_options": {...}}`` then selects it, and each GPU worker builds the speculator it names,
`ngramcache.client.adapters.vllm_speculator.NgramCacheSpeculator`. Pinned to vLLM 0.34.0
(``vllm/v1/worker/gpu/spec_decode/speculator_config.py``) by
``tests/unit/test_adapter_vllm_speculator_contract.py``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from ngramcache.client.adapters.vllm import ProposerConfig

__all__ = ["DEFAULT_SPEC_TOKENS", "NgramCacheSpeculatorConfig"]

# vLLM verifies every slot of every decoding request each step, drafted or not: 8 (vLLM's own
# default for its suffix method) keeps a full batch's step near a plain one; at low concurrency
# on a GPU 16 or more pays (docs/engines.md).
DEFAULT_SPEC_TOKENS = 8


class NgramCacheSpeculatorConfig(SpeculatorConfig):
    """The ``ngramcache`` method: no draft model, options in ``speculator_options``.

    ``speculator_options`` keys are `ProposerConfig`'s (``static``, ``service``, ``namespace``,
    ``remote``, ``tokenizer``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``cache_dir``, ``mode``,
    ``n_draft``, ``max_parked``) and override the ``NGC_VLLM_*`` variables; a bad one stops vLLM
    while it reads its config, with one line.
    """

    base_method = None  # not based on a built-in speculator
    speculator_class = "ngramcache.client.adapters.vllm_speculator.NgramCacheSpeculator"
    supported_options = frozenset({"speculator_options"})
    # Confidences (for enable_adaptive_verification) are the drafter's odds, not draft logits.
    adaptive_verification_uses_draft_logits = False

    @classmethod
    def configure(cls, spec: Any) -> None:
        super().configure(spec)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = DEFAULT_SPEC_TOKENS

    @classmethod
    def apply_options(cls, spec: Any) -> None:
        ProposerConfig.from_options(spec.speculator_options)  # raises on a bad option, in the API server already
