"""transformers adapter: ngramcache drafts inside `model.generate()` (greedy or sampling, batch size 1), with plain generate()'s output.

Which hook, and why. transformers 5.24 (the release installed with torch 2.13.0) takes a *callable* as
``generate(custom_generate=...)``: generate() prepares the inputs, cache, logits processors and
stopping criteria, then hands the decoding loop to the callable, and passes it the keyword
arguments that its signature adds (here ``ngram_candidate_generator``). That is the supported
way to change decoding without a Hub repository or ``trust_remote_code``, so `ngram_decoding`
is such a callable. It does not carry a verification loop of its own: it runs transformers' own
assisted-decoding loop (``_assisted_decoding``, the one its prompt lookup decoding uses), with
`NgramCandidateGenerator`, a `CandidateGenerator` like transformers' prompt-lookup one, as the
candidate source. That loop has no public parameter for a candidate generator (it builds one
in ``_get_candidate_generator``), so for the duration of the call that method is shadowed on
the model instance; a lock per model keeps two such calls on one model from overlapping. The
verification (argmax of every drafted position, KV-cache cropping, EOS and length cut-offs,
logits processors) is transformers' own, which is why the output equals plain greedy decoding.

Sampling (``do_sample=True``, with temperature, top-k, top-p...) goes through the same loop:
transformers samples every drafted position from the model's own (processed) distribution and
keeps the drafted tokens while they equal the samples, plus the first sample that differs. A
drafted token d is thus kept with probability p(d), the model's: the output follows the model's
distribution exactly, as plain sampling does, but not token for token the same random draws
as an undrafted call with the same seed (the draws are made in another order).

Usage::

    from ngramcache.client.adapters.transformers import DraftStats, generate

    stats = DraftStats()
    out = generate(model, input_ids, drafter, seq_id=1, max_new_tokens=64, stats=stats)

How much to draft. By default (``n_draft="auto"``) each step sends up to 64 drafted tokens, as
many as the engine's verify costs make worth it: the adapter times the steps of the decoding
loop it runs anyway (no extra forward pass, nothing measured before the first request), learns
c(k), a step with k drafted tokens over one with none, per model (`step_costs.StepCosts`), and
sends the drafted prefix with the most expected new tokens per unit of cost. Where a 64-token
draft costs at most 1.5 steps, a match-mode `ngramcache.Drafter` drafts uncapped
(``draft_scored(..., uncapped=True)``: a copy runs on past its match length), so the policy, not
the drafter's thresholds, decides. Where verifying
more is nearly free (a GPU: c(64) ~ 1.1) drafts grow to 64 tokens; where it is not (a few CPU
cores: c(1) ~ 1.6) they are cut, to none when the odds are low. Until a length has been timed
it is taken to cost no more than the longest one timed, so the first steps of the first request
draft long and the costs settle within a few dozen steps. ``verify_cost=`` gives the costs
instead (never learned); an integer ``n_draft`` drafts that many tokens every step (llama.cpp's
way), or with ``cost_aware=True`` cuts them by costs measured up front (`measure_verify_cost`).

The drafter (`ngramcache.Drafter`, `NgramClient(...).drafter()` or `RemoteDrafter`) must be bound
to the model's tokenizer with a vocabulary of at least ``model.config.vocab_size`` ids. Each
step feeds it the whole sequence (prompt + generated), drafts up to ``n_draft`` tokens, and after
verification accepts the new sequence, as llama.cpp's lookup decoding does.

Not supported by this hook: beam search, several return sequences, batches of more than one
sequence (refused with ValueError), and ``streamer=`` (transformers does not pass it to
custom_generate callables).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import CandidateGenerator
    from transformers.generation.configuration_utils import GenerationMode
except ImportError as e:  # the engine is an optional extra
    raise ImportError(
        "ngramcache.client.adapters.transformers needs transformers and torch: "
        "pip install 'ngramcache[transformers]'"
    ) from e

from ngramcache.client.adapters.draft_length import DraftLengthPolicy, VerifyCost
from ngramcache.client.adapters.sequence_feed import DrafterLike, DraftStats, SequenceFeed
from ngramcache.client.adapters.step_costs import UNSCORED_ODDS, StepCosts, draft_length_setting
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["DraftStats", "NgramCandidateGenerator", "generate", "learned_verify_cost", "measure_verify_cost",
           "ngram_decoding"]


class NgramCandidateGenerator(CandidateGenerator):
    """Candidates for transformers' assisted decoding from an ngramcache drafter.

    One generator is one drafter sequence: its first `get_candidates` starts the sequence
    (the drafter's `seq_id` is reset and the prompt counted); a generator reused for a later
    `generate()` call whose input extends what it saw counts only the new tokens, otherwise it
    starts again. Not thread-safe: one generate() at a time per generator.

    Args:
        drafter: a drafter with `draft`, `accept` and `reset` (see `DrafterLike`).
        seq_id: the drafter's sequence id to use.
        n_draft: "auto" (default): up to 64 tokens a step, as many as the verify costs make worth
            it (`verify_cost`, or a `StepCosts` of its own learned from the steps it sees); or
            the most tokens drafted per step (1..256).
        stats: counters to add to (`self.stats`; a new `DraftStats` when omitted).
        verify_cost: cost-aware drafting with these verify costs (`VerifyCost`, e.g. from
            `measure_verify_cost`, or a `StepCosts` to learn into): each step sends the drafted
            prefix with the most expected tokens per unit of cost, 0 tokens included. None:
            every drafted token is sent (with an integer `n_draft`).

    Raises:
        InvalidArgumentError: `n_draft` neither "auto" nor in 1..256; `verify_cost` with a drafter
            that has no ``draft_scored``.
    """

    def __init__(self, drafter: DrafterLike, seq_id: int, n_draft: int | str = "auto", *,
                 stats: DraftStats | None = None, verify_cost: VerifyCost | None = None) -> None:
        most, auto = draft_length_setting(n_draft)
        if auto and verify_cost is None:
            verify_cost = StepCosts(most)
        policy = DraftLengthPolicy(verify_cost) if verify_cost is not None else None
        self.feed = SequenceFeed(drafter, seq_id, most, stats, policy, unscored_odds=UNSCORED_ODDS if auto else None,
                                 uncapped=auto)
        # The generation's max_length (set by ngram_decoding): no draft reaches past it.
        self.max_length: int | None = None
        # The tensor update_candidate_strategy accepted last: the loop hands it back to
        # get_candidates, which then drafts from the host copy instead of copying it again.
        self._accepted_ids: torch.Tensor | None = None

    @property
    def num_drafting_tokens(self) -> int:
        """Most tokens drafted a step (transformers 5.25+ asks, to size what its cache keeps for a rewind)."""
        return self.feed.n_draft

    @property
    def stats(self) -> DraftStats:
        """Forward passes (steps), drafted and accepted tokens, new tokens so far."""
        return self.feed.stats

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, None]:
        """The verified sequence followed by up to `n_draft` drafted tokens (no logits: the drafts are
        deterministic, so transformers verifies them against its argmax or its samples).

        Args:
            input_ids: shape (1, length), the whole sequence so far.

        Returns:
            (candidate ids of shape (1, length + drafted), None).

        Raises:
            ValueError: a batch of more than one sequence.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"ngramcache drafts for one sequence at a time, got a batch of {input_ids.shape[0]}")
        length = int(input_ids.shape[1])
        # The model adds one token of its own after the drafted ones: drafting up to
        # max_length - 1 keeps every verified position inside the length limit.
        limit = None if self.max_length is None else self.max_length - length - 1
        seen = self.feed.seen
        same = input_ids is self._accepted_ids and seen is not None and len(seen) == length
        drafted = self.feed.draft(seen if same else _to_numpy(input_ids), limit)  # type: ignore[arg-type]
        if len(drafted) == 0:
            return input_ids, None
        extra = torch.from_numpy(drafted).to(device=input_ids.device, dtype=input_ids.dtype).unsqueeze(0)
        return torch.cat((input_ids, extra), dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Records the outcome of a verification: `num_matches` drafted tokens were kept and
        `input_ids` is the new verified sequence, which the drafter accepts now."""
        matches = int(num_matches)
        self.stats.accepted += matches
        self.stats.tokens += matches + 1
        seen = self.feed.seen
        length = int(input_ids.shape[1])
        if seen is not None and len(seen) < length and input_ids is not self._accepted_ids:
            # The loop appends the kept tokens to the sequence it verified: only they cross from
            # the device (one small copy a step instead of the whole sequence).
            tokens = np.concatenate((seen, _to_numpy(input_ids[:, len(seen):])))
        else:
            tokens = _to_numpy(input_ids)
        self.feed.accept(tokens)
        self._accepted_ids = input_ids


def _to_numpy(input_ids: torch.Tensor) -> NDArray[np.int32]:
    """Row 0 of a (1, length) tensor of token ids as int32."""
    tokens: NDArray[np.int32] = np.asarray(input_ids[0].detach().to("cpu").numpy(), dtype=np.int32)
    return tokens


_costs: weakref.WeakKeyDictionary[Any, VerifyCost] = weakref.WeakKeyDictionary()
_learned: weakref.WeakKeyDictionary[Any, StepCosts] = weakref.WeakKeyDictionary()


def learned_verify_cost(model: Any) -> StepCosts:
    """The verify costs ``n_draft="auto"`` learns on `model` from its generations' steps (kept
    while the model lives; flat until steps are timed). Print it to see c(k)."""
    with _model_lock(model):
        cost = _learned.get(model)
        if cost is None:
            cost = _learned[model] = StepCosts()
        return cost


class _ProbeCandidates(NgramCandidateGenerator):
    """Candidates of k fixed tokens, noting when they are asked for: the time between two calls is
    one step of the assisted-decoding loop with k drafted tokens (almost always rejected)."""

    def __init__(self, k: int, vocab: int) -> None:  # no drafter: get_candidates is its own
        self.k = k
        self.vocab = vocab
        self.max_length: int | None = None
        self.calls: list[float] = []

    @property
    def num_drafting_tokens(self) -> int:
        return max(self.k, 1)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, None]:
        self.calls.append(time.perf_counter())
        length = int(input_ids.shape[1])
        room = self.k if self.max_length is None else min(self.k, self.max_length - length - 1)
        if room <= 0:
            return input_ids, None
        extra = (torch.arange(room, device=input_ids.device) * 31 + length * 7919) % self.vocab
        return torch.cat((input_ids, extra.to(input_ids.dtype).unsqueeze(0)), dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        pass


def measure_verify_cost(model: Any, *, context: int = 32, ks: tuple[int, ...] = (0, 1, 2, 4, 8),
                        passes: int = 6, repeats: int = 2) -> VerifyCost:
    """Measures the model's verify costs in transformers' own assisted-decoding loop (the one
    `generate` runs): greedy ``generate`` with candidates of k fixed tokens each step, timing the
    steps between candidate calls; c(k) is the median step with k drafted tokens over the median
    step with none.

    A step with a draft costs more than the forward pass over 1 + k tokens: the loop also turns
    the logits of every drafted position into tokens, compares them and crops the KV cache
    (measured on SmolLM2-135M, float32 on 2 CPU cores: c(1) 1.6-1.7 and c(2..8) 1.9-2.0 in the
    loop, against 1.05 and 1.1-1.4 for the forward passes alone). About 90 steps: about 10 s for
    a small model on CPU.

    Args:
        context: prompt tokens (fixed ids, so runs are reproducible) before the timed steps.
        ks: draft lengths measured (0 and at least one more).
        passes: timed steps per k and round.
        repeats: rounds over every k (a neighbour's load slows them alike), after a warm-up round.

    Raises:
        InvalidArgumentError: `ks` without 0 or another k, `passes` or `repeats` < 1.
    """
    if passes < 1:
        raise InvalidArgumentError(f"measuring verify costs needs passes >= 1, got {passes}")

    def call_times(k: int) -> list[float]:
        vocab = int(model.config.vocab_size)
        ids = (torch.arange(context, device=next(model.parameters()).device) * 7919 % vocab).unsqueeze(0)
        probe = _ProbeCandidates(k, vocab)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=ngram_decoding,
                           ngram_candidate_generator=probe, max_new_tokens=passes + 2, min_new_tokens=passes + 2,
                           do_sample=False, pad_token_id=0)
        return probe.calls

    return VerifyCost.measure_loop(call_times, ks, repeats=repeats)


def _verify_cost_of(model: Any) -> VerifyCost:
    """The model's verify costs, measured at its first cost-aware generation and kept."""
    with _model_lock(model):
        cost = _costs.get(model)
        if cost is None:
            cost = _costs[model] = measure_verify_cost(model)
        return cost


_locks_guard = threading.Lock()
# Re-entrant: measuring the costs (under the lock) runs the decoding loop, which takes it again.
_model_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()


def _model_lock(model: Any) -> threading.RLock:
    with _locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


def _check_supported(model: Any, input_ids: torch.Tensor, generation_config: GenerationConfig) -> None:
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE) or \
            generation_config.num_return_sequences not in (None, 1):
        raise ValueError(
            "ngramcache drafting supports greedy decoding and sampling only (num_beams=1, "
            f"num_return_sequences=1, no assistant or prompt lookup); got generation mode {mode.value!r}"
        )
    if input_ids.shape[0] != 1:
        raise ValueError(f"ngramcache drafting supports batch size 1 only, got {input_ids.shape[0]} sequences")
    if getattr(model, "_is_stateful", False):
        raise ValueError(f"{type(model).__name__} is stateful: drafted tokens cannot be rolled back")


