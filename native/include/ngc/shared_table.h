// SharedCountTable: a CountTable that drafts read from several threads while one writer
// (a dynamic mirror, a merge) changes it.
//
// Writers validate a whole change set first (nothing changes when a row is bad), then apply
// it in chunks of kApplyChunk rows, taking the exclusive lock once per chunk and letting
// waiting readers in between chunks, so a draft waits for at most one chunk (tens of us).
// Readers may observe a change set half applied; every row is an independent upsert, so
// what they see is always a valid table.
//
// Thread-safety: every method may be called from any thread and takes the lock it needs
// itself: readers a shared lock, writers the exclusive one (writers are serialized among
// themselves). No method holds one table's lock while waiting for another table's
// exclusive lock. A caller that reads the table across several calls (the drafter, for a
// whole draft) holds read() and uses table() under it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/draft_view.h"
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

  // ---- writers (exclusive lock)

  // llama.cpp's update (CountTable::update) of the last n_new of tokens[0..n), checked:
  // n-gram sizes in 1..kNgramMax, 0 <= n_new <= n, every token in [0, vocab_limit).
  Status update(const Token* tokens, size_t n, int64_t n_new, int ngram_min, int ngram_max, uint32_t vocab_limit);
  // Adds `count` (1..2^32-1) to follower `token` (in [0, kMaxVocab)) of `key`, checked.
  Status add(const NGram& key, int64_t token, int64_t count);
  // Adds int32 count rows (see rows.h), all checked first; tokens must be < vocab_limit.
  Status add_rows(const int32_t* rows, size_t n, uint32_t vocab_limit);
  // Sets absolute counts from int64 rows (an upsert of each (n-gram, follower)); counts
  // above UINT32_MAX saturate. With `zero_removes`, a count of 0 removes the follower (a
  // draft view's change log); without it, 0 is refused like any count outside 1..2^63-1.
  Status assign_rows(const int64_t* rows, size_t n, uint32_t vocab_limit, bool zero_removes = false);
  // Adds every count of `other` (a table no other thread sees) to this table.
  void merge(const CountTable& other);
  // Adds every count of `other` (another shared table) to this table. `other` is copied under
  // its shared lock first, so the two locks are never held together.
  Status merge(const SharedCountTable& other);
  void clear();
  // Runs fn(CountTable&) under the exclusive lock, for a whole-table operation of the core
  // (a replay merging into the dynamic table). Keep it short: drafts wait for it.
  template <typename Fn>
  auto write(Fn&& fn) {
    std::lock_guard writer(write_mu_);
    std::unique_lock lock(mu_);
    return fn(table_);
  }

  // ---- readers (shared lock)

  size_t n_keys() const;
  size_t n_entries() const;
  size_t memory_bytes() const;
  Status check_integrity() const;
  // Every count as int32 rows (rows.h), appended to `out`.
  void to_rows(std::vector<int32_t>* out) const;
  // The followers of `key` (sorted by token) and their counts; both empty when it is absent.
  void lookup(const NGram& key, std::vector<Token>* tokens, std::vector<int64_t>* counts) const;
  // draft_view.h's view_diff of this table (the full counts) against `published` (another
  // table), for the keys of the int64 rows `changed` (n of them; null: every key), checked:
  // the tables differ, the policy is valid, the rows are valid keys. Appends to `out`.
  Status view_diff(const SharedCountTable& published, const int64_t* changed, size_t n, const ViewPolicy& policy,
                   std::vector<int64_t>* out) const;

 private:
  template <typename T, typename Apply>
  Status apply_rows(const T* rows, size_t n, uint32_t vocab_limit, int64_t min_count, int64_t max_count, Apply&& apply);

  mutable RwLock mu_;    // readers: drafts; writer: one chunk of a change set
  std::mutex write_mu_;  // serializes writers, so a change set's chunks are not interleaved
  CountTable table_;
};

}  // namespace ngc
