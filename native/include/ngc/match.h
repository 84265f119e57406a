// The "match" drafting mode: longest-match lookups over the sequence itself and over the
// static file's corpus index, continued by the most frequent continuation.
//
// A step finds the longest suffix of sequence + draft that occurred before:
//   - in the sequence, through a SeqIndex (a hash chain of the positions of each bigram,
//     as LZ77 compressors keep one), comparing backwards from each of the most recent
//     max_chain positions;
//   - in the corpus, through the corpus index (static_format.h: TEXT, SUFFIXES, BUCKETS),
//     narrowing a sorted run of positions one token further back at a time.
// The longer match wins (the sequence's on ties, or when the corpus's is only one token
// longer). Its occurrences (up to max_candidates, spread evenly over a long run) are the
// candidates; the draft follows them forward, each token the most frequent next token of
// the candidates still agreeing with the draft. A token is drafted only while the
// estimated probability that the whole draft so far is right stays at or above min_prob:
// each token multiplies it by agree / (live + prior), so one occurrence supports a short
// draft and many agreeing ones a long draft. A match also caps the draft at
// length_factor x its length. With no match of min_match tokens, the step drafts as the
// compatible mode does (drafter.h) from the same tables.
//
// draft_tree() grows a tree instead: the most probable unexpanded continuation first,
// until `budget` nodes, for engines that verify a tree in one pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/ngram.h"
#include "ngc/seq_index.h"
#include "ngc/static_cache.h"

namespace ngc {

struct MatchParams {
  int n_draft = 8;           // the most tokens to draft, 1..kMaxDraft
  int ngram_min = 1;         // the count tables' n-gram sizes
  int ngram_max = 4;
  int min_match = 1;         // the shortest sequence/history match used (chains find >= 2)
  int corpus_min_match = 1;  // the shortest corpus match used
  int max_match = 64;        // matches are compared this far back at most
  int max_chain = 8;         // sequence/history positions tried per lookup
  int max_candidates = 8;    // occurrences followed per match (1..64)
  int max_options = 2;       // match lengths tried per source (their drafts compete)
  double prior = 1.0;        // added to the live occurrences, over the match length, in a token's probability
  double corpus_prior = 2.0; // the same for the corpus index's occurrences (trusted less)
  double count_prior = 1.0;  // the same for the count tables, over the n-gram size
  double min_prob = 0.25;    // the least probability of the whole linear draft
  double tree_min_prob = 0.05;  // the least probability of a tree node (the budget bounds the tree)
  double length_factor = 1;  // a match of L tokens drafts at most ceil(factor x L) tokens
  size_t history_tokens = size_t{1} << 20;  // earlier sequences' tokens kept for matches
  bool count_option = true;  // the count tables' own walk competes with the matches
  bool extend = false;       // after a match's draft, the count tables go on
  bool fallback = true;      // nothing drafted: draft as the compatible mode does
};

// One drafted tree: node i is tokens[i], child of parents[i] (-1: of the sequence's last
// token). Parents come before their children.
struct DraftTree {
  std::vector<Token> tokens;
  std::vector<int32_t> parents;
  void clear() {
    tokens.clear();
    parents.clear();
  }
};

// What a match-mode draft reads. Any member may be null.
struct MatchTables {
  const SeqIndex* sequence = nullptr;  // this sequence's positions (its tokens SHOULD be a prefix of seq)
  const SeqIndex* history = nullptr;   // earlier sequences' tokens, separated
  const CountTable* context = nullptr; // for the compatible fallback
  const CountTable* dynamic = nullptr;
  const StaticCache* static_cache = nullptr;  // its corpus index, and the fallback's static table
};

// Linear draft after seq[0..n_seq) into `out` (room for params.n_draft); returns how many.
int draft_match(const Token* seq, size_t n_seq, const MatchTables& tables, const MatchParams& params, Token* out);

// Tree draft of at most `budget` (1..kMaxDraft) nodes into `tree`; returns the node count.
int draft_tree(const Token* seq, size_t n_seq, const MatchTables& tables, const MatchParams& params, int budget, DraftTree* tree);

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
