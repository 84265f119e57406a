// Count rows: the one exchange format of n-gram counts between the core, the client's
// sender, the counts store and the builder.
//
// A row is kWidth integers (n, t0, t1, t2, t3, follower, count): an n-gram of n tokens
// t0..t(n-1) (1 <= n <= kNgramMax; the unused slots are -1), the token that followed it,
// and a count > 0. Deltas travel as int32 rows; absolute counts (what a store returns
// for a mirror) as int64 rows. The Python twin of this contract is client/kernel/rows.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/ngram.h"
#include "ngc/status.h"

namespace ngc::rows {

constexpr int kWidth = 7;
// Column indexes.
constexpr int kN = 0, kT0 = 1, kFollower = 5, kCount = 6;

// Checks row `index` (for the message) of `row`: n in 1..kNgramMax, tokens and follower in
// [0, vocab_limit), unused slots -1, count in [min_count, max_count] (min_count 0 only where a
// count of 0 means "remove"). Works for int32 and int64 rows.
template <typename T>
Status validate(const T* row, size_t index, uint32_t vocab_limit, int64_t max_count, int64_t min_count = 1);

// Checks n rows (all of them, before the caller changes anything); the first bad row fails.
template <typename T>
Status validate_all(const T* rows, size_t n, uint32_t vocab_limit, int64_t max_count, int64_t min_count = 1) {
  for (size_t i = 0; i < n; ++i) NGC_RETURN_IF_ERROR(validate(rows + kWidth * i, i, vocab_limit, max_count, min_count));
  return Status::Ok();
}

// The n-gram of a valid row.
template <typename T>
NGram key_of(const T* row) {
  NGram g;
  for (int i = 0; i < static_cast<int>(row[kN]); ++i) g.tokens[i] = static_cast<Token>(row[kT0 + i]);
  return g;
}

// Appends the row (key, follower, count) to `out`. Counts above INT32_MAX are split over
// several rows, so the sum over rows is exact.
void append(std::vector<int32_t>* out, const NGram& key, Token follower, uint64_t count);

}  // namespace ngc::rows
