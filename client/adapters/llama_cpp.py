"""llama-cpp-python adapter: an ngramcache drafter as the `draft_model` of `llama_cpp.Llama`.

Usage::

    from llama_cpp import Llama
    from ngramcache.client.adapters.llama_cpp import NgramDraftModel

    draft_model = NgramDraftModel(drafter, seq_id=1)
    llm = Llama(model_path="model.gguf", draft_model=draft_model)
    out = llm.create_completion(prompt, max_tokens=64, temperature=0.0)
    print(draft_model.stats, draft_model.verify_cost)

How much to draft. By default (``n_draft="auto"``) each call sends up to 64 drafted tokens, as
many as the ``Llama``'s verify costs make worth it (a match-mode ``Drafter`` drafting uncapped),
learned from the passes of its generation loop (the time between two calls is one pass that verified the previous draft; no extra pass,
nothing to measure first): where a batch of drafted tokens is nearly free to verify (a GPU
offload) drafts grow to 64, where it is not (llama.cpp's CPU kernels: one drafted token can cost
as much as the pass without it) they are cut, to none when the odds are low. ``verify_cost=``
gives the costs instead. An integer ``n_draft`` drafts that many tokens every call, as llama.cpp
does, or with ``cost_aware=True`` cuts them by costs measured up front::

    draft_model = NgramDraftModel(drafter, seq_id=1, n_draft=8, cost_aware=True)
    llm = Llama(model_path="model.gguf", draft_model=draft_model)
    draft_model.measure(llm)  # once, before the first generation: a second or two

``logits_all`` need not be given: llama-cpp-python turns it on whenever a ``draft_model`` is set
(verifying a draft samples at every drafted position). The drafter (`ngramcache.Drafter`,
`NgramClient(...).drafter()` or `RemoteDrafter`) must be bound to the GGUF's tokenizer, with a
vocabulary of at least ``llm.n_vocab()`` ids.

llama-cpp-python calls the draft model after every verification with the whole context (prompt
+ every accepted token + the token it just sampled) in a buffer it reuses, and evaluates the
returned tokens in one batch, keeping them up to the first one its sampler disagrees with. One
`NgramDraftModel` is one drafter sequence (``seq_id``), as one ``Llama`` runs one generation at a
time: a context that extends the previous one by a prefix of the last draft plus one token is the
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

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError as e:  # the engine is an optional extra
    raise ImportError(
        "ngramcache.client.adapters.llama_cpp needs llama-cpp-python: pip install 'ngramcache[llama-cpp]'"
    ) from e

from ngramcache.client.adapters.draft_length import DraftLengthPolicy, VerifyCost
from ngramcache.client.adapters.sequence_feed import DrafterLike, DraftStats, SequenceFeed
from ngramcache.client.adapters.step_costs import UNSCORED_ODDS, StepCosts, draft_length_setting
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["DraftStats", "NgramDraftModel", "measure_verify_cost"]


class _ProbeDraft(LlamaDraftModel):
    """A draft model that proposes k fixed tokens and notes when it is called: the time between
    two calls is one pass of the generation loop with k drafted tokens (almost always rejected)."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k = k
        self.vocab = vocab
        self.calls: list[float] = []

    def __call__(self, input_ids: NDArray[np.intc], /, **kwargs: Any) -> NDArray[np.intc]:
        self.calls.append(time.perf_counter())
        n = len(input_ids)
        return np.array([(n * 7919 + 31 * i) % self.vocab for i in range(self.k)], dtype=np.intc)


def measure_verify_cost(llm: Any, *, context: int = 64, ks: tuple[int, ...] = (0, 1, 2, 4, 8),
                        passes: int = 8, repeats: int = 3) -> VerifyCost:
    """Measures `llm`'s verify costs in its own generation loop: ``Llama.generate`` (greedy) with
    a probe draft model that proposes k tokens each pass, timing the passes between its calls;
    c(k) is the median pass with k drafted tokens over the median pass with none. Then restores
    the ``Llama``'s draft model and resets it (a second or two).

    A pass costs more than ``Llama.eval`` of 1 + k tokens: the loop also samples, in Python, and
    rolls the KV cache back after a rejected token, and with llama.cpp's CPU kernels one drafted
    token can cost as much as the pass without it (measured here: c(1) = 2.0 in the loop against
    1.4 for the evaluation alone). The costs are the measured points, interpolated.

    Args:
        context: prompt tokens (fixed ids, so runs are reproducible) before the timed passes.
        ks: draft lengths measured (0 and at least one more).
        passes: timed passes per k and round (plus one untimed, the prompt's).
        repeats: rounds over every k (a neighbour's load slows them alike).

    Raises:
        InvalidArgumentError: `ks` without 0 or another k, `passes` or `repeats` < 1.
    """
    if passes < 1:
        raise InvalidArgumentError(f"measuring verify costs needs passes >= 1, got {passes}")
    vocab = int(llm.n_vocab())
    prompt = [(i * 7919) % vocab for i in range(context)]
    saved = llm.draft_model

    def call_times(k: int) -> list[float]:
        probe = _ProbeDraft(k, vocab)
        llm.draft_model = probe
        tokens = llm.generate(prompt, temp=0.0, reset=True)
        for _ in zip(range(passes + 2), tokens):
            pass
        tokens.close()
        return probe.calls

    try:
        return VerifyCost.measure_loop(call_times, ks, repeats=repeats)
    finally:
        llm.draft_model = saved
        llm.reset()


