#include "ngc/shared_table.h"

#include <algorithm>

#include "ngc/rows.h"

namespace ngc {

template <typename T, typename Apply>
Status SharedCountTable::apply_rows(const T* rows, size_t n, uint32_t vocab_limit, int64_t min_count, int64_t max_count,
                                    Apply&& apply) {
  NGC_RETURN_IF_ERROR(rows::validate_all(rows, n, vocab_limit, max_count, min_count));
  std::lock_guard writer(write_mu_);
  for (size_t begin = 0; begin < n; begin += kApplyChunk) {
    const size_t end = std::min(n, begin + kApplyChunk);
    {
      std::unique_lock lock(mu_);
      for (size_t i = begin; i < end; ++i) {
        const T* r = rows + rows::kWidth * i;
        apply(rows::key_of(r), static_cast<Token>(r[rows::kFollower]), r[rows::kCount]);
      }
    }
    mu_.yield_to_readers();
  }
  return Status::Ok();
}

Status SharedCountTable::add_rows(const int32_t* rows, size_t n, uint32_t vocab_limit) {
  return apply_rows(rows, n, vocab_limit, 1, INT32_MAX, [this](const NGram& key, Token f, int32_t c) {
    table_.add(key, f, static_cast<uint32_t>(c));
  });
}

Status SharedCountTable::assign_rows(const int64_t* rows, size_t n, uint32_t vocab_limit, bool zero_removes) {
  return apply_rows(rows, n, vocab_limit, zero_removes ? 0 : 1, INT64_MAX, [this](const NGram& key, Token f, int64_t c) {
    table_.set(key, f, static_cast<uint32_t>(std::min<int64_t>(c, UINT32_MAX)));
  });
}

}  // namespace ngc
