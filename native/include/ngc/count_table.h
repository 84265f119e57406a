// CountTable: n-gram -> followers with counts, for the context and dynamic tables.
//
// Layout: a dense vector of entries (one per distinct n-gram, in insertion order) and an
// open-addressing index of 64-bit slots (linear probing, power-of-two capacity, load
// <= 0.7). A slot packs the upper 32 bits of the key's hash with entry index + 1, so a probe
// compares keys only when the hash tags agree. Keys are never deleted except by clear(), so
// probing needs no tombstones; set(key, token, 0) removes a follower, and a key left without
// followers is not found. Followers of an entry are kept sorted by token.
//
// Thread-safety: none. Concurrent readers are safe only while nobody writes; callers that
// share a table across threads MUST serialize writes against reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ngc/ngram.h"
#include "ngc/status.h"

namespace ngc {

// A read-only view of one n-gram's followers. The pointers are borrowed from the table:
// the view MUST NOT be used after the table is changed or destroyed.
struct PartView {
  const Follower* followers = nullptr;  // sorted by token, strictly increasing
  uint32_t size = 0;                    // number of followers (> 0 when found)
  uint64_t total = 0;                   // sum of the follower counts
  uint32_t max_count = 0;               // the largest follower count
};

class CountTable {
 public:
  CountTable() = default;

  // Finds `key`; returns false (and leaves `out` alone) when it has no followers.
  bool find(const NGram& key, PartView* out) const { return find(key, key.hash(), out); }
  // The same with the key's hash computed by the caller (key.hash()).
  bool find(const NGram& key, uint64_t hash, PartView* out) const;
  // Hints the CPU to load the index slot `hash` probes first, so several look-ups can
  // overlap their cache misses.
  void prefetch(uint64_t hash) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[hash & (slots_.size() - 1)]);
  }

  // Adds `count` (> 0) to follower `token` of `key`.
  void add(const NGram& key, Token token, uint32_t count);
  // Sets follower `token` of `key` to `count`, inserting it when absent: how a mirror
  // applies the absolute counts a store returns. A count of 0 removes the follower.
  void set(const NGram& key, Token token, uint32_t count);

  // Removes follower `token` of `key` when present (the key stays, without that follower).
  void remove(const NGram& key, Token token);

  // llama.cpp's common_ngram_cache_update: for each n in [ngram_min, ngram_max] and each
  // position i in [max(n_tokens - n_new, n), n_tokens), the key tokens[i-n..i-1] gains one
  // count for follower tokens[i]. The caller MUST pass 1 <= ngram_min <= ngram_max <= 4 and
  // tokens >= 0 (SharedCountTable::update checks both).
  void update(const Token* tokens, size_t n_tokens, size_t n_new, int ngram_min, int ngram_max);

  // Adds every count of `other` to this table (other may not be this table).
  void merge(const CountTable& other);

  void clear();

  size_t n_keys() const { return entries_.size(); }
  // The number of (n-gram, follower) pairs.
  size_t n_entries() const { return n_entries_; }
  // Bytes held on the heap by the table (index, entries and follower arrays); O(1).
  size_t memory_bytes() const {
    return slots_.capacity() * sizeof(uint64_t) + entries_.capacity() * sizeof(Entry) + follower_bytes_;
  }
  // Checks every invariant (index <-> entries, sorted followers, totals); O(size).
  Status check_integrity() const;
  // Every count as int32 count rows (rows.h), appended to `out`, keys in insertion order.
  void to_rows(std::vector<int32_t>* out) const;

  // Calls fn(const NGram&, const PartView&) for every n-gram with followers, in insertion order.
  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const Entry& e : entries_) {
      if (!e.followers.empty()) fn(e.key, view(e));
    }
  }

 private:
  struct Entry {
    NGram key;                        // the n-gram; unique in the table
    uint64_t total = 0;               // sum of followers[*].count
    uint32_t max_count = 0;           // max of followers[*].count
    std::vector<Follower> followers;  // sorted by token; counts > 0; empty after removals
  };

  static PartView view(const Entry& e) {
    return {e.followers.data(), static_cast<uint32_t>(e.followers.size()), e.total, e.max_count};
  }
  // The entry index of `key`, or -1.
  int64_t find_index(const NGram& key, uint64_t hash) const;
  // The entry of `key`, inserted (without followers) when absent.
  Entry& find_or_insert(const NGram& key);
  void grow();

  std::vector<Entry> entries_;   // dense, insertion order
  std::vector<uint64_t> slots_;  // (hash >> 32) << 32 | (entry index + 1); 0 = empty
  size_t n_entries_ = 0;         // sum of followers.size() over entries_
  size_t follower_bytes_ = 0;    // sum of followers.capacity() * sizeof(Follower) over entries_
  // Inserts follower `f` at `it` in `e`, keeping n_entries_ and follower_bytes_ exact.
  void insert_follower(Entry& e, std::vector<Follower>::iterator it, Follower f);
};

}  // namespace ngc
