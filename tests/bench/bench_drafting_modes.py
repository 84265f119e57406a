"""Every drafting method side by side on the same test tokens: ngramcache's two modes and three peers.

Protocol: llama-lookup-stats' replay (native/src/replay.cc; tests/bench/lib/peer_drafters.py does
the same for the peers). The test set (.bench-data/tokens/test.npy, replayed whole) is cut
into chunks of n_ctx = 4096 tokens; in each chunk the output starts as its first token and,
until it holds n_ctx tokens, one step drafts (n_draft = 8; a tree: at most its budget of
nodes), accepts the draft's leading tokens that equal the chunk's next ones (a tree: its
longest matching root path) and appends the model's token. tokens/step = (n_ctx - 1) x chunks
/ steps; accept % = accepted / drafted (a tree's drafted count is all its nodes); µs per drafted
token = drafting time / drafted. Our replays count drafting plus context-table updates, as
llama-lookup-stats does, the median of --repeats runs (tokens/step is deterministic: checked
equal each run); the peers' time is the Python-level time of their draft calls, one run: it is
not comparable with ours. The corpus is .bench-data/tokens/25mb.npy (one stream per source
file, split at 25mb.offsets.npy).

Rows:

- compatible, no static: llama.cpp's n-gram cache drafts (ngram_min 1, ngram_max 4) from the
  context table and the dynamic table (fresh per run, filled chunk after chunk);
- compatible, static 2-gram: the same plus the corpus's 2-gram counts (static format version
  1, `StaticBuilder(..., corpus_index=False)`), llama.cpp's "static corpus";
- match linear, no static / static + index: the match mode's longest-match drafts over the
  sequence and the earlier sequences (history), with the count tables competing; with the
  static file of format version 2 (the same corpus, `corpus_index=True`) also over the
  corpus index;
- match tree 8 / 16: the match mode's tree drafts of at most 8 / 16 nodes, with the index;
- vllm-ngram: vLLM's n-gram proposer (prompt_lookup_min 2, prompt_lookup_max 5; its rule as of
  vLLM PR #22437, read at vllm-project/vllm commit 016e8ed, re-implemented);
- transformers-pld: transformers' prompt lookup (max_matching_ngram_size 2, 8 tokens; the rule
  of 4.38 through 5.24.0, re-implemented);
- suffix: SuffixDecoding, arctic-inference 0.3.0's suffix trees and `SuffixDecodingCache`
  (built by tests/bench/engines/build_suffix_decoding.py), driven as vLLM's "suffix" method drives it,
  vLLM's defaults (max_tree_depth 24, max_spec_factor 1, min_token_prob 0.1); linear drafts:
  not fed (vLLM's setting: only earlier requests), fed (the corpus's streams put in its global
  tree first, as earlier responses), fed with max_spec_factor 4; trees (use_tree_spec, budget
  8 / 16 nodes), fed, max_spec_factor 1 and 4.

The last column is each row's tokens/step over compatible-with-static's. Below the table: the
match mode's linear drafts against the best linear SuffixDecoding setting (by tokens/step, and
the best one whose accept % is at least compatible-with-static's), its trees against
SuffixDecoding's trees of the same budget (the better of its two factors), the two files'
sizes (the corpus structure, sections TEXT + SUFFIXES + BUCKETS, as a multiple of the corpus's
4 bytes a token), their open time (median of 20 opens) and build times.

    python tests/bench/prepare_corpus.py              # once: the data
    python tests/bench/engines/build_suffix_decoding.py       # once: SuffixDecoding for its rows
    python tests/bench/bench_drafting_modes.py --quick    # 8 chunks, 200 corpus streams, no fed SuffixDecoding (< 1 min)
    python tests/bench/bench_drafting_modes.py [--json PATH] [--repeats 3] [--no-peers]

A fed SuffixDecoding run takes about 25 s and 2.3 GB of RSS (one at a time; freed after it);
the full run takes 5 to 8 minutes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
N_CTX = 4096
N_DRAFT = 8
NGRAM_MIN, NGRAM_MAX = 1, 4  # llama-lookup-stats' defaults
CORPUS = "25mb"
SUFFIX_SDIST = "arctic_inference-0.3.0"  # the folder build_suffix_decoding.py builds into
QUICK_CHUNKS = 8
QUICK_STREAMS = 200
N_OPENS = 20
CORPUS_SECTIONS = ("TEXT", "SUFFIXES", "BUCKETS")
BASELINE = "compatible static 2-gram"


class BenchError(Exception):
    """A one-line error for the user (no traceback)."""


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_peer_drafters() -> Any:
    spec = importlib.util.spec_from_file_location("peer_drafters", Path(__file__).parent / "lib" / "peer_drafters.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_data(data_dir: Path, quick: bool) -> tuple[np.ndarray, list[np.ndarray], dict[str, Any]]:
    files = [data_dir / "manifest.json", data_dir / "tokens" / "test.npy",
             data_dir / "tokens" / f"{CORPUS}.npy", data_dir / "tokens" / f"{CORPUS}.offsets.npy"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise BenchError(f"no benchmark data ({missing[0]} is missing): run `python tests/bench/prepare_corpus.py` first"
                         + ("" if data_dir == ROOT / ".bench-data" else f" (with --data-dir {data_dir})"))
    manifest = json.loads((data_dir / "manifest.json").read_text())
    test = np.ascontiguousarray(np.load(files[1]), dtype=np.int32)
    corpus = np.ascontiguousarray(np.load(files[2]), dtype=np.int32)
    offsets = np.load(files[3]).astype(np.int64)
    streams = [s for s in np.split(corpus, offsets[1:]) if len(s)]
    if quick:
        test = test[: QUICK_CHUNKS * N_CTX + 1]
        streams = streams[:QUICK_STREAMS]
    return test, streams, manifest


def build_static(core: Any, path: Path, streams: list[np.ndarray], tok: dict[str, Any], corpus_index: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    b = core.StaticBuilder(str(path), int(tok["vocab_size"]), 2, fingerprint=bytes.fromhex(tok["fingerprint"]),
                           corpus_index=corpus_index)
    for s in streams:
        b.begin_stream()
        b.add_tokens(s)
    b.finish()
    seconds = time.perf_counter() - t0
    cache = core.StaticCache.open(str(path))
    core.StaticCache.open(str(path))  # warm
    opens = []
    for _ in range(N_OPENS):
        t1 = time.perf_counter_ns()
        core.StaticCache.open(str(path))
        opens.append(time.perf_counter_ns() - t1)
    sections = {s["name"]: int(s["length"]) for s in cache.sections}
    return {"path": str(path), "build_seconds": seconds, "file_size": int(cache.file_size),
            "format_version": int(cache.format_version), "n_indexed": int(cache.n_indexed),
            "sections": sections, "open_us_median": statistics.median(opens) / 1e3, "stats": dict(b.stats)}


def our_row(core: Any, name: str, setting: str, tokens: np.ndarray, static: Any, mode: str, tree_budget: int,
            repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        r = core.replay(tokens, N_CTX, N_DRAFT, NGRAM_MIN, NGRAM_MAX, static, core.CountTable(), mode=mode,
                        tree_budget=tree_budget)
        runs.append(r)
        key = tuple(r[k] for k in ("n_chunks", "n_draft_calls", "n_drafted", "n_accept"))
        first = tuple(runs[0][k] for k in ("n_chunks", "n_draft_calls", "n_drafted", "n_accept"))
        if key != first:
            raise BenchError(f"{name} {setting}: the replay is not deterministic ({first} then {key})")
    r = runs[0]
    drafted = r["n_drafted"]
    t_ns = statistics.median(x["t_draft_ns"] for x in runs)
    t_only_ns = statistics.median(x["t_draft_only_ns"] for x in runs)
    return {"method": name, "setting": setting, "ours": True, "chunks": r["n_chunks"], "steps": r["n_draft_calls"],
            "drafted": drafted, "accepted": r["n_accept"],
            "tokens_per_step": r["n_chunks"] * (N_CTX - 1) / r["n_draft_calls"] if r["n_draft_calls"] else 0.0,
            "accept_pct": 100.0 * r["n_accept"] / drafted if drafted else 0.0,
            "us_per_drafted_token": t_ns / 1e3 / drafted if drafted else 0.0,
            "us_per_drafted_token_draft_only": t_only_ns / 1e3 / drafted if drafted else 0.0,
            "us_per_drafted_token_runs": [x["t_draft_ns"] / 1e3 / drafted if drafted else 0.0 for x in runs],
            "repeats": repeats, "mode": mode, "tree_budget": tree_budget}


def peer_row(pd: Any, name: str, setting: str, make: Any, tokens: np.ndarray, streams: list[np.ndarray] | None,
             repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        method = make()
        runs.append(pd.replay(method, tokens, N_CTX, N_DRAFT, streams))
        del method
        gc.collect()
        if runs[-1]["steps"] != runs[0]["steps"] or runs[-1]["accepted"] != runs[0]["accepted"]:
            raise BenchError(f"{name} {setting}: the replay is not deterministic")
    r = dict(runs[0])
    r["us_per_drafted_token"] = statistics.median(x["us_per_drafted_token"] for x in runs)
    r["us_per_drafted_token_runs"] = [x["us_per_drafted_token"] for x in runs]
    r.update({"method": name, "setting": setting, "ours": False, "peer": runs[0]["method"], "repeats": repeats})
    return r


def fmt_table(rows: list[dict[str, Any]], base_tps: float | None) -> str:
    head = ["method", "setting", "steps", "tokens/step", "accept %", "µs/drafted tok", "× compat+static"]
    body = []
    for r in rows:
        ratio = f"{r['tokens_per_step'] / base_tps:.2f}" if base_tps else "n/a"
        us = f"{r['us_per_drafted_token']:.3f}" + ("" if r["ours"] else " *")
        body.append([r["method"], r["setting"], f"{r['steps']:,}", f"{r['tokens_per_step']:.3f}",
                     f"{r['accept_pct']:.1f}", us, ratio])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 6}

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compares ngramcache's drafting modes and peer drafters on the same "
                                 "test tokens (llama-lookup-stats' replay, n_ctx 4096, n_draft 8); prints one table.")
    ap.add_argument("--quick", action="store_true",
                    help=f"first {QUICK_CHUNKS} chunks of the test set, first {QUICK_STREAMS} corpus streams, "
                    "no fed SuffixDecoding (checks the script in under a minute)")
    ap.add_argument("--no-peers", action="store_true", help="only ngramcache's rows")
    ap.add_argument("--data-dir", type=Path, default=ROOT / ".bench-data",
                    help="what prepare_corpus.py made (default .bench-data)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each of our replays; timing is their median (default 3)")
    ap.add_argument("--peer-repeats", type=int, default=1, help="runs of each peer replay (default 1)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.peer_repeats < 1:
        print("error: --repeats and --peer-repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        return run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    from ngramcache.client import _core as core

    t_start = time.perf_counter()
    test, streams, manifest = load_data(args.data_dir, args.quick)
    tok = manifest["tokenizer"]
    n_corpus = int(sum(len(s) for s in streams))
    progress(f"test: {len(test):,} tokens; corpus {CORPUS}: {len(streams):,} streams, {n_corpus:,} tokens"
             + (" (--quick)" if args.quick else ""))

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench_modes_") as tmp:
        progress("building the plain static file (version 1: 2-gram counts)...")
        plain = build_static(core, Path(tmp) / "plain.ngc", streams, tok, corpus_index=False)
        progress(f"  {plain['file_size'] / 1e6:.1f} MB in {plain['build_seconds']:.1f} s")
        progress("building the indexed static file (version 2: counts + corpus index)...")
        indexed = build_static(core, Path(tmp) / "indexed.ngc", streams, tok, corpus_index=True)
        progress(f"  {indexed['file_size'] / 1e6:.1f} MB in {indexed['build_seconds']:.1f} s")
        if indexed["n_indexed"] != n_corpus:
            notes.append(f"the index holds {indexed['n_indexed']:,} of the corpus's {n_corpus:,} tokens (build budget)")
        plain_cache = core.StaticCache.open(plain["path"])
        indexed_cache = core.StaticCache.open(indexed["path"])

        ours = [
            ("compatible", "no static", None, "compatible", 0),
            ("compatible", "static 2-gram", plain_cache, "compatible", 0),
            ("match linear", "no static", None, "match", 0),
            ("match linear", "static + index", indexed_cache, "match", 0),
            ("match tree 8", "static + index", indexed_cache, "match", 8),
            ("match tree 16", "static + index", indexed_cache, "match", 16),
        ]
        for i, (name, setting, static, mode, budget) in enumerate(ours, 1):
            t0 = time.perf_counter()
            rows.append(our_row(core, name, setting, test, static, mode, budget, args.repeats))
            progress(f"[ours {i}/{len(ours)}] {name}, {setting}: {rows[-1]['tokens_per_step']:.3f} tokens/step "
                     f"({args.repeats} runs, {time.perf_counter() - t0:.1f} s)")
        del plain_cache, indexed_cache

    if not args.no_peers:
        rows += run_peers(args, test, streams, notes)

    base = next((r for r in rows if f"{r['method']} {r['setting']}" == BASELINE), None)
    base_tps = base["tokens_per_step"] if base else None
    for r in rows:
        r["ratio_to_compatible_static"] = r["tokens_per_step"] / base_tps if base_tps else None

    summary = summarize(rows, plain, indexed, n_corpus, base)
    wall = time.perf_counter() - t_start
    print(f"Drafting modes: llama-lookup-stats replay, n_ctx {N_CTX}, n_draft {N_DRAFT}; test {len(test):,} tokens "
          f"({rows[0]['chunks']} chunks); corpus {CORPUS}, {len(streams):,} streams, {n_corpus:,} tokens"
          + (" [--quick]" if args.quick else ""))
    print()
    print(fmt_table(rows, base_tps))
    print()
    print(f"µs/drafted tok: ours = native drafting + context updates (llama-lookup-stats' count), median of {args.repeats} runs; "
          f"* peers = Python-level time in their draft calls, {args.peer_repeats} run(s): not comparable with ours.")
    print("Trees: drafted = all nodes of each tree, so their accept % is not comparable with linear rows.")
    for line in summary["lines"]:
        print(line)
    for n in notes:
        print(f"Note: {n}")
    print(f"Wall time: {wall:.0f} s")

    if args.json is not None:
        out = {"protocol": {"n_ctx": N_CTX, "n_draft": N_DRAFT, "ngram_min": NGRAM_MIN, "ngram_max": NGRAM_MAX,
                            "test_tokens": len(test), "corpus": CORPUS, "corpus_streams": len(streams),
                            "corpus_tokens": n_corpus, "quick": args.quick, "repeats": args.repeats,
                            "peer_repeats": args.peer_repeats, "tokenizer": tok.get("spec")},
               "rows": rows, "files": {"plain": plain, "indexed": indexed},
               "summary": {k: v for k, v in summary.items() if k != "lines"}, "notes": notes, "wall_seconds": wall}
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0


def run_peers(args: argparse.Namespace, test: np.ndarray, streams: list[np.ndarray], notes: list[str]) -> list[dict[str, Any]]:
    pd = load_peer_drafters()
    lib = args.data_dir / "peers" / SUFFIX_SDIST
    plans: list[tuple[str, str, Any, bool]] = [
        ("vllm-ngram", "min 2, max 5", lambda: pd.VllmNgram(2, 5), False),
        ("transformers-pld", "2-gram, 8 tokens", lambda: pd.TransformersPromptLookup(2), False),
    ]

    def suffix(factor: float, budget: int | None) -> Any:
        return lambda: pd.SuffixDecodingPeer(max_spec_factor=factor, use_tree_spec=budget is not None,
                                             max_spec_tokens=budget, lib_dir=lib)

    build = "python tests/bench/engines/build_suffix_decoding.py" + (
        "" if args.data_dir == ROOT / ".bench-data" else f" --dest {args.data_dir / 'peers'}")
    try:
        pd.load_suffix_decoding_cache(lib)
        have_suffix = True
    except pd.SuffixDecodingUnavailable:
        have_suffix = False
        notes.append(f"SuffixDecoding rows skipped: it is not built in {lib}; run `{build}` first")
        progress(f"error: SuffixDecoding is not built in {lib}: run `{build}` first; skipping its rows")
    if have_suffix:
        plans.append(("suffix linear", "vLLM defaults, not fed", suffix(1.0, None), False))
        fed = [("suffix linear", "fed", suffix(1.0, None), True),
               ("suffix linear", "fed, factor 4", suffix(4.0, None), True),
               ("suffix tree 8", "fed, factor 1", suffix(1.0, 8), True),
               ("suffix tree 8", "fed, factor 4", suffix(4.0, 8), True),
               ("suffix tree 16", "fed, factor 1", suffix(1.0, 16), True),
               ("suffix tree 16", "fed, factor 4", suffix(4.0, 16), True)]
        if args.quick:
            notes.append("--quick: fed SuffixDecoding rows skipped")
        else:
            plans += fed

    rows = []
    for i, (name, setting, make, feed) in enumerate(plans, 1):
        t0 = time.perf_counter()
        rows.append(peer_row(pd, name, setting, make, test, streams if feed else None, args.peer_repeats))
        gc.collect()
        progress(f"[peer {i}/{len(plans)}] {name}, {setting}: {rows[-1]['tokens_per_step']:.3f} tokens/step "
                 f"({time.perf_counter() - t0:.1f} s)")
    return rows


def summarize(rows: list[dict[str, Any]], plain: dict[str, Any], indexed: dict[str, Any], n_corpus: int,
              base: dict[str, Any] | None) -> dict[str, Any]:
    def find(method: str, setting: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["method"] == method and r["setting"] == setting), None)

    def label(r: dict[str, Any]) -> str:
        return f"{r['method']} ({r['setting']}, {r['tokens_per_step']:.3f} tokens/step, {r['accept_pct']:.1f} % accepted)"

    lines: list[str] = []
    out: dict[str, Any] = {}
    match_lin = find("match linear", "static + index")
    suffix_lin = [r for r in rows if r["method"] == "suffix linear"]
    if match_lin and suffix_lin:
        best = max(suffix_lin, key=lambda r: r["tokens_per_step"])
        out["match_linear_vs_best_suffix_linear"] = match_lin["tokens_per_step"] / best["tokens_per_step"]
        lines.append(f"Match linear (static + index) / best SuffixDecoding linear by tokens/step: "
                     f"{out['match_linear_vs_best_suffix_linear']:.2f}x; best: {label(best)}")
        if base is not None:
            floor = base["accept_pct"]
            ok = [r for r in suffix_lin if r["accept_pct"] >= floor]
            if ok:
                b2 = max(ok, key=lambda r: r["tokens_per_step"])
                out["match_linear_vs_best_suffix_linear_accept_floor"] = match_lin["tokens_per_step"] / b2["tokens_per_step"]
                lines.append(f"Match linear / best SuffixDecoding linear with accept % >= compatible static's "
                             f"({floor:.1f} %): {out['match_linear_vs_best_suffix_linear_accept_floor']:.2f}x; best: {label(b2)}")
            else:
                out["match_linear_vs_best_suffix_linear_accept_floor"] = None
                lines.append(f"Match linear / best SuffixDecoding linear with accept % >= compatible static's "
                             f"({floor:.1f} %): n/a, no linear SuffixDecoding setting reaches it")
    elif match_lin:
        lines.append("Match linear / SuffixDecoding linear: n/a (no SuffixDecoding rows)")
    for budget in (8, 16):
        ours = find(f"match tree {budget}", "static + index")
        theirs = [r for r in rows if r["method"] == f"suffix tree {budget}"]
        key = f"match_tree{budget}_vs_suffix_tree{budget}"
        if ours and theirs:
            best = max(theirs, key=lambda r: r["tokens_per_step"])
            out[key] = ours["tokens_per_step"] / best["tokens_per_step"]
            lines.append(f"Match tree {budget} / SuffixDecoding tree {budget} (better factor): {out[key]:.2f}x; "
                         f"{ours['tokens_per_step']:.3f} vs {label(best)}")
        elif ours:
            out[key] = None
            lines.append(f"Match tree {budget} / SuffixDecoding tree {budget}: n/a (no SuffixDecoding tree rows)")

    token_bytes = 4 * n_corpus
    corpus_bytes = sum(indexed["sections"].get(s, 0) for s in CORPUS_SECTIONS)
    out.update({"plain_file_bytes": plain["file_size"], "indexed_file_bytes": indexed["file_size"],
                "corpus_structure_bytes": corpus_bytes, "corpus_token_bytes": token_bytes,
                "corpus_structure_multiple": corpus_bytes / token_bytes if token_bytes else None,
                "open_us_plain": plain["open_us_median"], "open_us_indexed": indexed["open_us_median"],
                "build_seconds_plain": plain["build_seconds"], "build_seconds_indexed": indexed["build_seconds"]})
    lines.append(f"File sizes: plain (v1, 2-gram counts) {plain['file_size'] / 1e6:.1f} MB; indexed (v2) "
                 f"{indexed['file_size'] / 1e6:.1f} MB; corpus structure (TEXT+SUFFIXES+BUCKETS) {corpus_bytes / 1e6:.1f} MB "
                 f"= {out['corpus_structure_multiple']:.2f}x the corpus's token bytes (4 x {n_corpus:,} = {token_bytes / 1e6:.1f} MB)")
    lines.append(f"Open time (median of {N_OPENS} opens): plain {plain['open_us_median']:.1f} µs; "
                 f"indexed {indexed['open_us_median']:.1f} µs")
    lines.append(f"Build time (all cores): plain {plain['build_seconds']:.2f} s; indexed {indexed['build_seconds']:.2f} s")
    out["lines"] = lines
    return out


if __name__ == "__main__":
    sys.exit(main())
