// The llama.cpp-compatible drafter: common_ngram_cache_draft over a context table, a
// dynamic table and a static cache, with its thresholds, made deterministic.
//
// The draft grows one token at a time. Each step looks at the tail of sequence + draft:
//   1. the context table with the lax thresholds, n-gram sizes ngram_max..ngram_min;
//   2. else the dynamic table with the strict thresholds, same sizes;
//   3. else the static cache alone (its key's best follower, if total >= 2 and
//      100 * best >= 50 * total).
// In steps 1 and 2 a follower scores count x (100 x its count after the static key, or 1
// when the static cache has no such follower); the best score wins, ties to the lowest
// token; the size passes when its total >= min_samples[n-1] and 100 x the winner's count
// >= min_percent[n-1] x total. Drafting stops at the first step that yields nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ngc/count_table.h"
#include "ngc/ngram.h"
#include "ngc/static_cache.h"

namespace ngc {

// The largest n_draft a call may ask for.
constexpr int kMaxDraft = 256;

struct DraftThresholds {
  int min_samples[kNgramMax];  // indexed by n-gram size - 1
  int min_percent[kNgramMax];
};

// llama.cpp's draft_min_sample_size_lax / draft_min_percent_lax (context table).
constexpr DraftThresholds kLax = {{2, 2, 1, 1}, {66, 50, 50, 50}};
// llama.cpp's draft_min_sample_size_strict / draft_min_percent_strict (dynamic table).
constexpr DraftThresholds kStrict = {{4, 3, 2, 2}, {75, 66, 66, 66}};

struct DraftParams {
  int n_draft = 8;    // the most tokens to draft, 1..kMaxDraft
  int ngram_min = 1;  // the shortest context/dynamic n-gram tried, 1..ngram_max
  int ngram_max = 4;  // the longest, ngram_min..4
};

// Drafts up to params.n_draft tokens after seq[0..n_seq) into `out` (room for n_draft)
// and returns how many. Any table may be null. The caller MUST pass valid params (the
// bindings check them). Reads only the last max(ngram_max, static n-gram size) tokens of
// `seq`. Never allocates.
int draft(const Token* seq, size_t n_seq, const CountTable* context, const CountTable* dynamic,
          const StaticCache* static_cache, const DraftParams& params, Token* out);

}  // namespace ngc