class NgramDraftModel(LlamaDraftModel):
    """Drafts for `llama_cpp.Llama(draft_model=...)` from an ngramcache drafter.

    Not thread-safe, as ``Llama`` itself: one generation at a time.

    Args:
        drafter: a drafter with `draft`, `accept` and `reset` (see `DrafterLike`).
        seq_id: the drafter's sequence id to use (each new generation resets it).
        n_draft: "auto" (default): up to 64 tokens a call, as many as the verify costs make
            worth it (learned from the generation loop's passes into `verify_cost`, a
            `StepCosts`, or given by `verify_cost`). A whole number (1..256): that many tokens
            at most, every drafted token sent (unless `cost_aware`).
        stats: counters to add to (`self.stats`; a new `DraftStats` when omitted).
        cost_aware: with a whole `n_draft`: send each call only the drafted prefix with the most
            expected new tokens per unit of verify cost (0 tokens included). Needs the costs:
            `verify_cost`, or a call of `measure(llm)` before the first generation (the draft
            model never sees the ``Llama``). Off by default.
        verify_cost: the verify costs c(k) (a `VerifyCost`, a list whose item k is c(k), or a
            callable), never learned; implies `cost_aware`.

    Raises:
        InvalidArgumentError: `n_draft` neither "auto" nor in 1..256; `cost_aware` with a drafter
            that has no ``draft_scored``.
    """

    def __init__(self, drafter: DrafterLike, seq_id: int = 0, n_draft: int | str = "auto", *,
                 stats: DraftStats | None = None, cost_aware: bool = False,
                 verify_cost: VerifyCost | Sequence[float] | Callable[[int], float] | None = None) -> None:
        most, self.auto = draft_length_setting(n_draft)
        self.cost_aware = self.auto or cost_aware or verify_cost is not None
        self.feed = SequenceFeed(drafter, seq_id, most, stats)
        if self.cost_aware and not self.auto and not hasattr(drafter, "draft_scored"):
            raise InvalidArgumentError(
                f"cost-aware drafting needs a drafter with draft_scored() (ngramcache.Drafter), got {type(drafter).__name__}")
        if verify_cost is not None:
            self.set_verify_cost(verify_cost)
        elif self.auto:
            self.set_verify_cost(StepCosts(most))
        self._last_draft: NDArray[np.int32] = np.empty(0, dtype=np.int32)
        self.generations = 0  # generations started (calls that found a new or extended prompt)

    def set_verify_cost(self, cost: VerifyCost | Sequence[float] | Callable[[int], float]) -> None:
        """Drafts cost-aware from now on, with verify costs `cost` (a `StepCosts` learns from the passes)."""
        if not isinstance(cost, VerifyCost):
            cost = VerifyCost(cost, max(self.feed.n_draft, 8))
        self.cost_aware = True
        self.feed = SequenceFeed(self.feed.drafter, self.feed.seq_id, self.feed.n_draft, self.feed.stats,
                                 DraftLengthPolicy(cost), unscored_odds=UNSCORED_ODDS if self.auto else None,
                                 uncapped=self.auto)

    @property
    def verify_cost(self) -> VerifyCost | None:
        """The verify costs drafts are cut by (with "auto", learned so far), or None."""
        return self.feed.policy.cost if self.feed.policy is not None else None

    def measure(self, llm: Any, **kwargs: Any) -> VerifyCost:
        """Measures `llm`'s verify costs (`measure_verify_cost`, a second or two) and drafts
        cost-aware with them; call it once, before the first generation. Returns the costs."""
        cost = measure_verify_cost(llm, **kwargs)
        self.set_verify_cost(cost)
        return cost

    @property
    def stats(self) -> DraftStats:
        """Forward passes (steps, the prefill included), drafted and accepted tokens, new tokens."""
        return self.feed.stats

    def __call__(self, input_ids: NDArray[np.intc], /, **kwargs: Any) -> NDArray[np.intc]:
        """Drafts up to `n_draft` tokens to follow `input_ids`, the whole verified context.

        Returns:
            An int32 (intc) array, empty when the drafter has nothing.
        """
        if self.cost_aware and self.feed.policy is None:
            raise InvalidArgumentError(
                "NgramDraftModel(cost_aware=True) needs its verify costs: call draft_model.measure(llm) "
                "before generating, or pass verify_cost=")
        tokens = np.asarray(input_ids, dtype=np.int32)
        seen = self.feed.seen
        stats = self.feed.stats
        n_new = len(tokens) - len(seen) if seen is not None else 0
        if seen is not None and 1 <= n_new <= len(self._last_draft) + 1 and self.feed.extends_seen(tokens) and \
                np.array_equal(tokens[len(seen): len(tokens) - 1], self._last_draft[: n_new - 1]):
            # One verification since the last call: the accepted drafted tokens (a prefix of the
            # draft), then the token the model sampled itself. Anything else (a next prompt that
            # extends the context, however short) is a new generation.
            stats.accepted += n_new - 1
            stats.tokens += n_new
        else:
            # A new generation: its prefill was one forward pass, which sampled the last token.
            self.feed.new_generation()
            self.generations += 1
            stats.steps += 1
            stats.tokens += 1
        self._last_draft = self.feed.draft(tokens)
        return self._last_draft.astype(np.intc, copy=False)

    def reset(self) -> None:
        """Forgets the sequence (here and in the drafter); the next call starts a generation."""
        self.feed.reset()
        self._last_draft = np.empty(0, dtype=np.int32)
