"""Peer drafting methods for the drafting benchmark, replayed under llama-lookup-stats' protocol.

Three peers, each run for real under the same replay as ngramcache's native `replay`
(native/src/replay.cc):

- `VllmNgram`: vLLM's n-gram proposer rule (`prompt_lookup_min=2, prompt_lookup_max=5`),
  re-implemented from its published algorithm.
- `TransformersPromptLookup`: transformers' prompt-lookup rule (`max_matching_ngram_size=2`,
  `prompt_lookup_num_tokens` = n_draft), likewise.
- `SuffixDecodingPeer`: SuffixDecoding itself, arctic-inference 0.3.0's suffix trees and its
  `SuffixDecodingCache` wrapper (the object vLLM's "suffix" method drives), built by
  tests/bench/engines/build_suffix_decoding.py; linear drafts as vLLM takes them, or token trees.

`replay(method, tokens, ...)` runs one of them and returns steps, drafted, accepted,
accept %, tokens/step and the time spent in draft calls. From the command line, one
configuration per process (so the peak RSS printed is that run's):

    python tests/bench/lib/peer_drafters.py vllm-ngram
    python tests/bench/lib/peer_drafters.py transformers-pld
    python tests/bench/lib/peer_drafters.py suffix [--corpus .bench-data/tokens/25mb.npy] [--factor 4] [--tree-budget 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
# The folder tests/bench/engines/build_suffix_decoding.py builds SuffixDecoding into (what it prints).
DEFAULT_SUFFIX_LIB = ROOT / ".bench-data" / "peers" / "arctic_inference-0.3.0"

TokenSeq = np.ndarray | Sequence[int]


def _as_tokens(context: TokenSeq) -> np.ndarray:
    """A 1-D contiguous int32 view (no copy when it already is one)."""
    return np.ascontiguousarray(context, dtype=np.int32).reshape(-1)


def earliest_suffix_match(ctx: np.ndarray, min_n: int, max_n: int, disjoint: bool = False) -> tuple[int, int]:
    """The longest n in [min_n, max_n] whose last-n-token suffix of `ctx` also occurs earlier,
    and where its earliest such occurrence ends: returns (n, index right after that occurrence),
    or (0, -1) when no n in range matches.

    "Earlier" means any occurrence other than the suffix itself (it may overlap it); with
    `disjoint` the occurrence must lie wholly before the suffix (vLLM's V1 proposer before PR #22437).
    One pass per n: candidates are end positions e < len(ctx) - 1, and the set of ends
    matching the last n tokens is the set matching the last n-1 tokens whose token n-1 places
    back also agrees, so n stops growing at the first n without a candidate.
    """
    last = len(ctx) - 1
    max_n = min(max_n, last)
    if max_n < max(min_n, 1):
        return 0, -1
    best = (0, -1)
    alive = ctx[:last] == ctx[last]  # alive[i]: an occurrence of the last n tokens ends at e = i + n - 1
    for n in range(1, max_n + 1):
        if n > 1:
            alive = alive[1:] & (ctx[: last - n + 1] == ctx[last - n + 1])
        usable = alive[: max(last - 2 * n + 2, 0)] if disjoint else alive  # disjoint: e <= last - n
        i = int(usable.argmax()) if usable.size else 0
        if not usable.size or not usable[i]:
            break  # no occurrence of the last n tokens: none of longer suffixes either
        if n >= min_n:
            best = (n, i + n)  # e + 1 = i + n
    return best


class PeerDrafter:
    """What replay() drives. Stateless rules override draft(); stateful methods also hear of
    each chunk (a request) and of the tokens appended to it; tree methods set `tree` and
    override draft_tree()."""

    name = "peer"
    tree = False

    def settings(self) -> dict[str, Any]:
        return {}

    def feed(self, stream: np.ndarray) -> None:
        raise TypeError(f"{self.name} keeps no state across requests: it cannot be fed a corpus")

    def start_chunk(self, prompt: np.ndarray) -> None:
        """A new request whose prompt is `prompt` (the chunk's first token)."""

    def observe(self, tokens: np.ndarray) -> None:
        """`tokens` were appended to the request's output (accepted drafts and the model's token)."""

    def end_chunk(self) -> None:
        """The request finished."""

    def draft(self, context: TokenSeq, n_draft: int) -> list[int]:
        raise TypeError(f"{self.name} drafts no lines (it is a tree method: replay calls draft_tree)")

    def draft_tree(self, context: TokenSeq, n_draft: int) -> tuple[list[int], list[int]]:
        """Token ids and, for each, the index of its parent (-1: a child of the root)."""
        raise TypeError(f"{self.name} drafts no trees (set tree = True and override draft_tree)")


class VllmNgram(PeerDrafter):
    """vLLM's n-gram proposer: the longest n in [min_n, max_n] whose last-n tokens occur earlier
    in the context, the earliest (leftmost) such occurrence, and up to k tokens that follow it
    (fewer when the context ends sooner; none when nothing matches).

    Followed: vllm/v1/spec_decode/ngram_proposer.py, `_find_longest_matched_ngram_and_propose_tokens`
    as rewritten by vLLM PR #22437 ("Propose tokens with a single KMP", 2025; read at vllm-project/vllm
    commit 016e8ed): one KMP pass over the reversed tokens, ties broken toward the leftmost match
    (`prev_lps >= longest_ngram`); the earlier occurrence may overlap the suffix. The earlier V1
    proposer (v0.7 on, `_find_subarray_kmp`: n from max_n down, first KMP hit) differs only there:
    it searched `context[:-n]`, so the occurrence had to end before the suffix starts;
    `disjoint=True` gives that variant. The max_model_len cap (k <= max_model_len - len(context))
    never binds in a replay and is left out.
    """

    name = "vllm-ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5, disjoint: bool = False) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.disjoint = min_n, max_n, disjoint

    def settings(self) -> dict[str, Any]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n, "disjoint": self.disjoint}

    def draft(self, context: TokenSeq, n_draft: int) -> list[int]:
        ctx = _as_tokens(context)
        n, start = earliest_suffix_match(ctx, self.min_n, self.max_n, self.disjoint)
        return ctx[start : start + n_draft].tolist() if n else []


class TransformersPromptLookup(PeerDrafter):
    """transformers' prompt lookup: for ngram_size from min(max_ngram, len - 1) down to 1, slide a
    window over input_ids, take the first (leftmost) window equal to the last ngram_size tokens
    that has at least one token after it, and draft up to num_output_tokens (= n_draft) of them;
    stop at the first size with a match.

    Followed: src/transformers/generation/candidate_generator.py,
    `PromptLookupCandidateGenerator.get_candidates` (the same rule from 4.38 through 4.57, and in
    5.24.0, installed here): `max_matching_ngram_size` defaults to 2. Left out, as they never
    bind here: the max_length cap, cutting the candidate at an eos token, and the logits
    processors' forbidden tokens. A window is usable iff it is not the suffix itself, so this
    is vLLM's rule with min_n = 1 (the overlapping variant).
    """

    name = "transformers-pld"

    def __init__(self, max_ngram: int = 2) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def settings(self) -> dict[str, Any]:
        return {"max_matching_ngram_size": self.max_ngram}

    def draft(self, context: TokenSeq, n_draft: int) -> list[int]:
        ctx = _as_tokens(context)
        n, start = earliest_suffix_match(ctx, 1, self.max_ngram)
        return ctx[start : start + n_draft].tolist() if n else []


class SuffixDecodingUnavailable(ImportError):
    pass


def load_suffix_decoding_cache(lib_dir: Path | str | None = None) -> Any:
    """arctic-inference's `SuffixDecodingCache` class, from the folder build_suffix_decoding.py built."""
    folder = Path(lib_dir) if lib_dir is not None else DEFAULT_SUFFIX_LIB
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SuffixDecodingUnavailable(
            f"SuffixDecoding is not built in {folder} ({e}): run `python tests/bench/engines/build_suffix_decoding.py` "
            "(it prints the folder to pass as lib_dir)") from None
    return SuffixDecodingCache


class SuffixDecodingPeer(PeerDrafter):
    """SuffixDecoding through arctic-inference's `SuffixDecodingCache`, driven as vLLM's
    `SuffixDecodingProposer` (vllm/v1/spec_decode/suffix_decoding.py) drives it:

    - a request starts with its prompt (start_request: a per-request tree of the prompt and a
      slot in the global tree); every token appended to its output is added to both trees at
      once (add_active_response), so the global tree also holds the running response;
    - a draft is `speculate(pattern)` with pattern = the last max_tree_depth tokens of the
      request, max_spec_tokens = n_draft (a tree's node budget with `use_tree_spec`),
      max_spec_factor, max_spec_offset 0 and min_token_prob; the cache speculates from both
      trees and keeps the draft with the higher score;
    - a finished request's tree is dropped (stop_request); its response stays in the global
      tree (at most max_cached_requests responses, FIFO).

    Defaults are vLLM's (vllm/config/speculative.py): suffix_decoding_max_tree_depth 24,
    max_cached_requests 10000, max_spec_factor 1.0, min_token_prob 0.1 (arctic-inference's own
    plugin defaults differ: depth 64, 100000 requests). vLLM never sets use_tree_spec, so its
    drafts are linear: from the longest-scoring match, the chain of most frequent children
    while the product of their frequencies stays >= min_token_prob. feed() puts a stream in
    the global tree as one earlier request's response.
    """

    name = "suffix"

    def __init__(self, *, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_tree_spec: bool = False,
                 max_spec_tokens: int | None = None, lib_dir: Path | str | None = None) -> None:
        cache_cls = load_suffix_decoding_cache(lib_dir)
        self.cache = cache_cls(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.tree = use_tree_spec
        self.max_spec_tokens = max_spec_tokens  # None: the replay's n_draft
        self._n_requests = 0
        self._request: int | None = None

    def settings(self) -> dict[str, Any]:
        return {"max_tree_depth": self.max_tree_depth, "max_cached_requests": self.max_cached_requests,
                "max_spec_factor": self.max_spec_factor, "max_spec_offset": self.max_spec_offset,
                "min_token_prob": self.min_token_prob, "use_tree_spec": self.tree, "max_spec_tokens": self.max_spec_tokens}

    def _new_request(self, prompt: np.ndarray) -> int:
        req = self._n_requests
        self._n_requests += 1
        self.cache.start_request(req, prompt)
        return req

    def feed(self, stream: np.ndarray) -> None:
        req = self._new_request(np.empty(0, dtype=np.int32))
        self.cache.add_active_response(req, _as_tokens(stream))
        self.cache.stop_request(req)

    def start_chunk(self, prompt: np.ndarray) -> None:
        self._request = self._new_request(_as_tokens(prompt))

    def observe(self, tokens: np.ndarray) -> None:
        assert self._request is not None, "observe() outside a chunk"
        self.cache.add_active_response(self._request, _as_tokens(tokens))

    def end_chunk(self) -> None:
        assert self._request is not None, "end_chunk() outside a chunk"
        self.cache.stop_request(self._request)
        self._request = None

    def _speculate(self, context: TokenSeq, n_draft: int) -> Any:
        if self._request is None:
            raise RuntimeError("SuffixDecodingPeer drafts within a request: call start_chunk() first")
        pattern = _as_tokens(context)[-self.max_tree_depth :]
        return self.cache.speculate(
            self._request, pattern,
            max_spec_tokens=self.max_spec_tokens if self.max_spec_tokens is not None else n_draft,
            max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob, use_tree_spec=self.tree)

    def draft(self, context: TokenSeq, n_draft: int) -> list[int]:
        return list(self._speculate(context, n_draft).token_ids)

    def draft_tree(self, context: TokenSeq, n_draft: int) -> tuple[list[int], list[int]]:
        d = self._speculate(context, n_draft)
        return list(d.token_ids), list(d.parents)


def accepted_linear(draft: Sequence[int], target: np.ndarray) -> int:
    """How many leading draft tokens equal `target`'s (the chunk's next tokens; it ends where the chunk does)."""
    n = 0
    for tok, want in zip(draft, target.tolist()):
        if tok != want:
            break
        n += 1
    return n


def accepted_tree(token_ids: Sequence[int], parents: Sequence[int], target: np.ndarray) -> int:
    """Length of the longest root path of the tree whose tokens are target's first tokens.
    Parents precede their children (parents[i] < i), as SuffixDecoding lists them."""
    node, n = -1, 0
    for want in target.tolist():
        nxt = next((i for i in range(node + 1, len(token_ids)) if parents[i] == node and token_ids[i] == want), -1)
        if nxt < 0:
            break
        node, n = nxt, n + 1
    return n


def replay(method: PeerDrafter, tokens: np.ndarray, n_ctx: int = 4096, n_draft: int = 8,
           corpus_streams: Iterable[np.ndarray] | None = None) -> dict[str, Any]:
    """llama-lookup-stats' replay, as native/src/replay.cc does it, with a peer drafting.

    `tokens` is cut into chunks of n_ctx (a chunk ending at or after the end is skipped). In each
    chunk the output starts as [chunk[0]]; until it holds n_ctx tokens, one step: draft given
    the output (drafted += the draft's size), walk it while each token is the chunk's next one
    (accepted += those), then append the chunk's next token unless the output is full. For a
    tree, accepted is the longest root path matching the chunk. Each chunk is one request of
    the method (start_chunk / observe / end_chunk); corpus_streams are fed to it first.

    tokens_per_step = (n_ctx - 1) * chunks / steps (every token after the first is appended by
    a step); us_per_drafted_token and draft_seconds count the draft calls alone; seconds is the
    whole replay, feed_seconds the corpus feeding before it.
    """
    if n_ctx < 2 or n_draft < 1:
        raise ValueError(f"need n_ctx >= 2 and n_draft >= 1, got {n_ctx}, {n_draft}")
    tokens = _as_tokens(tokens)
    feed_seconds = 0.0
    n_streams = 0
    if corpus_streams is not None:
        t0 = time.perf_counter()
        for stream in corpus_streams:
            method.feed(stream)
            n_streams += 1
        feed_seconds = time.perf_counter() - t0

    clock = time.perf_counter
    steps = drafted = accepted = chunks = 0
    t_draft = 0.0
    t_start = clock()
    start = 0
    while start + n_ctx < len(tokens):
        chunk = tokens[start : start + n_ctx]
        method.start_chunk(chunk[:1])
        length = 1  # the output is always chunk[:length]: only matching tokens are appended
        while length < n_ctx:
            t0 = clock()
            if method.tree:
                ids, parents = method.draft_tree(chunk[:length], n_draft)
                t_draft += clock() - t0
                n_acc = accepted_tree(ids, parents, chunk[length : length + len(ids)])
            else:
                ids = method.draft(chunk[:length], n_draft)
                t_draft += clock() - t0
                n_acc = accepted_linear(ids, chunk[length : length + len(ids)])
            steps += 1
            drafted += len(ids)
            accepted += n_acc
            new_length = min(length + n_acc + 1, n_ctx)
            method.observe(chunk[length:new_length])
            length = new_length
        method.end_chunk()
        chunks += 1
        start += n_ctx
    seconds = clock() - t_start

    generated = (n_ctx - 1) * chunks
    return {
        "method": method.name,
        "settings": method.settings(),
        "n_ctx": n_ctx,
        "n_draft": n_draft,
        "chunks": chunks,
        "corpus_streams": n_streams,
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "accept_pct": 100.0 * accepted / drafted if drafted else 0.0,
        "tokens_per_step": generated / steps if steps else 0.0,
        "seconds": seconds,
        "draft_seconds": t_draft,
        "feed_seconds": feed_seconds,
        "us_per_drafted_token": 1e6 * t_draft / drafted if drafted else 0.0,
    }


def load_streams(path: Path) -> list[np.ndarray]:
    """A token set's streams (one per source file), split at <set>.offsets.npy."""
    tokens = np.load(path)
    offsets = np.load(path.with_name(path.name.removesuffix(".npy") + ".offsets.npy"))
    return [s for s in np.split(tokens, offsets[1:].astype(np.int64)) if len(s)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Replays a token set with one peer drafter and prints the figures as JSON.")
    ap.add_argument("method", choices=["vllm-ngram", "transformers-pld", "suffix"])
    ap.add_argument("--tokens", type=Path, default=ROOT / ".bench-data" / "tokens" / "test.npy",
                    help="replayed tokens, one int32 array (default .bench-data/tokens/test.npy)")
    ap.add_argument("--corpus", type=Path, help="suffix only: feed this set's streams (e.g. .bench-data/tokens/25mb.npy) first")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-draft", type=int, default=8)
    ap.add_argument("--min-n", type=int, default=2, help="vllm-ngram: prompt_lookup_min (default 2)")
    ap.add_argument("--max-n", type=int, default=5, help="vllm-ngram: prompt_lookup_max (default 5)")
    ap.add_argument("--max-ngram", type=int, default=2, help="transformers-pld: max_matching_ngram_size (default 2)")
    ap.add_argument("--factor", type=float, default=1.0, help="suffix: max_spec_factor (default 1.0)")
    ap.add_argument("--min-prob", type=float, default=0.1, help="suffix: min_token_prob (default 0.1)")
    ap.add_argument("--depth", type=int, default=24, help="suffix: max_tree_depth (default 24)")
    ap.add_argument("--tree-budget", type=int, help="suffix: tree drafts (use_tree_spec) of at most this many nodes")
    ap.add_argument("--lib-dir", type=Path, help="suffix: the folder build_suffix_decoding.py printed")
    args = ap.parse_args(argv)

    method: PeerDrafter
    try:
        if args.method == "vllm-ngram":
            method = VllmNgram(args.min_n, args.max_n)
        elif args.method == "transformers-pld":
            method = TransformersPromptLookup(args.max_ngram)
        else:
            method = SuffixDecodingPeer(max_tree_depth=args.depth, max_spec_factor=args.factor,
                                        min_token_prob=args.min_prob, use_tree_spec=args.tree_budget is not None,
                                        max_spec_tokens=args.tree_budget, lib_dir=args.lib_dir)
    except (SuffixDecodingUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.corpus is not None and args.method != "suffix":
        print(f"error: {args.method} keeps no state across requests; --corpus is for suffix", file=sys.stderr)
        return 1
    tokens = np.load(args.tokens)
    streams = load_streams(args.corpus) if args.corpus is not None else None
    r = replay(method, tokens, args.n_ctx, args.n_draft, streams)
    r["tokens"] = str(args.tokens)
    r["corpus"] = str(args.corpus) if args.corpus is not None else None
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
