// Drafter: the core's drafter over a StaticCache and a CountTable attached from Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "ngc/draft_params.h"
#include "ngc/sequences.h"

namespace ngc::py {

using namespace nb::literals;

namespace {

void set_static(PyDrafter& d, nb::object cache) {
  PyStaticCache* sc = as_static_cache(cache, "static");
  check(d.drafter->set_static(sc ? sc->cache : nullptr));
  d.static_ref = cache;
}

void set_dynamic(PyDrafter& d, nb::object table) {
  PyCountTable* t = as_count_table(table, "dynamic");
  d.drafter->set_dynamic(t ? t->shared : nullptr);
  d.dynamic_ref = table;
}

// draft_tree() with the GIL released; raises the core's error.
DraftTree run_draft_tree(PyDrafter& d, int64_t seq, nb::handle tokens, int budget) {
  TokenView v = as_tokens(tokens, "tokens");
  DraftTree tree;
  Status s;
  {
    nb::gil_scoped_release release;
    s = d.drafter->draft_tree(seq, v.data, v.size, budget, &tree);
  }
  check(s);
  return tree;
}

}  // namespace

// Tests and benchmarks tune with the overrides; users keep the defaults.
MatchParams match_params_from(nb::handle overrides) {
  MatchParams p;
  if (overrides.is_none()) return p;
  if (!nb::isinstance<nb::dict>(overrides))
    raise_status(Status::InvalidArgument("match_params must be a dict or None"));
  for (auto [k, v] : nb::borrow<nb::dict>(overrides)) check(p.set(nb::cast<std::string>(k), nb::cast<double>(v)));
  return p;
}

void bind_drafter(nb::module_& m) {
  nb::class_<PyDrafter>(m, "Drafter",
                        "llama.cpp-compatible n-gram drafter over per-sequence context tables, an optional\n"
                        "dynamic CountTable and an optional StaticCache, bound to one tokenizer. Drafting never\n"
                        "touches the network.\n"
                        "Thread-safe: drafts and accepts for different sequences run in parallel from several\n"
                        "threads (the GIL is released); calls for one sequence are serialized.")
      .def(
          "__init__",
          [](PyDrafter* d, nb::object static_cache, nb::object dynamic, std::optional<nb::bytes> fingerprint,
             std::optional<int64_t> vocab_size, int ngram_min, int ngram_max, bool track_deltas, int64_t max_sequences,
             double idle_ttl, int64_t max_memory, const std::string& mode, nb::object match_params,
             bool track_history) {
            PyStaticCache* sc = as_static_cache(static_cache, "static");
            as_count_table(dynamic, "dynamic");  // a TypeError before anything else is built
            DrafterOptions o;
            check(parse_draft_mode(mode, &o.mode));
            o.ngram_min = ngram_min;
            o.ngram_max = ngram_max;
            o.match = match_params_from(match_params);
            o.match.ngram_min = ngram_min;
            o.match.ngram_max = ngram_max;
            o.track_deltas = track_deltas;
            o.track_history = track_history;
            check(SequenceLimits::from(max_sequences, idle_ttl, max_memory, &o.limits));
            check(o.bind_tokenizer(sc ? &sc->cache->info() : nullptr, vocab_size ? &*vocab_size : nullptr,
                                   fingerprint ? bytes_data(*fingerprint) : nullptr,
                                   fingerprint ? fingerprint->size() : 0));
            check(o.validate());
            new (d) PyDrafter{std::make_unique<Drafter>(o)};
            set_static(*d, static_cache);
            if (!dynamic.is_none()) set_dynamic(*d, dynamic);
          },
          nb::sig(
              "def __init__(self, static: StaticCache | None = None, dynamic: CountTable | None = None, *, "
              "fingerprint: bytes | None = None, vocab_size: int | None = None, ngram_min: int = 1, ngram_max: int = 4, "
              "track_deltas: bool = False, max_sequences: int = 0, idle_ttl: float = 0.0, max_memory: int = 0, "
              "mode: str = 'compatible', match_params: dict[str, float] | None = None, track_history: bool = False) -> None"),
          "static"_a = nb::none(), "dynamic"_a = nb::none(), nb::kw_only(), "fingerprint"_a = nb::none(),
          "vocab_size"_a = nb::none(), "ngram_min"_a = 1, "ngram_max"_a = 4, "track_deltas"_a = false,
          "max_sequences"_a = 0, "idle_ttl"_a = 0.0, "max_memory"_a = 0, "mode"_a = "compatible",
          "match_params"_a = nb::none(), "track_history"_a = false,
          "Args:\n    static: a StaticCache, or None.\n    dynamic: a CountTable (the dynamic table), or None.\n"
          "    fingerprint: the tokenizer's fingerprint (32 bytes; UNTAGGED for raw tokens); taken from\n"
          "        `static` when omitted, and checked against it when given.\n"
          "    vocab_size: token ids must be below it; taken from `static` when omitted.\n"
          "    ngram_min, ngram_max: the context/dynamic n-gram sizes tried (llama.cpp: 1 and 4).\n"
          "    track_deltas: keep the counts accepted since the last drain_deltas().\n"
          "    max_sequences: most sequences kept (0: unlimited); beyond, the least recently used is evicted.\n"
          "    idle_ttl: seconds after which an unused sequence is evicted by evict_idle() (0: never).\n"
          "    max_memory: most bytes of context tables (0: unlimited); beyond, least recently used go.\n"
          "    mode: 'compatible' (llama.cpp's drafts, token for token) or 'match' (longest matches over\n"
          "        the sequence, earlier sequences and the static file's corpus index, with the count\n"
          "        tables competing; more accepted tokens per step, and draft_tree()).\n"
          "    match_params: overrides of the match mode's tuning (MATCH_DEFAULTS); rarely needed.\n"
          "    track_history: keep what accept() adds to each sequence for drain_history() (the\n"
          "        tokens a client publishes to the fleet history).\n\n"
          "Raises:\n    TokenizerMismatchError: `fingerprint` or `vocab_size` differs from the static cache's.")
      .def(
          "draft",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int n_draft) {
            check(check_n_draft(n_draft));  // before sizing the output by it
            TokenView v = as_tokens(tokens, "tokens");
            std::vector<int32_t> out(static_cast<size_t>(n_draft));
            int n = 0;
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->draft(seq, v.data, v.size, n_draft, out.data(), &n);
            }
            check(s);
            out.resize(static_cast<size_t>(n));
            return to_numpy(std::move(out), {static_cast<size_t>(n)});
          },
          nb::sig("def draft(self, seq: int, tokens: NDArray[numpy.int32], n_draft: int = 8) -> NDArray[numpy.int32]"),
          "seq"_a, "tokens"_a, "n_draft"_a = 8,
          "Drafts up to `n_draft` tokens to follow `tokens` (the whole sequence so far, int32) of\n"
          "sequence `seq`. Returns an int32 array, empty when nothing passes the thresholds.")
      .def(
          "draft_scored",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int n_draft, bool uncapped) {
            check(check_n_draft(n_draft));  // before sizing the outputs by it
            TokenView v = as_tokens(tokens, "tokens");
            std::vector<int32_t> out(static_cast<size_t>(n_draft));
            std::vector<float> odds(static_cast<size_t>(n_draft));
            int n = 0;
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->draft(seq, v.data, v.size, n_draft, out.data(), &n, odds.data(), uncapped);
            }
            check(s);
            out.resize(static_cast<size_t>(n));
            odds.resize(static_cast<size_t>(n));
            const size_t m = static_cast<size_t>(n);
            return nb::make_tuple(to_numpy(std::move(out), {m}), to_numpy(std::move(odds), {m}));
          },
          nb::sig(
              "def draft_scored(self, seq: int, tokens: NDArray[numpy.int32], n_draft: int = 8, uncapped: bool = False) -> "
              "tuple[NDArray[numpy.int32], NDArray[numpy.float32]]"),
          "seq"_a, "tokens"_a, "n_draft"_a = 8, "uncapped"_a = false,
          "draft() with each drafted token's odds: (tokens, odds), odds[i] (float32, 0..1) the\n"
          "estimated chance that tokens[i] is accepted given tokens[:i] were. Compatible mode: the\n"
          "chosen follower's count / (total + 1) at the n-gram that decided (the tokens are\n"
          "draft()'s, token for token). Match mode: its share of the agreeing occurrences, shrunk\n"
          "by the match length (or of the counts). Deterministic. uncapped (match mode): the draft\n"
          "is cut neither by the match length (length_factor) nor by its probability (min_prob), so\n"
          "it runs to n_draft where the match goes on: for a caller that cuts it by the odds and its\n"
          "verify costs (the adapters' n_draft=\"auto\"). Since which text such a long draft copies\n"
          "decides, it also looks further back (max_chain >= 64), counts an occurrence in the\n"
          "sequence itself as 4 of other sequences' (sequence_weight >= 4), and a draft copied from\n"
          "other sequences gives way where the sequence's own text has a match of 4 tokens or more\n"
          "that goes on differently (splice_min 4); where nothing matches 4 tokens or more (new text,\n"
          "as an edit writes), it resumes the text the sequence was copying, a little past where it\n"
          "left off (resync_below 4), and where its first token is less likely than not after a token\n"
          "that replaced one of the copied text, it copies what follows the replaced token.")
      .def(
          "draft_tree",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int budget) {
            DraftTree tree = run_draft_tree(d, seq, tokens, budget);
            const size_t n = tree.tokens.size();
            return nb::make_tuple(to_numpy(std::move(tree.tokens), {n}), to_numpy(std::move(tree.parents), {n}));
          },
          nb::sig("def draft_tree(self, seq: int, tokens: NDArray[numpy.int32], budget: int = 16) -> "
                  "tuple[NDArray[numpy.int32], NDArray[numpy.int32]]"),
          "seq"_a, "tokens"_a, "budget"_a = 16,
          "Drafts a tree of at most `budget` nodes (match mode) for engines that verify a tree in one\n"
          "pass: (tokens, parents), node i is tokens[i] and follows node parents[i] (-1: follows the\n"
          "sequence). Parents come before their children.")
      .def(
          "draft_tree_scored",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int budget) {
            DraftTree tree = run_draft_tree(d, seq, tokens, budget);
            const size_t n = tree.tokens.size();
            return nb::make_tuple(to_numpy(std::move(tree.tokens), {n}), to_numpy(std::move(tree.parents), {n}),
                                  to_numpy(std::move(tree.probs), {n}));
          },
          nb::sig("def draft_tree_scored(self, seq: int, tokens: NDArray[numpy.int32], budget: int = 16) -> "
                  "tuple[NDArray[numpy.int32], NDArray[numpy.int32], NDArray[numpy.float32]]"),
          "seq"_a, "tokens"_a, "budget"_a = 16,
          "draft_tree() with each node's odds: (tokens, parents, probs), probs[i] (float32, 0..1) the\n"
          "estimated chance that node i and every node above it are accepted. Nodes come best first\n"
          "(probs never rise), so the first m nodes are the tree a budget of m would draft: a\n"
          "cost-aware engine keeps the prefix worth its verify cost (ngramcache.client.adapters.\n"
          "draft_length.best_tree_size). Deterministic.")
      .def_prop_ro(
          "mode", [](PyDrafter& d) { return std::string(draft_mode_name(d.drafter->options().mode)); },
          "'compatible' or 'match'.")
      .def(
          "draft_batch",
          [](PyDrafter& d, const std::vector<int64_t>& seqs, nb::sequence token_arrays, int n_draft, bool uncapped) {
            check(check_n_draft(n_draft));  // before sizing the output by it
            const size_t m = seqs.size();
            if (nb::len(token_arrays) != m) {
              raise_status(Status::InvalidArgument("seqs and tokens must have the same length, got " +
                                                   std::to_string(m) + " and " +
                                                   std::to_string(nb::len(token_arrays))));
            }
            std::vector<TokenView> views;
            std::vector<const Token*> data;
            std::vector<size_t> sizes;
            for (size_t i = 0; i < m; ++i) {
              views.push_back(as_tokens(token_arrays[i], ("tokens[" + std::to_string(i) + "]").c_str()));
              data.push_back(views.back().data);
              sizes.push_back(views.back().size);
            }
            std::vector<int32_t> out(m * static_cast<size_t>(n_draft));
            std::vector<int32_t> lengths(m, 0);
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->draft_batch(m, seqs.data(), data.data(), sizes.data(), n_draft, out.data(), lengths.data(),
                                         uncapped);
            }
            check(s);
            return nb::make_tuple(to_numpy(std::move(out), {m, static_cast<size_t>(n_draft)}),
                                  to_numpy(std::move(lengths), {m}));
          },
          nb::sig(
              "def draft_batch(self, seqs: Sequence[int], tokens: Sequence[NDArray[numpy.int32]], n_draft: int = 8, "
              "uncapped: bool = False) -> tuple[NDArray[numpy.int32], NDArray[numpy.int32]]"),
          "seqs"_a, "tokens"_a, "n_draft"_a = 8, "uncapped"_a = false,
          "Drafts for several sequences in one call (as a batching engine does each step), with the\n"
          "GIL released for the whole batch. Returns (drafts, lengths): row i of the int32 array\n"
          "drafts (shape (m, n_draft)) holds lengths[i] drafted tokens of draft(seqs[i], tokens[i],\n"
          "n_draft), then padding. uncapped (match mode): each row's draft as draft_scored(...,\n"
          "uncapped=True) drafts it, for an engine that verifies the whole width anyway.")
      .def(
          "accept",
          [](PyDrafter& d, int64_t seq, nb::handle tokens) {
            TokenView v = as_tokens(tokens, "tokens");
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->accept(seq, v.data, v.size);
            }
            check(s);
          },
          nb::sig("def accept(self, seq: int, tokens: NDArray[numpy.int32]) -> None"), "seq"_a, "tokens"_a,
          "Counts the tokens of `tokens` (the whole sequence so far) not yet accepted for `seq` into its\n"
          "context table (and the pending deltas).")
      .def(
          "reset",
          [](PyDrafter& d, int64_t seq) {
            nb::gil_scoped_release release;
            return d.drafter->reset(seq);
          },
          "seq"_a,
          "Forgets sequence `seq` and frees its context table (in the match mode, its last tokens held\n"
          "back for a history piece join the history first); returns whether it was known.")
      .def(
          "end_history",
          [](PyDrafter& d, int64_t source) {
            nb::gil_scoped_release release;
            return d.drafter->end_history(source);
          },
          "source"_a,
          "Says that add_history's `source` has ended: its tokens held back for a piece join the\n"
          "history now; returns how many.")
      .def(
          "flush_history",
          [](PyDrafter& d, double idle_seconds) {
            nb::gil_scoped_release release;
            return d.drafter->flush_history(idle_seconds);
          },
          "idle_seconds"_a = 0.0,
          "Moves into the match history the tokens held back for a piece (match_params history_piece)\n"
          "of every source idle for at least `idle_seconds` (0: all); returns how many tokens. Call it\n"
          "now and then (NgramClient does), so a finished sequence's last tokens join the history.")
      .def(
          "evict_idle",
          [](PyDrafter& d) {
            nb::gil_scoped_release release;
            return d.drafter->sequences().evict_idle();
          },
          "Evicts the sequences unused for longer than idle_ttl; returns how many (call it periodically).")
      .def(
          "set_static", [](PyDrafter& d, nb::object cache) { set_static(d, cache); },
          nb::sig("def set_static(self, static: StaticCache | None) -> None"), "static"_a.none(),
          "Swaps in another static cache (a newer generation) between two drafts; drafts in flight\n"
          "finish on the old one.\n\n"
          "Raises:\n    TokenizerMismatchError: it was built for another tokenizer or vocabulary.\n"
          "    InvalidArgumentError: its generation is older than the attached one's.")
      .def(
          "set_dynamic", [](PyDrafter& d, nb::object table) { set_dynamic(d, table); },
          nb::sig("def set_dynamic(self, dynamic: CountTable | None) -> None"), "dynamic"_a.none(),
          "Attaches another dynamic table (or None).")
      .def_prop_ro(
          "static", [](PyDrafter& d) { return d.static_ref; }, nb::sig("def static(self) -> StaticCache | None"))
      .def_prop_ro(
          "dynamic", [](PyDrafter& d) { return d.dynamic_ref; }, nb::sig("def dynamic(self) -> CountTable | None"))
      .def_prop_ro("vocab_size", [](PyDrafter& d) { return d.drafter->options().vocab_size; })
      .def_prop_ro(
          "fingerprint", [](PyDrafter& d) { return fingerprint_bytes(d.drafter->options().fingerprint); },
          "The tokenizer fingerprint this drafter is bound to (UNTAGGED for raw tokens).")
      .def_prop_ro("n_sequences", [](PyDrafter& d) { return d.drafter->sequences().size(); })
      .def_prop_ro(
          "n_evicted", [](PyDrafter& d) { return d.drafter->sequences().n_evicted(); },
          "Sequences evicted by max_sequences, idle_ttl or max_memory so far.")
      .def(
          "memory_bytes", [](PyDrafter& d) { return d.drafter->memory_bytes(); },
          "Heap bytes of this drafter's context tables (the static cache is mapped and shared; the\n"
          "dynamic table is counted by its owner).")
      .def(
          "context_rows",
          [](PyDrafter& d, int64_t seq) {
            std::vector<int32_t> out;
            d.drafter->sequences().with_context(seq, [&](const CountTable* t) {
              if (t) t->to_rows(&out);
            });
            return rows_to_numpy(std::move(out));
          },
          "seq"_a, "The context table of `seq` as count rows (n, t0, t1, t2, t3, follower, count).")
      .def(
          "add_history",
          [](PyDrafter& d, int64_t source, nb::handle tokens) {
            TokenView v = as_tokens(tokens, "tokens");
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->add_history(source, v.data, v.size);
            }
            check(s);
          },
          nb::sig("def add_history(self, source: int, tokens: NDArray[numpy.int32]) -> None"), "source"_a, "tokens"_a,
          "Appends tokens generated elsewhere (another client's sequence `source`) to the match mode's\n"
          "history, as accept() does for this drafter's own sequences: consecutive calls with one\n"
          "source continue one text; another source starts a new one.\n\n"
          "Raises:\n    InvalidArgumentError: a compatible-mode drafter, or a token outside the vocabulary.")
      .def(
          "drain_history",
          [](PyDrafter& d) {
            std::vector<HistoryRecord> records;
            {
              nb::gil_scoped_release release;
              d.drafter->drain_history(&records);
            }
            nb::list out;
            for (auto& r : records) {
              const size_t n = r.tokens.size();
              out.append(nb::make_tuple(r.seq, r.offset, to_numpy(std::move(r.tokens), {n})));
            }
            return out;
          },
          nb::sig("def drain_history(self) -> list[tuple[int, int, NDArray[numpy.int32]]]"),
          "With track_history: the (seq, offset, tokens) records accept() added since the last call,\n"
          "oldest first (consecutive accepts of one sequence merged): tokens[i] sits at offset + i.")
      .def_prop_ro(
          "history_dropped", [](PyDrafter& d) { return d.drafter->history_dropped(); },
          "Accepted tokens never drained because drain_history's outbox was full (1M tokens).")
      .def_prop_ro(
          "history_size", [](PyDrafter& d) { return d.drafter->history_size(); },
          "Tokens in the match mode's history (bounded by the match_params history_tokens).")
      .def(
          "drain_deltas",
          [](PyDrafter& d) {
            std::vector<int32_t> out;
            {
              nb::gil_scoped_release release;
              d.drafter->sequences().drain_deltas(&out);
            }
            return rows_to_numpy(std::move(out));
          },
          "The counts accepted since the last call, as count rows (n, t0, t1, t2, t3, follower, count).");
}

}  // namespace ngc::py
