// Checked reads of a static cache for callers outside the core (the bindings, tools): the
// n-grams, tokens and indexes they pass are checked here, and a damaged file gives a
// kFormatError naming `name` (the file's path), never an out-of-bounds read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ngc/match.h"
#include "ngc/static_cache.h"
#include "ngc/status.h"

namespace ngc {

// Finds the n-gram ngram[0..n) (exactly info().ngram_size tokens, each below its vocabulary)
// in `cache`; *found says whether it is there.
Status static_find(const StaticCache& cache, const std::string& name, const int64_t* ngram, size_t n, StaticPart* part,
                   bool* found);
// The followers of ngram[0..n) sorted by token, with their counts; both empty when absent.
Status static_followers(const StaticCache& cache, const std::string& name, const int64_t* ngram, size_t n,
                        std::vector<Token>* tokens, std::vector<int64_t>* counts);
// Every (key, follower, count) as int32 count rows (rows.h) appended to `out`: keys in
// lexicographic order, followers by token.
Status static_to_rows(const StaticCache& cache, std::vector<int32_t>* out);
// Keys by follower count: element b counts the keys with 2^b .. 2^(b+1)-1 followers (no
// trailing zeros past the first element).
std::vector<uint64_t> follower_histogram(const StaticCache& cache);
// The longest suffix of tokens[0..n) (each below the vocabulary) the corpus index holds.
Status static_corpus_match(const StaticCache& cache, const Token* tokens, size_t n, CorpusMatch* out);

}  // namespace ngc
