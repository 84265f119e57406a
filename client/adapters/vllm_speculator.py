"""vLLM 0.34+ adapter: an ngramcache drafter as the speculator of the ``ngramcache`` speculative method (V2 model runner).

Usage (vLLM 0.34, where ``custom_class`` is gone; this package's ``vllm.general_plugins`` entry
point registers the method in every vLLM process)::

    vllm serve MODEL --speculative-config '{"method": "ngramcache", "num_speculative_tokens": 8,
        "speculator_options": {"static": "/data/gen-7.ngc"}}'

(or ``NGC_VLLM_*`` variables, which the options override: `ngramcache.client.adapters.vllm.ProposerConfig`).

What vLLM 0.34.0 does (``vllm/v1/worker/gpu/spec_decode/__init__.py`` ``init_speculator``,
``speculator.py`` ``BaseSpeculator``, ``model_runner.py`` ``sample_tokens``), pinned by
``tests/unit/test_adapter_vllm_speculator_contract.py``: each GPU worker (the last pipeline
stage) builds ``NgramCacheSpeculator(vllm_config, device, req_states=...)``; after each step has
sampled and written the sampled tokens into ``req_states.all_token_ids`` (rows indexed by
request-state slot, ``total_len`` long), it calls `propose` with the batch (``req_ids``,
``idx_mapping``: batch row -> slot) and ``num_sampled`` per row (0: a prefill chunk not finished),
and takes back a [num_reqs, num_speculative_tokens] tensor: every slot is verified, so slots with
no draft hold a filler (the row's last token, as vLLM's own n-gram speculator does).
``add_request(slot)`` says a slot got a request (new, resumed after preemption, or streamed more
input): its row is read whole at its next step; ``on_requests_finished(ids)`` frees sequences.

A request is a drafter sequence keyed by its id; each step only the new tokens of a row are
copied from the device (one gather), after one small copy that waits for the step's sampling:
a drafter on the CPU cannot draft before the sampled tokens exist.

How much to draft: vLLM verifies ``num_speculative_tokens`` slots per row whatever is drafted,
so a shorter draft saves nothing; each row gets the drafter's whole draft up to that width (the
match mode's long copies fill it). With vLLM's ``enable_adaptive_verification``, vLLM cuts the
drafts itself, by its own profiled step costs and the confidences this speculator gives each
slot (the drafter's per-token odds; 0 for fillers).
"""

from __future__ import annotations

import atexit
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray

try:
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
except ImportError as e:
    raise ImportError("ngramcache.client.adapters.vllm_speculator needs vLLM 0.34 or later (its V2 model runner's "
                      "BaseSpeculator); vLLM 0.22-0.33 use ngramcache.client.adapters.vllm.NgramCacheProposer") from e

from ngramcache.client._core import MAX_DRAFT
from ngramcache.client.adapters.batch_rows import RowSequence
from ngramcache.client.adapters.sequence_feed import DrafterLike, DraftStats
from ngramcache.client.adapters.step_costs import UNSCORED_ODDS
from ngramcache.client.adapters.vllm import ProposerConfig, open_drafter
from ngramcache.client.kernel.errors import InvalidArgumentError