def ngram_decoding(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: GenerationConfig,
    ngram_candidate_generator: NgramCandidateGenerator,
    **model_kwargs: Any,
) -> Any:
    """The decoding loop to pass as ``model.generate(custom_generate=ngram_decoding,
    ngram_candidate_generator=NgramCandidateGenerator(...), ...)``.

    transformers calls it after preparing the inputs; it runs transformers' assisted decoding
    with `ngram_candidate_generator` as the candidate source.

    Returns:
        What ``generate()`` returns: the sequences, or a ``GenerateDecoderOnlyOutput`` with
        ``return_dict_in_generate=True``.

    Raises:
        ValueError: beam search or several return sequences, a batch of more than one sequence, or a
            stateful model.
        TypeError: `ngram_candidate_generator` is not an `NgramCandidateGenerator`.
    """
    if not isinstance(ngram_candidate_generator, NgramCandidateGenerator):
        raise TypeError(f"ngram_candidate_generator must be an NgramCandidateGenerator, got {type(ngram_candidate_generator).__name__}")
    _check_supported(model, input_ids, generation_config)
    ngram_candidate_generator.max_length = generation_config.max_length
    feed: SequenceFeed | None = getattr(ngram_candidate_generator, "feed", None)  # a cost probe has none
    if feed is not None:
        feed.new_generation()  # the prefill comes first: not a step to time

    def candidate_generator(*args: Any, **kwargs: Any) -> NgramCandidateGenerator:
        return ngram_candidate_generator

    with _model_lock(model):
        # Shadows GenerationMixin._get_candidate_generator on this instance only, for this call.
        model._get_candidate_generator = candidate_generator
        try:
            return model._assisted_decoding(
                input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, **model_kwargs)
        finally:
            del model._get_candidate_generator


