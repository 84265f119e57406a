// The parameters of a draft, in both modes, and the checks that keep them in range.
//
// The core's drafting functions trust their parameters (they run per token); the entry
// points that take parameters from outside (Drafter options, replay, the bindings) check
// them here first, so every caller gets the same rules and the same messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ngc/limits.h"
#include "ngc/status.h"

namespace ngc {

enum class DraftMode : uint8_t {
  kCompatible,  // llama.cpp's drafts, token for token (drafter.h's draft())
  kMatch,       // longest-match drafts (match.h)
};

// The compatible mode's parameters. Valid when validate() is ok.
struct DraftParams {
  int n_draft = 8;    // the most tokens to draft, 1..kMaxDraft
  int ngram_min = 1;  // the shortest context/dynamic n-gram tried, 1..ngram_max
  int ngram_max = 4;  // the longest, ngram_min..4

  // Checks the n-gram sizes, then n_draft.
  Status validate() const;
};

// The match mode's tuning (match.h says what each does). Valid when validate() is ok.
struct MatchParams {
  int n_draft = 8;    // the most tokens to draft, 1..kMaxDraft
  int ngram_min = 1;  // the count tables' n-gram sizes
  int ngram_max = 4;
  int min_match = 1;             // the shortest sequence/history match used (chains find >= 2); 1..64
  int corpus_min_match = 1;      // the shortest corpus match used; 1..64
  int max_match = 64;            // matches are compared this far back at most; 2..1024
  int max_chain = 8;             // sequence/history positions tried per lookup; 1..65536
  int max_candidates = 8;        // occurrences followed per match; 1..64
  int max_options = 2;           // match lengths tried per source (their drafts compete); 1..8
  double prior = 1.0;            // added to the live occurrences, over the match length, in a token's probability
  double corpus_prior = 2.0;     // the same for the corpus index's occurrences (trusted less)
  double sequence_weight = 1.0;  // an occurrence in the sequence drafted votes as this many others' (>= 1)
  int splice_min = 0;           // a draft from other texts gives way to a >= this long match in the sequence (0: never)
  int resync_below = 0;         // no sequence/history match this long: resume the text last copied (0: never; > 0 also
                                // goes on past a replaced token where the draft is a guess)
  double count_prior = 1.0;     // the same for the count tables, over the n-gram size
  double min_prob = 0.25;       // the least probability of the whole linear draft; 0..1
  double tree_min_prob = 0.05;  // the least probability of a tree node (the budget bounds the tree); 0..1
  double length_factor = 1;     // a match of L tokens drafts at most ceil(factor x L) tokens
  size_t history_tokens = size_t{1} << 20;  // earlier sequences' tokens kept for matches
  // While another sequence writes the history, a sequence's tokens join it in pieces of at
  // least this many (Drafter): sequences accepted at the same time would otherwise cut each
  // other's text into pieces of a few tokens, and a draft stops at a piece's end. The sequence
  // that wrote last goes on at once. 1: every token at once; 1..4096.
  int history_piece = 16;
  bool count_option = true;  // the count tables' own walk competes with the matches
  bool extend = false;       // after a match's draft, the count tables go on
  bool fallback = true;      // nothing drafted: draft as the compatible mode does

  // Sets the tuning parameter `name` (a name for_each_match_param() gives) to `value`,
  // checked against its range before it is converted (1.5 is a valid min_match: 1).
  // Fails, changing nothing, for an unknown name or a value out of range.
  Status set(std::string_view name, double value);
  // Checks n_draft, the n-gram sizes and every tuning parameter's range.
  Status validate() const;
};

// How a tuning parameter's value reads: the bindings show each in its own type.
enum class ParamKind : uint8_t { kInt, kReal, kFlag };

// Calls fn(name, kind, value) for every tuning parameter of `p`, in a fixed order.
template <typename Fn>
void for_each_match_param(const MatchParams& p, Fn&& fn);

// Fails unless 1 <= ngram_min <= ngram_max <= kNgramMax.
Status check_ngram_range(int ngram_min, int ngram_max);
// Fails unless 1 <= n_draft <= kMaxDraft.
Status check_n_draft(int n_draft);
// The mode called `name` ("compatible" or "match").
Status parse_draft_mode(std::string_view name, DraftMode* out);
// The name parse_draft_mode() reads back.
const char* draft_mode_name(DraftMode mode);

// ---- implementation of the template above

template <typename Fn>
void for_each_match_param(const MatchParams& p, Fn&& fn) {
  fn("min_match", ParamKind::kInt, double(p.min_match));
  fn("corpus_min_match", ParamKind::kInt, double(p.corpus_min_match));
  fn("max_match", ParamKind::kInt, double(p.max_match));
  fn("max_chain", ParamKind::kInt, double(p.max_chain));
  fn("max_candidates", ParamKind::kInt, double(p.max_candidates));
  fn("max_options", ParamKind::kInt, double(p.max_options));
  fn("prior", ParamKind::kReal, p.prior);
  fn("count_prior", ParamKind::kReal, p.count_prior);
  fn("corpus_prior", ParamKind::kReal, p.corpus_prior);
  fn("sequence_weight", ParamKind::kReal, p.sequence_weight);
  fn("splice_min", ParamKind::kInt, double(p.splice_min));
  fn("resync_below", ParamKind::kInt, double(p.resync_below));
  fn("min_prob", ParamKind::kReal, p.min_prob);
  fn("tree_min_prob", ParamKind::kReal, p.tree_min_prob);
  fn("length_factor", ParamKind::kReal, p.length_factor);
  fn("history_tokens", ParamKind::kInt, double(p.history_tokens));
  fn("history_piece", ParamKind::kInt, double(p.history_piece));
  fn("count_option", ParamKind::kFlag, double(p.count_option));
  fn("extend", ParamKind::kFlag, double(p.extend));
  fn("fallback", ParamKind::kFlag, double(p.fallback));
}

}  // namespace ngc
