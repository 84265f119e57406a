"""The drafting setups the fleet-history benchmark compares, as fleet_sim.Setup implementations.

- `PromptLookup`: ngramcache's match mode with no history (history_tokens 0): each request
  drafts from its own prompt and output only.
- `SuffixTrees`: SuffixDecoding (the real arctic-inference cache, driven as vLLM's `suffix`
  method drives it, with vLLM's defaults: tests/bench/lib/peer_drafters.py) with one cache per
  replica (siloed, as vLLM runs it) or one cache for every request at zero lag (the ideal).
- `MatchLocal`: one match-mode Drafter per replica, with its own history.
- `MatchSiloed`: the same with each replica's own counts mirrored back to it, as a real client
  alone on its namespace drafts (fleet_counts.py, one fleet of one per replica).
- `MatchFleet`: the same, plus every other replica's accepted output tokens appended through
  `add_history` once `lag_ms` has passed since they were accepted. Each replica's Drafter
  tracks its history (drain_history after each accept); a record becomes visible to the others
  at its accept time + lag, and what becomes visible in one tick is appended grouped by source
  (one source per (replica, request)), so one pull continues each remote sequence's text.
  With `counts`, each replica's drafter also drafts from the fleet's counts as a real client
  mirrors them into its dynamic table (fleet_counts.py: pushed, filtered by the service's
  draft view, pulled).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.fleet_counts import FleetCounts
from bench.lib.fleet_sim import Setup
from ngramcache.client import _core


def _match_drafter(vocab_size: int, match_params: dict[str, float] | None, track_history: bool = False,
                   track_deltas: bool = False) -> Any:
    return _core.Drafter(vocab_size=vocab_size, fingerprint=_core.UNTAGGED, mode="match", match_params=match_params,
                         track_history=track_history, track_deltas=track_deltas)


class PromptLookup(Setup):
    """Per-request prompt lookup: the match mode with an empty history."""

    name = "prompt lookup (per request)"

    def __init__(self, k: int, vocab_size: int, match_params: dict[str, float] | None = None) -> None:
        super().__init__(k)
        params = dict(match_params or {})
        params["history_tokens"] = 0
        self.drafters = [_match_drafter(vocab_size, params) for _ in range(k)]

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self.drafters[replica].accept(rid, prompt)

    def draft(self, replica: int, rid: int, tokens: np.ndarray) -> Sequence[int]:
        return self.drafters[replica].draft(rid, tokens, 8).tolist()  # type: ignore[no-any-return]

    def observe(self, replica: int, rid: int, tokens: np.ndarray, n_new: int, now: float) -> None:
        self.drafters[replica].accept(rid, tokens)

    def finish(self, replica: int, rid: int, now: float) -> None:
        self.drafters[replica].reset(rid)


class MatchLocal(PromptLookup):
    """One match-mode Drafter per replica: its own requests' outputs are its history."""

    name = "ngramcache local only"

    def __init__(self, k: int, vocab_size: int, match_params: dict[str, float] | None = None,
                 track_history: bool = False, track_deltas: bool = False) -> None:
        Setup.__init__(self, k)
        self.drafters = [_match_drafter(vocab_size, match_params, track_history, track_deltas) for _ in range(k)]


class MatchSiloed(MatchLocal):
    """MatchLocal as real clients each alone on a namespace of their own run: each replica's own
    counts come back to its dynamic table through a draft view of its own (one FleetCounts each)."""

    name = "ngramcache local, own counts"

    def __init__(self, k: int, vocab_size: int, match_params: dict[str, float] | None = None) -> None:
        super().__init__(k, vocab_size, match_params, track_deltas=True)
        self.counts = [FleetCounts([d]) for d in self.drafters]

    def tick(self, now: float) -> None:
        for counts in self.counts:
            counts.tick(now)