def generate(
    model: Any,
    input_ids: torch.Tensor,
    drafter: DrafterLike,
    *,
    seq_id: int,
    n_draft: int | str = "auto",
    stats: DraftStats | None = None,
    cost_aware: bool = False,
    verify_cost: VerifyCost | Sequence[float] | Callable[[int], float] | None = None,
    **generate_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` speculating with drafts of `drafter`: greedy
    decoding's output (or, with ``do_sample=True``, samples of the model's own distribution), in
    fewer forward passes when drafts are accepted.

    Args:
        model: a transformers causal LM (anything with ``generate``).
        input_ids: shape (1, prompt length).
        drafter: a drafter with `draft`, `accept` and `reset` bound to the model's tokenizer.
        seq_id: the drafter's sequence id for this generation (reset at its start).
        n_draft: "auto" (default): up to 64 drafted tokens a step, as many as the model's verify
            costs make worth it, learned from the steps of its generations (see the module's
            docstring; `learned_verify_cost(model)` shows them) or given by `verify_cost`. A
            whole number (1..256): that many tokens at most, every drafted token sent (unless
            `cost_aware`).
        stats: counters to add this generation's steps, drafted, accepted and new tokens to.
        cost_aware: with a whole `n_draft`: send each step only the drafted prefix with the
            most expected new tokens per unit of verify cost (0 tokens included; the output is
            unchanged). Needs a drafter with ``draft_scored`` (`ngramcache.Drafter`). Off by
            default. (``n_draft="auto"`` always is, and takes drafters without odds too.)
        verify_cost: the verify costs c(k) to use with "auto" or `cost_aware` (a `VerifyCost`, a
            list whose item k is c(k), or a callable), never learned; by default "auto" learns
            them and `cost_aware` measures them on `model` at its first cost-aware call
            (`measure_verify_cost`, about 10 s on CPU) and keeps them.
        **generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``attention_mask``,
            ``eos_token_id``, ``return_dict_in_generate``...); ``do_sample`` defaults to False.

    Returns:
        What ``model.generate`` returns.

    Raises:
        ValueError: beam search or several return sequences asked, a batch of more than one
            sequence, ``streamer`` or another drafting method given.
        InvalidArgumentError: `n_draft` neither "auto" nor in 1..256; `cost_aware` with a drafter
            without ``draft_scored``.
    """
    for name in ("streamer", "custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
        if generate_kwargs.get(name) is not None:
            raise ValueError(f"{name}= is not supported with ngramcache drafting")
    generate_kwargs.setdefault("do_sample", False)
    most, auto = draft_length_setting(n_draft)
    cost: VerifyCost | None = None
    if auto:
        if verify_cost is None:
            cost = learned_verify_cost(model)
        else:
            cost = verify_cost if isinstance(verify_cost, VerifyCost) else VerifyCost(verify_cost, most)
    elif cost_aware:
        if verify_cost is None:
            cost = _verify_cost_of(model)
        else:
            cost = verify_cost if isinstance(verify_cost, VerifyCost) else VerifyCost(verify_cost, max(most, 8))
    generator = NgramCandidateGenerator(drafter, seq_id, n_draft, stats=stats, verify_cost=cost)
    return model.generate(input_ids, custom_generate=ngram_decoding, ngram_candidate_generator=generator, **generate_kwargs)
