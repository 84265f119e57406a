// SharedCountTable: a CountTable that drafts read from several threads while one writer
// (a dynamic mirror, a merge) changes it.
//
// Writers validate a whole change set first (nothing changes when a row is bad), then apply
// it in chunks of kApplyChunk rows, taking the exclusive lock once per chunk and letting
// waiting readers in between chunks, so a draft waits for at most one chunk (tens of us).
// Readers may observe a change set half applied; every row is an independent upsert, so
// what they see is always a valid table.
//
// Thread-safety: every method may be called from any thread. Writers are serialized among
// themselves; table() MUST be used only while holding the lock read() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>

#include "ngc/count_table.h"
#include "ngc/rwlock.h"
#include "ngc/status.h"

namespace ngc {

class SharedCountTable {
 public:
  // Rows applied per exclusive lock.
  static constexpr size_t kApplyChunk = 16;

  // A shared lock: the table does not change while it is held.
  std::shared_lock<RwLock> read() const { return std::shared_lock<RwLock>(mu_); }
  // The table; the caller MUST hold read() (or be inside write()).
  const CountTable& table() const { return table_; }

  // Adds int32 count rows (see rows.h), all checked first; tokens must be < vocab_limit.
  Status add_rows(const int32_t* rows, size_t n, uint32_t vocab_limit);
  // Sets absolute counts from int64 rows (an upsert of each (n-gram, follower)); counts
  // above UINT32_MAX saturate. With `zero_removes`, a count of 0 removes the follower (a
  // draft view's change log); without it, 0 is refused like any count outside 1..2^63-1.
  Status assign_rows(const int64_t* rows, size_t n, uint32_t vocab_limit, bool zero_removes = false);

  // Runs fn(CountTable&) under the exclusive lock (for whole-table operations: update,
  // merge, clear). Keep it short: drafts wait for it.
  template <typename Fn>
  void write(Fn&& fn) {
    std::lock_guard writer(write_mu_);
    std::unique_lock lock(mu_);
    fn(table_);
  }

 private:
  template <typename T, typename Apply>
  Status apply_rows(const T* rows, size_t n, uint32_t vocab_limit, int64_t min_count, int64_t max_count, Apply&& apply);

  mutable RwLock mu_;     // readers: drafts; writer: one chunk of a change set
  std::mutex write_mu_;   // serializes writers, so a change set's chunks are not interleaved
  CountTable table_;
};

}  // namespace ngc