class MatchFleet(MatchLocal):
    """MatchLocal plus the other replicas' output tokens through add_history after `lag_ms`, and
    with `counts` the fleet's shared counts as the real clients mirror them (FleetCounts)."""

    name = "ngramcache fleet"

    def __init__(self, k: int, vocab_size: int, lag_ms: float, match_params: dict[str, float] | None = None,
                 min_piece: int = 0, counts: bool = False) -> None:
        super().__init__(k, vocab_size, match_params, track_history=True, track_deltas=counts)
        self.counts = FleetCounts(self.drafters) if counts else None
        self.lag_ms = lag_ms
        # > 0: a remote sequence's visible tokens are held back until this many are pending (or it
        # ended), so fewer, longer pieces reach add_history (every piece starts a new text).
        self.min_piece = min_piece
        self.held: list[dict[int, list[np.ndarray]]] = [{} for _ in range(k)]
        self.ended: set[int] = set()
        self.prompt_len: dict[int, int] = {}
        # Every published record, in accept order: (accept ms, replica, source, output tokens).
        self.records: list[tuple[float, int, int, np.ndarray]] = []
        self.cursor = [0] * k  # per replica: records[:cursor] are delivered (or skipped)
        self.active = [True] * k
        self.pulled_tokens = [0] * k

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self.prompt_len[rid] = len(prompt)
        super().start(replica, rid, prompt, now)
        self._publish(replica, now)

    def observe(self, replica: int, rid: int, tokens: np.ndarray, n_new: int, now: float) -> None:
        super().observe(replica, rid, tokens, n_new, now)
        self._publish(replica, now)

    def _publish(self, replica: int, now: float) -> None:
        # Only generated tokens are published (the prompt is the caller's, not the model's output).
        for seq, offset, toks in self.drafters[replica].drain_history():
            cut = self.prompt_len[seq] - offset
            if cut < len(toks):
                self.records.append((now, replica, (replica << 32) | seq, toks[max(cut, 0):]))

    def finish(self, replica: int, rid: int, now: float) -> None:
        super().finish(replica, rid, now)
        self.records.append((now, replica, (replica << 32) | rid, np.zeros(0, dtype=np.int32)))  # its end
        self.ended.add((replica << 32) | rid)

    def _deliver(self, replica: int, upto: int, flush: bool = False) -> None:
        by_source = self.held[replica]
        for _, origin, source, toks in self.records[self.cursor[replica]:upto]:
            if origin != replica:
                by_source.setdefault(source, []).append(toks)
        drafter = self.drafters[replica]
        for source in list(by_source):
            pieces = by_source[source]
            n = sum(len(x) for x in pieces)
            if not flush and n < self.min_piece and source not in self.ended:
                continue
            del by_source[source]
            if n:
                toks = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
                drafter.add_history(source, toks)
                self.pulled_tokens[replica] += len(toks)
            if source in self.ended:
                drafter.end_history(source)  # what the drafter held back for a piece joins now
        self.cursor[replica] = upto

    def tick(self, now: float) -> None:
        if self.counts is not None:
            self.counts.tick(now)
        n = len(self.records)
        for replica in range(self.k):
            if not self.active[replica]:
                continue
            upto = self.cursor[replica]
            while upto < n and self.records[upto][0] + self.lag_ms <= now:
                upto += 1
            if upto > self.cursor[replica]:
                self._deliver(replica, upto)

    def hold(self, replica: int) -> None:
        self.active[replica] = False

    def join(self, replica: int, now: float, window: bool) -> None:
        # The window: every record published so far (each remote sequence whole, in one piece).
        if window:
            self._deliver(replica, len(self.records), flush=True)
        self.cursor[replica] = len(self.records)
        self.active[replica] = True

    def extra(self) -> dict[str, float]:
        return {"pulled_bytes_per_client": 4.0 * sum(self.pulled_tokens) / self.k,
                "history_dropped": float(sum(d.history_dropped for d in self.drafters)),
                **(self.counts.extra() if self.counts is not None else {})}


class MatchShared(MatchLocal):
    """One match-mode Drafter for every replica at zero lag: the match mode with what the
    ideal SuffixDecoding tree sees (a diagnostic: sharing is then free and instant)."""

    name = "ngramcache one drafter (no lag)"

    def __init__(self, k: int, vocab_size: int, match_params: dict[str, float] | None = None) -> None:
        super().__init__(1, vocab_size, match_params)
        self.k = k
        self.drafters = self.drafters * k


class SuffixTrees(Setup):
    """SuffixDecoding: one cache per replica (`shared=False`, vLLM's `suffix` on K replicas) or
    one cache that every replica reads and writes at once (`shared=True`, the ideal)."""

    def __init__(self, k: int, shared: bool, lib_dir: Path | None = None) -> None:
        super().__init__(k)
        from bench.lib.peer_drafters import SuffixDecodingPeer

        self.peers = [SuffixDecodingPeer(lib_dir=lib_dir) for _ in range(1 if shared else k)]
        self.shared = shared
        self.name = "SuffixDecoding ideal (one tree, no lag)" if shared else "SuffixDecoding siloed (per replica)"

    def _peer(self, replica: int) -> Any:
        return self.peers[0 if self.shared else replica]

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        self._peer(replica).cache.start_request(rid, np.ascontiguousarray(prompt, dtype=np.int32))

    def draft(self, replica: int, rid: int, tokens: np.ndarray) -> Sequence[int]:
        peer = self._peer(replica)
        d = peer.cache.speculate(rid, np.ascontiguousarray(tokens[-peer.max_tree_depth:], dtype=np.int32),
                                 max_spec_tokens=8, max_spec_factor=peer.max_spec_factor,
                                 max_spec_offset=peer.max_spec_offset, min_token_prob=peer.min_token_prob,
                                 use_tree_spec=False)
        return list(d.token_ids)

    def observe(self, replica: int, rid: int, tokens: np.ndarray, n_new: int, now: float) -> None:
        self._peer(replica).cache.add_active_response(rid, np.ascontiguousarray(tokens[-n_new:], dtype=np.int32))

    def finish(self, replica: int, rid: int, now: float) -> None:
        self._peer(replica).cache.stop_request(rid)
