// SeqIndex: the positions of each bigram of a token sequence, for longest-match lookups
// (match.h), as an LZ77 compressor's hash chains keep them.
//
// Thread-safety: none; the owner serializes writes against reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/ngram.h"

namespace ngc {

// The positions of each bigram of one sequence. Appending is O(1) amortized; memory is
// about 12 bytes per token.
class SeqIndex {
 public:
  // Appends tokens; a negative token is a separator (no match crosses it).
  void append(const Token* tokens, size_t n);
  // Appends tokens[size()..n): `tokens` is the whole sequence so far.
  void extend(const Token* tokens, size_t n);
  // Forgets all but the last n tokens (positions shift down).
  void keep_last(size_t n);
  void clear();
  size_t size() const { return tokens_.size(); }
  const Token* tokens() const { return tokens_.data(); }
  // The most recent position i >= 1 with (tokens[i-1], tokens[i]) hashing like (a, b),
  // plus one (0: none). Follow with prev().
  uint32_t head(Token a, Token b) const { return head_.empty() ? 0 : head_[slot(a, b)]; }
  // The position before i (plus one, 0: none) in the same chain.
  uint32_t prev(uint32_t i) const { return prev_[i]; }
  size_t memory_bytes() const {
    return tokens_.capacity() * sizeof(Token) + prev_.capacity() * 4 + head_.capacity() * 4;
  }

 private:
  size_t slot(Token a, Token b) const {
    const uint64_t h =
        (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b)) * 0x9E3779B97F4A7C15ULL;
    return static_cast<size_t>(h >> shift_);
  }
  void rehash(size_t slots);
  void index_from(size_t first);
  std::vector<Token> tokens_;
  std::vector<uint32_t> prev_;  // per position: the chain's previous position + 1
  std::vector<uint32_t> head_;  // per slot: the latest position + 1
  int shift_ = 64;
};

}  // namespace ngc
