#include "ngc/rows.h"

#include <string>

namespace ngc::rows {

template <typename T>
Status validate(const T* row, size_t index, uint32_t vocab_limit, int64_t max_count, int64_t min_count) {
  const auto where = [&] { return "row " + std::to_string(index) + ": "; };
  const int64_t n = row[kN];
  if (n < 1 || n > kNgramMax) {
    return Status::InvalidArgument(where() + "n-gram size " + std::to_string(n) + " is outside 1.." +
                                   std::to_string(kNgramMax));
  }
  for (int k = 0; k < kNgramMax; ++k) {
    const int64_t t = row[kT0 + k];
    if (k >= n) {
      if (t != -1)
        return Status::InvalidArgument(where() + "token slot t" + std::to_string(k) +
                                       " past the n-gram must be -1, got " + std::to_string(t));
    } else if (t < 0 || t >= static_cast<int64_t>(vocab_limit)) {
      return Status::InvalidArgument(where() + "token t" + std::to_string(k) + " = " + std::to_string(t) +
                                     " is outside the vocabulary [0, " + std::to_string(vocab_limit) + ")");
    }
  }
  const int64_t f = row[kFollower];
  if (f < 0 || f >= static_cast<int64_t>(vocab_limit)) {
    return Status::InvalidArgument(where() + "follower " + std::to_string(f) + " is outside the vocabulary [0, " +
                                   std::to_string(vocab_limit) + ")");
  }
  const int64_t c = row[kCount];
  if (c < min_count || c > max_count) {
    return Status::InvalidArgument(where() + "count " + std::to_string(c) + " is outside " + std::to_string(min_count) +
                                   ".." + std::to_string(max_count));
  }
  return Status::Ok();
}

template Status validate<int32_t>(const int32_t*, size_t, uint32_t, int64_t, int64_t);
template Status validate<int64_t>(const int64_t*, size_t, uint32_t, int64_t, int64_t);

void append(std::vector<int32_t>* out, const NGram& key, Token follower, uint64_t count) {
  while (count > 0) {
    const uint64_t chunk = count > INT32_MAX ? INT32_MAX : count;
    out->push_back(key.size());
    for (int t = 0; t < kNgramMax; ++t) out->push_back(key.tokens[t]);
    out->push_back(follower);
    out->push_back(static_cast<int32_t>(chunk));
    count -= chunk;
  }
}

}  // namespace ngc::rows
