#include "ngc/seq_index.h"

#include <algorithm>

namespace ngc {

void SeqIndex::rehash(size_t slots) {
  head_.assign(slots, 0);
  shift_ = 64 - __builtin_ctzll(slots);
  index_from(1);
}

void SeqIndex::index_from(size_t first) {
  for (size_t i = std::max<size_t>(first, 1); i < tokens_.size(); ++i) {
    prev_[i] = 0;
    if (tokens_[i - 1] < 0 || tokens_[i] < 0) continue;  // a separator is in no bigram
    const size_t s = slot(tokens_[i - 1], tokens_[i]);
    prev_[i] = head_[s];
    head_[s] = static_cast<uint32_t>(i + 1);
  }
}

void SeqIndex::append(const Token* tokens, size_t n) {
  const size_t old = tokens_.size();
  if (n == 0 || old + n >= UINT32_MAX) return;
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  prev_.resize(old + n, 0);
  if (head_.size() < 2 * tokens_.size()) {
    size_t slots = 256;
    while (slots < 4 * tokens_.size()) slots *= 2;
    rehash(slots);  // every position again: O(1) amortized as the table doubles
  } else {
    index_from(old);
  }
}

void SeqIndex::extend(const Token* tokens, size_t n) {
  if (n > tokens_.size()) append(tokens + tokens_.size(), n - tokens_.size());
}

void SeqIndex::keep_last(size_t n) {
  if (tokens_.size() <= n) return;
  tokens_.erase(tokens_.begin(), tokens_.end() - static_cast<ptrdiff_t>(n));
  prev_.resize(tokens_.size());
  rehash(head_.size());
}

void SeqIndex::clear() {
  tokens_.clear();
  prev_.clear();
  head_.clear();
  shift_ = 64;
}

}  // namespace ngc
