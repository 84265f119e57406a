// The "match" drafting mode: copy what followed earlier occurrences of the sequence's
// tail, from three texts, and let the count tables compete.
//
// A step looks up the tail of the sequence:
//   - in the sequence itself and in the drafter's earlier sequences (the history), through
//     SeqIndex hash chains (seq_index.h): the most recent max_chain occurrences of the last
//     two tokens, each compared backwards to find how long it matches;
//   - in the corpus index of the static file (static_format.h: TEXT, SUFFIXES, BUCKETS):
//     a sorted run of positions narrowed one token further back at a time, every match
//     length's run kept (corpus_matches; it and build_corpus_index live in corpus_index.cc).
// Each source gives options: its max_options longest distinct match lengths, each with up
// to max_candidates occurrences (spread evenly over a long run). An option's draft follows
// its occurrences forward: each token is the most frequent next token of the occurrences
// still agreeing with the draft, with probability agree / (live + prior / L) (prior is
// corpus_prior for the corpus; L the match length), and the draft goes on while the product
// of those probabilities stays >= min_prob, for at most ceil(length_factor x L) tokens. The
// count tables' walk (count_option: the best follower of the longest n-gram the context,
// else the dynamic table, knows at the tail, probability count / (total + count_prior / n))
// is one more option. The option with the most expected accepted tokens (the sum of its
// prefix probabilities) wins; with none, the step drafts as the compatible mode does
// (drafter.h) from the same tables (fallback).
//
// With splice_min or resync_below (MatchParams), a linear draft is repaired across an edit of
// the text being copied: it gives way to the sequence's own text (splice), resumes the text
// after new tokens (resync), or goes on past a replaced token (realign). match.cc holds the
// options, walks and drafts; match_edits.cc the repairs.
//
// draft_tree() grows every option at once, best first: the most probable continuation not
// yet in the tree becomes the next node (one node for the same token under the same parent)
// until `budget` nodes or tree_min_prob, for engines that verify a tree in one pass.
//
// Every read of TEXT, SUFFIXES and BUCKETS is bounds-checked: a damaged index gives shorter
// matches or none, never an out-of-bounds read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/draft_params.h"
#include "ngc/ngram.h"
#include "ngc/seq_index.h"
#include "ngc/static_cache.h"

namespace ngc {

// One drafted tree: node i is tokens[i], child of parents[i] (-1: of the sequence's last
// token), with probs[i] the estimated chance that its whole path is accepted. Nodes come in
// best-first order: parents before their children, probs never rising, so every prefix of
// the nodes is a tree (the one a smaller budget would draft).
struct DraftTree {
  std::vector<Token> tokens;
  std::vector<int32_t> parents;
  std::vector<float> probs;
  void clear() {
    tokens.clear();
    parents.clear();
    probs.clear();
  }
};

// What a match-mode draft reads. Any member may be null.
struct MatchTables {
  const SeqIndex* sequence = nullptr;   // this sequence's positions (its tokens SHOULD be a prefix of seq)
  const SeqIndex* history = nullptr;    // earlier sequences' tokens, separated
  const CountTable* context = nullptr;  // for the compatible fallback
  const CountTable* dynamic = nullptr;
  const StaticCache* static_cache = nullptr;  // its corpus index, and the fallback's static table
};

// Linear draft after seq[0..n_seq) into `out` (room for params.n_draft); returns how many.
// With `odds` (room for params.n_draft), odds[i] is drafted token i's probability given the
// ones before it: its share of the agreeing occurrences (walk), of the counts (count_walk),
// or the compatible mode's count odds (fallback, drafter.h).
int draft_match(const Token* seq, size_t n_seq, const MatchTables& tables, const MatchParams& params, Token* out,
                float* odds = nullptr);

// Tree draft of at most `budget` (1..kMaxDraft) nodes into `tree`; returns the node count.
int draft_tree(const Token* seq, size_t n_seq, const MatchTables& tables, const MatchParams& params, int budget,
               DraftTree* tree);

// The longest match of the tail of tail[0..n) in a corpus index: its length (0: none,
// at most index.depth) and its run SUFFIXES[lo, hi). Exposed for tests.
struct CorpusMatch {
  uint32_t length = 0;
  uint64_t lo = 0, hi = 0;
};
CorpusMatch corpus_longest_match(const CorpusIndex& index, const Token* tail, size_t n, uint32_t max_length);
// The runs of every match length 1..returned value in runs[1..] (room for kMaxIndexDepth + 1).
int corpus_matches(const CorpusIndex& index, const Token* tail, size_t n, uint32_t max_length, CorpusMatch* runs);

// Builds SUFFIXES and BUCKETS for `text` (static_format.h, version 2) to `depth`.
// Memory: about 16 bytes per token besides text and the result.
struct CorpusArrays {
  std::vector<uint32_t> suffixes;
  std::vector<uint32_t> buckets;
};
void build_corpus_index(const std::vector<uint32_t>& text, uint32_t vocab, uint32_t depth, CorpusArrays* out);

}  // namespace ngc
