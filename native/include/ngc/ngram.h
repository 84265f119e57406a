// NGram: an n-gram of 1..4 tokens, the key of every count table and static cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ngc/limits.h"
#include "ngc/status.h"

namespace ngc {

// A token id. Valid ids are 0 <= id < vocab_size; -1 marks an unused key slot.
using Token = int32_t;

// An n-gram of 1..kNgramMax tokens. Invariant: tokens[0..n-1] >= 0 and tokens[n..3] == -1,
// so the size is implied and two keys are equal iff their 16 bytes are equal.
struct NGram {
  Token tokens[kNgramMax] = {-1, -1, -1, -1};

  // The n-gram of `n` tokens starting at `p` (1 <= n <= kNgramMax).
  static NGram from(const Token* p, int n) {
    NGram g;
    for (int i = 0; i < n; ++i) g.tokens[i] = p[i];
    return g;
  }

  int size() const {
    int n = 0;
    while (n < kNgramMax && tokens[n] >= 0) ++n;
    return n;
  }

  bool operator==(const NGram& o) const { return std::memcmp(tokens, o.tokens, sizeof(tokens)) == 0; }

  // A 64-bit hash with all 16 bytes mixed into every output bit.
  uint64_t hash() const {
    uint64_t a, b;
    std::memcpy(&a, &tokens[0], 8);
    std::memcpy(&b, &tokens[2], 8);
    uint64_t h = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL) * 0xC2B2AE3D27D4EB4FULL;
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ULL;
    h ^= h >> 32;
    return h;
  }
};

// The n-gram tokens[0..n), checked: 1..kNgramMax tokens, each in [0, vocab_limit). Takes
// int64 so a caller's out-of-range values are refused, never truncated.
Status make_ngram(const int64_t* tokens, size_t n, uint32_t vocab_limit, NGram* out);

// Fails naming the first of tokens[0..n) outside [0, vocab) as what[i].
Status check_tokens(const Token* tokens, size_t n, uint32_t vocab, const char* what);

// One follower of an n-gram and how often it followed. Invariant: count > 0.
struct Follower {
  Token token;     // the token that followed the n-gram
  uint32_t count;  // how many times; saturates at UINT32_MAX instead of wrapping
};

// Adds with saturation at UINT32_MAX (a count never wraps to a small number).
inline uint32_t saturating_add(uint32_t a, uint64_t b) {
  const uint64_t s = static_cast<uint64_t>(a) + b;
  return s > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(s);
}

}  // namespace ngc