__all__ = ["NgramCacheSpeculator"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def is_warmup_request(req_id: str) -> bool:
    """vLLM's warmup requests (``_warmup_0_``, ``_v2_mixed_warmup_prefill_0_``: synthetic token ids
    0, 1, 2...) are neither drafted for nor learned from: a synced drafter would push their n-grams."""
    return req_id.startswith("_") and "warmup_" in req_id


class NgramCacheSpeculator(BaseSpeculator):
    """vLLM 0.34's ``BaseSpeculator`` drafting with an ngramcache drafter (see the module docstring).

    Not thread-safe: vLLM's model runner calls it from one thread. The drafter is its own;
    `close` releases it (and runs at interpreter exit when a client to a service was opened).

    Args:
        vllm_config: vLLM's ``VllmConfig``; read: ``speculative_config`` (``num_speculative_tokens``,
            ``speculator_options``, ``enable_adaptive_verification``), ``model_config``
            (``max_model_len``, tokenizer, vocabulary size), ``scheduler_config.max_num_seqs``,
            ``parallel_config.tensor_parallel_size``.
        device: where vLLM's tensors live (the drafts are copied there).
        req_states: vLLM's ``RequestState`` (``all_token_ids``, ``total_len``).
        config: the drafter's settings (default: ``ProposerConfig.from_options(speculator_options)``).

    Raises:
        InvalidArgumentError: a bad setting, or a service with tensor parallelism (every rank
            drafts on its own, and ranks must draft alike: a synced drafter's counts move between them).
    """

    def __init__(self, vllm_config: Any, device: Any, req_states: Any, config: ProposerConfig | None = None) -> None:
        spec = vllm_config.speculative_config
        self.config = ProposerConfig.from_options(getattr(spec, "speculator_options", None)) if config is None else config
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.req_states = req_states
        self.num_speculative_steps = int(spec.num_speculative_tokens)
        fixed = self.config.n_draft if isinstance(self.config.n_draft, int) else None
        self.n_draft = min(self.num_speculative_steps, fixed or self.num_speculative_steps, MAX_DRAFT)
        tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        if tp > 1 and self.config.service:
            raise InvalidArgumentError(f"NGC_VLLM_SERVICE with tensor_parallel_size {tp}: each rank drafts on its own "
                                       f"and ranks must draft alike; use NGC_VLLM_STATIC (a generation file) instead")
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        max_parked = self.config.max_parked if self.config.max_parked is not None else self.max_num_reqs
        self.max_kept = self.max_num_reqs + max_parked  # sequences kept, in the batch or out of it (preempted)
        self.enable_adaptive_verification = bool(getattr(spec, "enable_adaptive_verification", False))
        shape = (self.max_num_reqs, self.num_speculative_steps)
        self.drafts = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.draft_token_confidence_probs = torch.zeros(shape, dtype=torch.float32, device=self.device)
        pin = self.device.type == "cuda"  # pinned host buffers: the copies to the device run asynchronously
        self._host_drafts = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        self._host_confidences = torch.zeros(shape, dtype=torch.float32, pin_memory=pin)
        self._owned: list[Any] = []
        self._seqs: OrderedDict[str, RowSequence] = OrderedDict()  # request id -> sequence, least recently used first
        self._next_seq = 1
        self._whole: set[int] = set()  # request-state slots (re)assigned since their last step: read whole
        self.stats = DraftStats()
        self.drafter: DrafterLike = self.make_drafter(vllm_config)

    def make_drafter(self, vllm_config: Any) -> DrafterLike:
        """The drafter to draft with (`open_drafter` of `self.config`); override it in a subclass
        (named by the ``speculator_class`` of a config subclass) to bring your own; `own` what it opens."""
        return open_drafter(self.config, vllm_config, self.own)

    def own(self, obj: _T) -> _T:
        """Makes `close` (and interpreter exit) close `obj`; returns it."""
        if not self._owned:
            atexit.register(self.close)
        self._owned.append(obj)
        return obj

    # --- BaseSpeculator ---

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        """No graphs: the drafter runs on the CPU."""

    def capture(self) -> None:
        """No graphs to capture."""

    def add_request(self, req_index: int) -> None:
        """Slot `req_index` got a request: its row is read whole at its next step."""
        self._whole.add(int(req_index))

    def on_requests_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Frees the finished requests' sequences."""
        for req_id in finished_req_ids:
            seq = self._seqs.pop(req_id, None)
            if seq is not None:
                self.drafter.reset(seq.seq_id)

    def reset_state(self) -> None:
        """Forgets every sequence (vLLM calls it after its warmup requests)."""
        for seq in self._seqs.values():
            self.drafter.reset(seq.seq_id)
        self._seqs.clear()

    def update_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = int(max_model_len)

    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any, last_hidden_states: Any,
                aux_hidden_states: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: Any, temperature: Any, seeds: Any,
                dp_sync_state: Any = None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs: Any = None, is_profile: bool = False, num_speculative_tokens: int | None = None) -> torch.Tensor:
        """Drafts for every row of the batch: [num_reqs, num_speculative_tokens] int64 on the device
        (only `input_batch`, `num_sampled` and `num_speculative_tokens` are read)."""
        with torch.inference_mode():
            return self._propose(input_batch, num_sampled, dummy_run, num_speculative_tokens)

    def _propose(self, input_batch: Any, num_sampled: torch.Tensor, dummy_run: bool,
                 num_speculative_tokens: int | None) -> torch.Tensor:
        num_reqs = int(input_batch.num_reqs)
        width = self.num_speculative_steps if num_speculative_tokens is None else min(int(num_speculative_tokens),
                                                                                      self.num_speculative_steps)
        if dummy_run or num_reqs == 0 or width <= 0:
            return self.drafts[:num_reqs]
        req_ids: list[str] = list(input_batch.req_ids[:num_reqs])
        slots = np.asarray(input_batch.idx_mapping_np[:num_reqs], dtype=np.int64)
        idx = input_batch.idx_mapping[:num_reqs]
        # One small copy to the host, which waits for this step's sampling: tokens sampled and length per row.
        info = torch.stack((num_sampled[:num_reqs].to(torch.int64),
                            self.req_states.total_len.gpu[idx].to(torch.int64))).cpu().numpy()
        sampled, lengths = info[0], info[1]
        rows = [b for b in range(num_reqs) if sampled[b] > 0 and not is_warmup_request(req_ids[b])]
        seqs = self._sequences(rows, req_ids, slots, lengths)
        host = self._host_drafts[:num_reqs].numpy()
        host.fill(0)
        confidences = self._host_confidences[:num_reqs].numpy() if self.enable_adaptive_verification else None
        if confidences is not None:
            confidences.fill(0.0)
        if rows:
            taken = int(sampled[rows].sum())
            self.stats.steps += len(rows)
            self.stats.tokens += taken
            self.stats.accepted += taken - len(rows)  # vLLM samples the accepted drafted tokens and one more
            # Fillers: verified like drafts, rejected unless the model repeats the row's last token.
            host[rows, :width] = np.array([s.tokens[-1] for s in seqs], dtype=np.int64)[:, None]
        limits = np.minimum(min(self.n_draft, width), self.max_model_len - lengths[rows]).tolist()
        wanted = [k for k, limit in enumerate(limits) if limit > 0]
        if wanted:
            drafts, odds = self._draft([seqs[k] for k in wanted], [limits[k] for k in wanted], confidences is not None)
            for k, draft, p in zip(wanted, drafts, odds, strict=True):
                b = rows[k]
                host[b, : len(draft)] = draft
                if confidences is not None:
                    confidences[b, : len(p)] = p
                self.stats.drafted += len(draft)
        self.drafts[:num_reqs].copy_(self._host_drafts[:num_reqs], non_blocking=True)
        if confidences is not None:
            self.draft_token_confidence_probs[:num_reqs].copy_(self._host_confidences[:num_reqs], non_blocking=True)
        return self.drafts[:num_reqs]

    def _sequences(self, rows: list[int], req_ids: list[str], slots: NDArray[np.int64],
                   lengths: NDArray[np.int64]) -> list[RowSequence]:
        """Each row's sequence, brought up to the row's tokens (only what is new is read from the device)."""
        out: list[RowSequence | None] = [None] * len(rows)
        tails: list[int] = []  # positions in `rows` whose sequence continues: read the new tokens only
        token_ids = self.req_states.all_token_ids.gpu
        for k, b in enumerate(rows):
            req_id, slot, n = req_ids[b], int(slots[b]), int(lengths[b])
            seq = self._seqs.get(req_id)
            if seq is not None and slot not in self._whole and len(seq) <= n:
                tails.append(k)
                out[k] = seq
                continue
            # A request new to the slot (new, resumed, or with more input): its whole row, once.
            self._whole.discard(slot)
            row = token_ids[slot, :n].cpu().numpy().astype(np.int32, copy=False)
            if seq is None or not seq.is_prefix_of(row):
                if seq is not None:
                    self.drafter.reset(seq.seq_id)
                seq = RowSequence(self._next_seq)
                self._next_seq += 1
                self.drafter.reset(seq.seq_id)  # a shared drafter: make sure the id starts empty
                self._seqs[req_id] = seq
            self.drafter.accept(seq.seq_id, row)
            seq.extend_to(row)
            out[k] = seq
        if tails:
            starts = np.array([len(out[k]) for k in tails], dtype=np.int64)  # type: ignore[arg-type]
            ends = np.array([int(lengths[rows[k]]) for k in tails], dtype=np.int64)
            most = int((ends - starts).max())
            if most > 0:
                pos = np.minimum(starts[:, None] + np.arange(most, dtype=np.int64)[None, :], (ends - 1)[:, None])
                at = torch.as_tensor(slots[[rows[k] for k in tails]], device=token_ids.device)
                new = token_ids[at[:, None], torch.as_tensor(pos, device=token_ids.device)].cpu().numpy().astype(np.int32, copy=False)
                for i, k in enumerate(tails):
                    seq = out[k]
                    assert seq is not None
                    m = int(ends[i] - starts[i])
                    if m > 0:
                        seq.append(new[i, :m])
                        self.drafter.accept(seq.seq_id, seq.tokens)
        for b in rows:
            self._seqs.move_to_end(req_ids[b])
        self._free_beyond_bound(len(rows))
        return [s for s in out if s is not None]

    def _draft(self, seqs: list[RowSequence], limits: list[int],
               scored: bool) -> tuple[list[NDArray[np.int32]], list[NDArray[np.float32]]]:
        """Drafts (and, when `scored`, each token's odds) for `seqs`, at most `limits` tokens each."""
        from ngramcache.client._core import Drafter

                # In the match mode each copy runs to the width (uncapped): vLLM verifies every slot anyway.
        matcher = self.drafter if self.config.mode == "match" and isinstance(self.drafter, Drafter) else None
        uncapped = matcher is not None
        draft_scored = getattr(self.drafter, "draft_scored", None) if scored else None
        if callable(draft_scored):
            pairs = [draft_scored(s.seq_id, s.tokens, n, uncapped=True) if uncapped else draft_scored(s.seq_id, s.tokens, n)
                     for s, n in zip(seqs, limits, strict=True)]
            return ([np.asarray(d, dtype=np.int32)[:n] for (d, _), n in zip(pairs, limits, strict=True)],
                    [np.asarray(p, dtype=np.float32)[:n] for (_, p), n in zip(pairs, limits, strict=True)])
        most = max(limits)
        batch = getattr(self.drafter, "draft_batch", None)
        if callable(batch):
            # One call for the whole batch, with the GIL released throughout (Drafter).
            ids, tokens = [s.seq_id for s in seqs], [s.tokens for s in seqs]
            drafted, lengths = matcher.draft_batch(ids, tokens, most, uncapped=True) if matcher else batch(ids, tokens, most)
            drafts = [drafted[i, : min(int(lengths[i]), limits[i])] for i in range(len(seqs))]
        else:
            drafts = [np.asarray(self.drafter.draft(s.seq_id, s.tokens, n), dtype=np.int32)[:n]
                      for s, n in zip(seqs, limits, strict=True)]
        return drafts, [np.full(len(d), UNSCORED_ODDS, dtype=np.float32) for d in drafts]

    def _free_beyond_bound(self, in_batch: int) -> None:
        """Frees the least recently used sequences past `max_kept` (requests preempted and never
        resumed), never one of this step's `in_batch` (the most recently used)."""
        while len(self._seqs) > max(self.max_kept, in_batch):
            _, seq = self._seqs.popitem(last=False)
            self.drafter.reset(seq.seq_id)

    def close(self) -> None:
        """Frees the sequences and closes the clients this speculator opened (idempotent)."""
        owned, self._owned = self._owned, []
        if owned or self._seqs:
            try:
                self.reset_state()
            except Exception:  # a remote drafter whose service is gone: its sessions are gone too
                log.debug("ngramcache vLLM speculator: freeing sequences failed", exc_info=True)
        for obj in owned:
            obj.close()
