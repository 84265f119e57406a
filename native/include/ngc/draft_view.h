// The draft view: the part of a dynamic table that can change a draft, kept small enough
// for every client of a fleet to mirror.
//
// A client's mirror only feeds the dynamic step of the drafter (drafter.h), which ignores a
// key whose total is under the strict min_samples of its size, and drafts one follower of
// a key: the best scored. So a view keeps, of each key whose total reaches min_total[n-1],
// its top_k followers by count, and is published to clients as a change log. A change of a
// count that is already in the view is published only when it moves by more than
// min_change_pct percent of the published count: a row is then sent O(log count) times in
// its life instead of once per increment, which is what makes a client's pull traffic grow
// far slower than the fleet's pushes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/limits.h"
#include "ngc/status.h"

namespace ngc {

struct ViewPolicy {
  uint32_t top_k = 4;                            // followers kept per key, 1..kMaxViewTopK
  uint64_t min_total[kNgramMax] = {4, 3, 2, 2};  // a key enters the view when its total reaches this
  uint32_t min_change_pct = 25;                  // a published count is updated when it moves by more than this %

  // Checks top_k (1..kMaxViewTopK) and min_total (each >= 1).
  Status validate() const;
};

constexpr uint32_t kMaxViewTopK = 64;

// Appends to `out` the int64 count rows (n, t0..t3, follower, count) that bring `published`
// to the view of `full` for the keys of `changed` (n int64 rows; their follower and count
// are ignored), or for every key of `full` and `published` when `changed` is null. A row
// with count 0 removes that follower from the view. Rows of one key are contiguous, its
// followers by token. Neither table is changed; `changed` MUST hold valid keys.
void view_diff(const CountTable& full, const CountTable& published, const int64_t* changed, size_t n,
               const ViewPolicy& policy, std::vector<int64_t>* out);

}  // namespace ngc
