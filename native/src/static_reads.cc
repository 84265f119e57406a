#include "ngc/static_reads.h"

#include <algorithm>
#include <utility>

#include "ngc/rows.h"

namespace ngc {

Status static_find(const StaticCache& cache, const std::string& name, const int64_t* ngram, size_t n, StaticPart* part,
                   bool* found) {
  *found = false;
  const StaticInfo& info = cache.info();
  if (n != info.ngram_size) {
    return Status::InvalidArgument("this static cache has keys of " + std::to_string(info.ngram_size) +
                                   " tokens, got an n-gram of " + std::to_string(n));
  }
  NGram g;
  NGC_RETURN_IF_ERROR(make_ngram(ngram, n, info.vocab_size, &g));
  const FindResult r = cache.find(g.tokens, part);
  if (r == FindResult::kCorrupt) return Status::FormatError(name + ": key index points outside its section");
  *found = r == FindResult::kFound;
  return Status::Ok();
}

Status static_followers(const StaticCache& cache, const std::string& name, const int64_t* ngram, size_t n,
                        std::vector<Token>* tokens, std::vector<int64_t>* counts) {
  tokens->clear();
  counts->clear();
  StaticPart part;
  bool found = false;
  NGC_RETURN_IF_ERROR(static_find(cache, name, ngram, n, &part, &found));
  if (!found) return Status::Ok();
  // The best follower comes first in the file; callers want token order.
  std::vector<std::pair<Token, int64_t>> items;
  for (uint32_t j = 0; j < part.size; ++j) items.emplace_back(cache.token_at(part, j), cache.count_at(part, j));
  std::sort(items.begin(), items.end());
  for (const auto& [t, c] : items) {
    tokens->push_back(t);
    counts->push_back(c);
  }
  return Status::Ok();
}

Status static_to_rows(const StaticCache& cache, std::vector<int32_t>* out) {
  const StaticInfo& info = cache.info();
  out->reserve(out->size() + info.n_followers * rows::kWidth);
  std::vector<std::pair<Token, uint32_t>> items;
  for (uint64_t i = 0; i < info.n_keys; ++i) {
    NGram key;
    StaticPart part;
    NGC_RETURN_IF_ERROR(cache.key_at(i, &key, &part));
    items.clear();
    for (uint32_t j = 0; j < part.size; ++j) items.emplace_back(cache.token_at(part, j), cache.count_at(part, j));
    std::sort(items.begin(), items.end());
    for (const auto& [t, c] : items) rows::append(out, key, t, c);
  }
  return Status::Ok();
}

std::vector<uint64_t> follower_histogram(const StaticCache& cache) {
  std::vector<uint64_t> h(33, 0);
  for (uint64_t i = 0; i < cache.info().n_keys; ++i) {
    const uint32_t n = cache.followers_of(i);
    if (n > 0) ++h[31 - __builtin_clz(n)];
  }
  while (h.size() > 1 && h.back() == 0) h.pop_back();
  return h;
}

Status static_corpus_match(const StaticCache& cache, const Token* tokens, size_t n, CorpusMatch* out) {
  NGC_RETURN_IF_ERROR(check_tokens(tokens, n, cache.info().vocab_size, "tokens"));
  const CorpusIndex& ix = cache.corpus();
  *out = corpus_longest_match(ix, tokens, n, ix.depth);
  return Status::Ok();
}

}  // namespace ngc
