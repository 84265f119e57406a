"""llama-cpp-python adapter: an ngramcache drafter as the `draft_model` of `llama_cpp.Llama`.

Usage::

    from llama_cpp import Llama
    from ngramcache.client.adapters.llama_cpp import NgramDraftModel

    draft_model = NgramDraftModel(drafter, seq_id=1, n_draft=8)
    llm = Llama(model_path="model.gguf", draft_model=draft_model)
    out = llm.create_completion(prompt, max_tokens=64, temperature=0.0)
    print(draft_model.stats)

``logits_all`` need not be given: llama-cpp-python turns it on whenever a ``draft_model`` is set
(verifying a draft samples at every drafted position). The drafter (`ngramcache.Drafter`,
`NgramClient(...).drafter()` or `RemoteDrafter`) must be bound to the GGUF's tokenizer, with a
vocabulary of at least ``llm.n_vocab()`` ids.

llama-cpp-python calls the draft model after every verification with the whole context (prompt
+ every accepted token + the token it just sampled) in a buffer it reuses, and evaluates the
returned tokens in one batch, keeping them up to the first one its sampler disagrees with. One
`NgramDraftModel` is one drafter sequence (``seq_id``), as one ``Llama`` runs one generation at a
time: a context that extends the previous one by at most the last draft plus one token is the
same generation (only the new tokens are accepted, and the accepted drafted tokens counted); a
longer extension is a new prompt that reuses the previous context (counted incrementally); any
other context (a new prompt, a rewind) resets the drafter's sequence and starts it again.

Caveat: speculation evaluates several tokens in one batch, and llama.cpp's batched matrix
kernels do not round exactly as its one-token ones do, so greedy decoding with a draft model
can pick a different token where two logits nearly tie: outputs can differ slightly from
decoding without one. The last verification of a generation is seen by nobody (no call follows
it), so its accepted tokens are neither counted in `stats` nor accepted by the drafter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError as e:  # the engine is an optional extra
    raise ImportError(
        "ngramcache.client.adapters.llama_cpp needs llama-cpp-python: pip install 'ngramcache[llama-cpp]'"
    ) from e

from ngramcache.client.adapters.sequence_feed import DrafterLike, DraftStats, SequenceFeed

__all__ = ["DraftStats", "NgramDraftModel"]


class NgramDraftModel(LlamaDraftModel):
    """Drafts for `llama_cpp.Llama(draft_model=...)` from an ngramcache drafter.

    Not thread-safe, as ``Llama`` itself: one generation at a time.

    Args:
        drafter: a drafter with `draft`, `accept` and `reset` (see `DrafterLike`).
        seq_id: the drafter's sequence id to use (each new generation resets it).
        n_draft: most tokens drafted per call (1..256).
        stats: counters to add to (`self.stats`; a new `DraftStats` when omitted).
    """

    def __init__(self, drafter: DrafterLike, seq_id: int = 0, n_draft: int = 8, *, stats: DraftStats | None = None) -> None:
        self.feed = SequenceFeed(drafter, seq_id, n_draft, stats)
        self._last_draft: NDArray[np.int32] = np.empty(0, dtype=np.int32)
        self.generations = 0  # generations started (calls that found a new or extended prompt)

    @property
    def stats(self) -> DraftStats:
        """Forward passes (steps, the prefill included), drafted and accepted tokens, new tokens."""
        return self.feed.stats

    def __call__(self, input_ids: NDArray[np.intc], /, **kwargs: Any) -> NDArray[np.intc]:
        """Drafts up to `n_draft` tokens to follow `input_ids`, the whole verified context.

        Returns:
            An int32 (intc) array, empty when the drafter has nothing.
        """
        tokens = np.asarray(input_ids, dtype=np.int32)
        seen = self.feed.seen
        stats = self.feed.stats
        if seen is not None and self.feed.extends_seen(tokens) and 1 <= len(tokens) - len(seen) <= len(self._last_draft) + 1:
            # One verification since the last call: the accepted drafted tokens, then the
            # token the model sampled itself (which differs from the draft's, if any is left).
            new = tokens[len(seen):]
            agree = new[: len(self._last_draft)] == self._last_draft[: len(new)]
            kept = int(np.argmin(agree)) if not agree.all() else len(agree)
            stats.accepted += min(kept, len(new) - 1)
            stats.tokens += len(new)
        else:
            # A new generation: its prefill was one forward pass, which sampled the last token.
            self.generations += 1
            stats.steps += 1
            stats.tokens += 1
        self._last_draft = self.feed.draft(tokens)
        return self._last_draft.astype(np.intc, copy=False)

    def reset(self) -> None:
        """Forgets the sequence (here and in the drafter); the next call starts a generation."""
        self.feed.reset()
        self._last_draft = np.empty(0, dtype=np.int32)
