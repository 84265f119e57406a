"""One engine sequence fed to an ngramcache drafter: what is new is accepted, a rewind or a new prompt resets it, counters kept."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from ngramcache.client._core import Drafter
from ngramcache.client.adapters.draft_length import DraftLengthPolicy
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["CAPPED_AUTO_DRAFT", "UNCAPPED_MAX_COST", "DraftStats", "DrafterLike", "SequenceFeed"]

# The most c(n_draft) at which an "auto" feed drafts long, cost-aware: on an H200 c(64) =
# 1.10-1.15; on 2 CPU cores c(8) is already ~2, and uncapped drafts made the default 14% slower there.
UNCAPPED_MAX_COST = 1.5
# Where a full-length draft costs more than that, an "auto" feed drafts at most this many tokens
# a step (the best fixed length on 2 CPU cores). With costs learned from the steps, and until
# they are measured, it sends them as a fixed n_draft does, the drafter's own draft whole: costs
# learned beside other jobs are noisy (a burst of load between two steps reads as a dear draft,
# or a cheap one), and a cut by them was worse than none (0.59x the tokens/s of n_draft 8).
CAPPED_AUTO_DRAFT = 16


def __getattr__(name: str) -> int:
    """``DEAR_MAX_DRAFT``, this constant's old name (deprecated): `CAPPED_AUTO_DRAFT`, with a DeprecationWarning."""
    if name == "DEAR_MAX_DRAFT":
        warnings.warn("sequence_feed.DEAR_MAX_DRAFT is CAPPED_AUTO_DRAFT; the old name goes in a later major version",
                      DeprecationWarning, stacklevel=2)
        return CAPPED_AUTO_DRAFT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DrafterLike(Protocol):
    """What the adapters need of a drafter: `ngramcache.Drafter`, `NgramClient(...).drafter()`
    and `ngramcache.client.sync.remote.RemoteDrafter` all have it."""

    def draft(self, seq: int, tokens: NDArray[np.int32], n_draft: int = 8) -> NDArray[np.int32]: ...

    def accept(self, seq: int, tokens: NDArray[np.int32]) -> None: ...

    def reset(self, seq: int) -> bool: ...


