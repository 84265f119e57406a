"""Engine adapters: ngramcache drafts inside transformers' ``generate()``, llama-cpp-python's ``Llama`` and vLLM.

Each engine is an optional extra, imported only by its own module, so importing this package
loads no engine:

- `ngramcache.client.adapters.transformers` (``pip install 'ngramcache[transformers]'``):
  `generate`, `NgramCandidateGenerator`, `ngram_decoding`;
- `ngramcache.client.adapters.llama_cpp` (``pip install 'ngramcache[llama-cpp]'``):
  `NgramDraftModel`;
- `ngramcache.client.adapters.vllm` (vLLM 0.22 to 0.33, not a dependency: vLLM imports it):
  `NgramCacheProposer`, for ``speculative_config={"method": "custom_class", "model": ...}``,
  its rows mapped to drafter sequences by `ngramcache.client.adapters.batch_rows.BatchRows`;
- `ngramcache.client.adapters.vllm_speculator` (vLLM 0.34+, which imports it):
  `NgramCacheSpeculator`, for ``speculative_config={"method": "ngramcache", ...}``, the method
  `ngramcache.client.adapters.vllm.register` (a ``vllm.general_plugins`` entry point) registers
  with its config, `ngramcache.client.adapters.vllm_method.NgramCacheSpeculatorConfig`.

All take any drafter with ``draft``/``accept``/``reset`` (`ngramcache.Drafter`,
``NgramClient(...).drafter()``, `ngramcache.RemoteDrafter`) and count what they do in a
`DraftStats`. The drafter brings its mode: ``Drafter(..., mode="match")``,
``NgramClient(..., mode="match")`` or ``RemoteDrafter(..., mode="match")`` makes them draft
longest matches (both engines verify a line, so they use `draft`, not `draft_tree`).

How much to draft: by default (``n_draft="auto"``, transformers and llama-cpp-python) up to 64
tokens a step, cut by `draft_length.DraftLengthPolicy` to the drafted prefix worth its verify cost,
from the drafter's per-token odds (``Drafter.draft_scored``) and the engine's costs, learned from
its own steps (`step_costs.StepCosts`: long drafts on a GPU, short ones on a CPU). An integer
``n_draft`` drafts that many tokens every step, as llama.cpp does; with ``cost_aware=True`` they are
cut by costs measured up front (`draft_length.VerifyCost`).
"""

from ngramcache.client.adapters.sequence_feed import DrafterLike, DraftStats, SequenceFeed

__all__ = ["DraftStats", "DrafterLike", "SequenceFeed"]
