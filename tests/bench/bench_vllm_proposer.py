"""What finding requests by their tokens costs the vLLM proposer: `NgramCacheProposer.propose` against an oracle that knows the request ids, on one simulated batch.

No vLLM and no model: a persistent batch laid out as vLLM 0.33.0's (int32 ``token_ids_cpu``
[max_num_reqs, max_model_len], ``num_tokens_no_spec``) serves requests that copy a CPython
standard library module (prompt: its first ``--prompt`` tokens; answer: the next
``--new-tokens``, a stand-in for a code-editing model that mostly repeats its input). Each step
a row keeps the drafted tokens that equal its answer and one more, as greedy verification would;
finished requests leave, the batch is compacted as vLLM does, and waiting requests take the free
rows. Both proposers see the same batches and draft with a context-only `Drafter`:

- (a) `NgramCacheProposer`, which finds each row's sequence from its tokens (`BatchRows`);
- (b) the oracle: a sequence per request id, `accept` and one `draft_batch` per step, nothing else;
- (c) with ``--speculator`` (needs torch): vLLM 0.34's `NgramCacheSpeculator`, built and called
  through the stand-in of 0.34.0's interface (tests/helpers/vllm_stand_in.py) on CPU tensors: a
  sequence per request id, the new tokens of each row gathered from the token table, fixed-width
  rows (drafts, then fillers).

Their drafts must be equal (the checksum line; (c)'s rows against (b)'s padded as vLLM 0.34 pads
them). The figure is the median time of one ``propose`` call per step, and (a)/(b), (c)/(b).

    python tests/bench/bench_vllm_proposer.py            # 128 requests, 64 rows, 1,024-token prompts
    python tests/bench/bench_vllm_proposer.py --quick
    python tests/bench/bench_vllm_proposer.py --speculator
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ngramcache import UNTAGGED, Drafter
from ngramcache.client.adapters.vllm import NgramCacheProposer, ProposerConfig
from ngramcache.client.kernel.tokenizer import load_tokenizer


def module_tokens(n_needed: int, count: int) -> list[np.ndarray]:
    tok = load_tokenizer("tiktoken:qwen")
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.glob("*.py")):
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= n_needed:
            out.append(ids[:n_needed].astype(np.int32))
        if len(out) == count:
            break
    return out


class Oracle:
    """The least a proposer must do: count what is new in each request, draft the batch in one call."""

    def __init__(self, vocab: int, n_draft: int) -> None:
        self.drafter = Drafter(fingerprint=UNTAGGED, vocab_size=vocab)
        self.n_draft = n_draft

    def propose(self, req_seq: list[int], sampled, num_tokens, token_ids) -> list[list[int]]:
        seqs, toks = [], []
        for i, s in enumerate(sampled):
            if s:
                t = token_ids[i, : num_tokens[i]]
                self.drafter.accept(req_seq[i], t)
                seqs.append(req_seq[i])
                toks.append(t)
        drafts, lengths = self.drafter.draft_batch(seqs, toks, self.n_draft)
        out: list[list[int]] = [[] for _ in sampled]
        k = 0
        for i, s in enumerate(sampled):
            if s:
                out[i] = drafts[k, : lengths[k]].tolist()
                k += 1
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rows", type=int, default=64, help="max_num_seqs: rows of the batch")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--n-draft", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="32 requests, 8 rows, 256-token prompts")
    ap.add_argument("--speculator", action="store_true", help="also (c): vLLM 0.34's NgramCacheSpeculator (needs torch)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rows, args.prompt = 32, 8, 256
    docs = module_tokens(args.prompt + args.new_tokens, args.requests)
    if len(docs) < args.requests:
        raise SystemExit(f"only {len(docs)} standard library modules have {args.prompt + args.new_tokens} tokens")
    vocab = 1 + int(max(d.max() for d in docs))
    max_len = args.prompt + args.new_tokens + args.n_draft + 1
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=args.n_draft),
                             model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: vocab),
                             scheduler_config=SimpleNamespace(max_num_seqs=args.rows))
    # The compatible mode: each row's drafts depend on its own tokens only, so all three must draft alike.
    proposer = NgramCacheProposer(config, ProposerConfig(mode="compatible"))
    oracle = Oracle(vocab, args.n_draft)
    runner, times_c = (speculator_runner(vocab, args.rows, max_len, args.n_draft), []) if args.speculator else (None, [])
    checksum_c = checksum_b_padded = 0
    token_ids = np.zeros((args.rows, max_len), dtype=np.int32)
    num_tokens = np.zeros(args.rows, dtype=np.int32)
    batch: list[int] = []  # request index per row
    waiting = list(range(args.requests))
    drafts: dict[int, list[int]] = {}
    times_a: list[float] = []
    times_b: list[float] = []
    checksum_a = checksum_b = 0
    steps = drafted = accepted = 0
    while waiting or batch:
        while waiting and len(batch) < args.rows:
            r = waiting.pop(0)
            row = len(batch)
            batch.append(r)
            token_ids[row, : args.prompt] = docs[r][: args.prompt]
            num_tokens[row] = args.prompt
            drafts[r] = []
        sampled = []
        for row, r in enumerate(batch):
            n = int(num_tokens[row])
            truth = docs[r][n:]
            d = drafts[r]
            keep = 0
            while keep < len(d) and keep < len(truth) - 1 and d[keep] == truth[keep]:
                keep += 1
            new = truth[: keep + 1].tolist()
            accepted += keep
            token_ids[row, n: n + len(new)] = new
            num_tokens[row] = n + len(new)
            sampled.append(new)
        t0 = time.perf_counter()
        out_a = proposer.propose(sampled, num_tokens, token_ids, slot_mappings=None)
        t1 = time.perf_counter()
        out_b = oracle.propose(batch, sampled, num_tokens, token_ids)
        t2 = time.perf_counter()
        if steps > 0:  # the first step is the warm-up
            times_a.append(t1 - t0)
            times_b.append(t2 - t1)
        if runner is not None:
            for r in batch:
                if str(r) not in runner.req_states.req_id_to_index:
                    runner.add_request(str(r), docs[r][: args.prompt].tolist())
            out_c = runner.step({str(r): new for r, new in zip(batch, sampled)}, [str(r) for r in batch])
            if steps > 0:
                times_c.append(runner.speculator.calls[-1])
            for row, r in enumerate(batch):
                last = int(token_ids[row, num_tokens[row] - 1])
                want = out_b[row] + [last] * (args.n_draft - len(out_b[row]))
                checksum_b_padded = zlib.crc32(np.asarray(want, dtype=np.int64).tobytes(), checksum_b_padded)
                checksum_c = zlib.crc32(np.asarray(out_c[str(r)], dtype=np.int64).tobytes(), checksum_c)
        steps += 1
        for row, r in enumerate(batch):
            drafts[r] = out_a[row]
            drafted += len(out_a[row])
            checksum_a = zlib.crc32(np.asarray(out_a[row], dtype=np.int32).tobytes(), checksum_a)
            checksum_b = zlib.crc32(np.asarray(out_b[row], dtype=np.int32).tobytes(), checksum_b)
        # Finished requests leave; the batch is compacted (the last rows move into the holes).
        done = [row for row, r in enumerate(batch) if num_tokens[row] >= args.prompt + args.new_tokens]
        if runner is not None and done:
            runner.finish_requests({str(batch[row]) for row in done})
        for row in sorted(done, reverse=True):
            last = len(batch) - 1
            if row != last:
                token_ids[row] = token_ids[last]
                num_tokens[row] = num_tokens[last]
                batch[row] = batch[last]
            batch.pop()
    med_a, med_b = statistics.median(times_a) * 1e6, statistics.median(times_b) * 1e6
    print(f"{args.requests} requests, {args.rows} rows, prompts {args.prompt} tokens, {args.new_tokens} new each; "
          f"{steps} steps, drafted {drafted:,}, accepted {accepted:,} ({accepted / max(drafted, 1):.0%})")
    print(f"(a) NgramCacheProposer.propose  median {med_a:8.1f} us/step  ({med_a / args.rows:.1f} us/row)")
    print(f"(b) oracle (request ids known)  median {med_b:8.1f} us/step  ({med_b / args.rows:.1f} us/row)")
    print(f"(a)/(b) = {med_a / med_b:.2f}; rows: started {proposer.rows.started}, taken over "
          f"{proposer.rows.taken_over}, freed {proposer.rows.freed}")
    print(f"checksum (a) {checksum_a:08x}  (b) {checksum_b:08x}  {'equal' if checksum_a == checksum_b else 'DIFFER'}")
    same_c = True
    if runner is not None:
        med_c = statistics.median(times_c) * 1e6
        same_c = checksum_c == checksum_b_padded
        print(f"(c) NgramCacheSpeculator.propose median {med_c:8.1f} us/step  ({med_c / args.rows:.1f} us/row); "
              f"(c)/(b) = {med_c / med_b:.2f}")
        print(f"checksum (c) {checksum_c:08x}  (b) padded {checksum_b_padded:08x}  {'equal' if same_c else 'DIFFER'}")
    if checksum_a != checksum_b or not same_c:
        raise SystemExit(1)


def speculator_runner(vocab: int, rows: int, max_len: int, n_draft: int) -> Any:
    """vLLM 0.34's model runner (the stand-in, CPU tensors) over `NgramCacheSpeculator`, its propose calls timed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
    from helpers import vllm_stand_in

    sys.modules.update(vllm_stand_in.install())
    from ngramcache.client.adapters import vllm as adapter

    adapter.register()
    model = SimpleNamespace(max_model_len=max_len, tokenizer=None, get_vocab_size=lambda: vocab)
    parallel = SimpleNamespace(tensor_parallel_size=1)
    spec = vllm_stand_in.speculative_config(model, parallel, method=adapter.METHOD, num_speculative_tokens=n_draft,
                                           speculator_options={"mode": "compatible"})
    config = SimpleNamespace(speculative_config=spec, model_config=model, parallel_config=parallel,
                             scheduler_config=SimpleNamespace(max_num_seqs=rows))
    runner = vllm_stand_in.ModelRunner(config)
    speculator = runner.speculator
    propose = speculator.propose
    speculator.calls = []

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = propose(*a, **kw)
        speculator.calls.append(time.perf_counter() - t0)
        return out

    speculator.propose = timed
    return runner


if __name__ == "__main__":
    main()