@dataclass
class DraftStats:
    """Counters of speculative decoding with an n-gram drafter.

    Attributes:
        steps: forward passes of the target model while generating (the prefill included);
            each but the prefill verifies one draft, possibly empty.
        drafted: tokens proposed by the drafter.
        accepted: proposed tokens the model kept.
        tokens: new tokens the model produced (accepted drafts plus one token per step).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted per drafted token (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def forward_passes_per_token(self) -> float:
        """Target-model forward passes per new token (1.0 without speculation; lower is better)."""
        return self.steps / self.tokens if self.tokens else 0.0


class SequenceFeed:
    """Feeds one sequence of an engine to a drafter, as llama.cpp's lookup decoding does.

    Each `draft(tokens)` gets the whole verified sequence so far (prompt + generated). When it
    extends the sequence seen last, only the new tokens are counted (`accept`); when it does
    not (a new prompt, or the engine rewound), the drafter's sequence is reset and the whole
    sequence is counted again. Then up to `n_draft` tokens are drafted.

    Not thread-safe: one feed serves one sequence of one engine, called from one thread.

    Args:
        drafter: any drafter with `draft`, `accept` and `reset` (see `DrafterLike`).
        seq_id: the drafter's sequence id this feed uses.
        n_draft: most tokens drafted per step (1..256).
        stats: counters to add to (a new `DraftStats` when omitted).
        policy: cost-aware drafting: the drafter's `draft_scored` gives each token's odds and
            the policy sends the prefix with the most expected tokens per unit of verify cost
            (None: every drafted token is sent, as llama.cpp does). When its costs are a
            `StepCosts`, each `draft` call times the step since the previous one (the engine's
            step that verified the previous draft) and records it there.
        unscored_odds: the odds given to every drafted token of a drafter without `draft_scored`
            (calibrated by the policy like any odds); None: such a drafter is refused.
        uncapped: an "auto" feed (with a policy): while the policy's costs say a full-length
            draft costs at most `UNCAPPED_MAX_COST` steps (a GPU's), a match-mode
            `ngramcache.Drafter` drafts with ``draft_scored(..., uncapped=True)`` (a match's draft
            is not cut by its length or its probability) and the policy sends the prefix its odds
            and the costs make worth it. Where long drafts are dear (a CPU): with costs learned
            from the steps (`StepCosts`), and until they are measured, each step sends the
            drafter's own draft of at most `CAPPED_AUTO_DRAFT` tokens, whole, as a fixed n_draft
            does (a step they ask to time undrafted sends none); with given costs, drafts are
            at most `CAPPED_AUTO_DRAFT` tokens and the policy cuts them.

    Raises:
        InvalidArgumentError: a policy with a drafter that has no `draft_scored` (and no `unscored_odds`).
    """

    def __init__(self, drafter: DrafterLike, seq_id: int, n_draft: int = 8, stats: DraftStats | None = None,
                 policy: DraftLengthPolicy | None = None, *, unscored_odds: float | None = None,
                 uncapped: bool = False) -> None:
        if n_draft < 1:
            raise ValueError(f"n_draft must be at least 1, got {n_draft}")
        self._scored = hasattr(drafter, "draft_scored")
        if policy is not None and not self._scored and unscored_odds is None:
            raise InvalidArgumentError(
                f"cost-aware drafting needs a drafter with draft_scored() (ngramcache.Drafter), got {type(drafter).__name__}")
        self.policy = policy
        self.unscored_odds = unscored_odds
        self._auto = uncapped and policy is not None
        self._uncapped = self._auto and isinstance(drafter, Drafter)
        # Step timing for learned costs: when the last draft() ran and how many tokens it sent.
        self._step_costs = policy.cost if policy is not None and hasattr(policy.cost, "record") else None
        self._last_call: float | None = None
        self._last_sent = 0
        # The last full draft and its odds, before the policy cut it: what the model's next
        # tokens are compared with to calibrate the policy.
        self._full: NDArray[np.int32] = np.empty(0, dtype=np.int32)
        self._full_odds: NDArray[np.float32] = np.empty(0, dtype=np.float32)
        self.drafter = drafter
        self.seq_id = seq_id
        self.n_draft = n_draft
        self.stats = stats if stats is not None else DraftStats()
        self._seen: NDArray[np.int32] | None = None  # the sequence accepted last (a private copy)

    @property
    def seen(self) -> NDArray[np.int32] | None:
        """The sequence accepted last (None before the first call and after `reset`)."""
        return self._seen

    def extends_seen(self, tokens: NDArray[np.int32]) -> bool:
        """Whether `tokens` is the sequence accepted last followed by zero or more tokens."""
        seen = self._seen
        return seen is not None and len(tokens) >= len(seen) and bool(np.array_equal(tokens[: len(seen)], seen))

    def accept(self, tokens: NDArray[np.int32]) -> bool:
        """Counts what is new in `tokens` (the whole verified sequence).

        Returns:
            True when `tokens` extends the sequence accepted last; False when the drafter's
            sequence was started again (first call, new prompt or rewind).
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        seen = self._seen
        continued = seen is not None and self.extends_seen(tokens)
        if continued and seen is not None and len(tokens) == len(seen):
            return True
        if self.policy is not None and len(self._full) and continued and seen is not None:
            self._calibrate(tokens[len(seen):])
        self._full = self._full[:0]
        if not continued:
            # The drafter counts only positions past those it accepted before, so a sequence
            # that does not extend them starts from nothing (which also clears what an earlier
            # user of this seq id left behind).
            self.drafter.reset(self.seq_id)
            self._last_call = None  # a new prompt: the time since the last call is not one step
            if self.policy is not None:
                self.policy.reset()
        self.drafter.accept(self.seq_id, tokens)
        self._seen = tokens.copy()  # engines reuse their buffers: keep a copy
        return continued

    def draft(self, tokens: NDArray[np.int32], limit: int | None = None) -> NDArray[np.int32]:
        """Accepts what is new in `tokens`, then drafts up to min(n_draft, limit) tokens to follow it.

        Args:
            tokens: the whole verified sequence so far.
            limit: a tighter bound for this step (e.g. the room left before a length limit).

        Returns:
            An int32 array, empty when the drafter has nothing (or `limit` < 1).
        """
        now = time.perf_counter()
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.accept(tokens)
        if self._step_costs is not None and self._last_call is not None:
            self._step_costs.record(self._last_sent, now - self._last_call)
        self._last_call, self._last_sent = now, 0
        self.stats.steps += 1
        n = self.n_draft if limit is None else min(self.n_draft, limit)
        if n < 1 or len(tokens) == 0:
            return np.empty(0, dtype=np.int32)
        if self._auto and self._step_costs is not None and not self.long_drafts_cheap(n):
            # Learned costs that say long drafts are dear, or not measured yet: a fixed length.
            if self._step_costs.needs_baseline():  # they ask for a plain step to time
                drafted = np.empty(0, dtype=np.int32)
            else:
                m = min(n, CAPPED_AUTO_DRAFT)
                drafted = np.asarray(self.drafter.draft(self.seq_id, tokens, m), dtype=np.int32)[:m]
        elif self.policy is None:
            drafted = np.asarray(self.drafter.draft(self.seq_id, tokens, n), dtype=np.int32)[:n]
        else:
            if self._scored:
                if self._uncapped and self.long_drafts_cheap(n):
                    full, odds = self.drafter.draft_scored(self.seq_id, tokens, n, uncapped=True)  # type: ignore[attr-defined]
                else:
                    if self._uncapped:  # given costs that say long drafts are dear: the policy cuts
                        n = min(n, CAPPED_AUTO_DRAFT)
                    full, odds = self.drafter.draft_scored(self.seq_id, tokens, n)  # type: ignore[attr-defined]
                self._full = np.asarray(full, dtype=np.int32)[:n]
                self._full_odds = np.asarray(odds, dtype=np.float32)[: len(self._full)]
            else:
                self._full = np.asarray(self.drafter.draft(self.seq_id, tokens, n), dtype=np.int32)[:n]
                self._full_odds = np.full(len(self._full), self.unscored_odds, dtype=np.float32)
            drafted = self._full[: self.policy.choose(self._full_odds)]
        self._last_sent = len(drafted)
        self.stats.drafted += len(drafted)
        return drafted

    def long_drafts_cheap(self, n: int) -> bool:
        """Whether an "auto" feed drafts long and cost-aware now: its costs are measured (or given)
        and a draft of `n` tokens costs at most `UNCAPPED_MAX_COST` steps."""
        assert self.policy is not None
        cost = self.policy.cost
        return bool(getattr(cost, "measured", True)) and cost(n) <= UNCAPPED_MAX_COST

    def new_generation(self) -> None:
        """Says the engine starts a generation (a prefill comes before the next `draft`): the time
        until then is not a step of the loop, so it is not recorded."""
        self._last_call = None

    def _calibrate(self, new: NDArray[np.int32]) -> None:
        """Tells the policy how far the model's `new` tokens agreed with the last full draft.

        Only the drafted positions the model produced a token for count (sent or not), so a
        sequence drafting 0 tokens still learns from each token it generates.
        """
        assert self.policy is not None
        window = min(len(new), len(self._full))
        agree = new[:window] == self._full[:window]
        agreed = int(np.argmin(agree)) if not agree.all() else window
        self.policy.record(self._full_odds[:window], agreed)

    def reset(self) -> None:
        """Forgets the sequence (here and in the drafter)."""
        self._seen = None
        self._full = self._full[:0]
        self._last_call = None
        if self.policy is not None:
            self.policy.reset()
        self.drafter.reset(self.seq_id)
