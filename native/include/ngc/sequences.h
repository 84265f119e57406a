// SequenceSet: the per-sequence context tables of one drafter, bounded, and the n-gram
// counts accepted since the last drain (the deltas a client pushes to the fleet).
//
// Bounds (SequenceLimits, each 0 = none): at most max_sequences sequences, each evicted
// after idle_ttl_ms without a draft or accept, and at most max_memory_bytes of context
// tables; over a bound the least recently used sequences are evicted (never the one being
// accepted). An evicted sequence starts again empty, as a reset() one does.
//
// Thread-safety: every method may be called from any thread. Calls for different sequences
// run in parallel: the sequences are spread over kShards maps, each with its own lock held
// only to find a sequence, and each sequence has its own lock. Calls for one sequence are
// serialized. Lock order: shard locks (in index order) before a sequence's lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/seq_index.h"
#include "ngc/status.h"

namespace ngc {

struct SequenceLimits {
  size_t max_sequences = 0;     // most sequences kept; 0 = unlimited
  int64_t idle_ttl_ms = 0;      // evict a sequence unused this long; 0 = never
  size_t max_memory_bytes = 0;  // most heap bytes of context tables; 0 = unlimited

  // The limits from a caller's units (a count, seconds, bytes; each 0 = none), checked: none
  // negative, the TTL finite. A TTL under a millisecond rounds up to one, never to "never".
  static Status from(int64_t max_sequences, double idle_ttl_seconds, int64_t max_memory, SequenceLimits* out);
};

class SequenceSet {
 public:
  // With index_sequences, each sequence also keeps a SeqIndex of its tokens (match mode).
  SequenceSet(int ngram_min, int ngram_max, bool track_deltas, SequenceLimits limits, bool index_sequences = false);

  // Counts the tokens of sequence `seq` that are new since its last accept: `tokens` is the
  // whole sequence so far, of which the first n_counted were counted before. Fails (and
  // changes nothing) when the sequence is shorter than what was counted, or when a token
  // that would be counted is outside [0, vocab).
  // `on_new`, when given, is called with the new tokens under the sequence's lock.
  Status accept(int64_t seq, const Token* tokens, size_t n_tokens, uint32_t vocab,
                const std::function<void(const Token*, size_t)>& on_new = nullptr);

  // Calls fn(const CountTable* context) with the context table of `seq` (null when the
  // sequence is unknown) held stable, and marks the sequence used. Returns fn's result.
  template <typename Fn>
  auto with_context(int64_t seq, Fn&& fn) const {
    return with_tables(seq, [&](const CountTable* context, const SeqIndex*) { return fn(context); });
  }
  // The same with fn(const CountTable* context, const SeqIndex* index) (index null unless
  // the set indexes sequences).
  template <typename Fn>
  auto with_tables(int64_t seq, Fn&& fn) const {
    std::shared_ptr<Seq> s = find(seq);
    if (!s) return fn(static_cast<const CountTable*>(nullptr), static_cast<const SeqIndex*>(nullptr));
    std::lock_guard lock(s->mu);
    s->last_used_ns.store(now_ns(), std::memory_order_relaxed);
    return fn(static_cast<const CountTable*>(&s->context), index_sequences_ ? &s->index : nullptr);
  }

  // How many tokens of `seq` have been counted (0 for an unknown sequence).
  size_t n_counted(int64_t seq) const;
  // Forgets `seq` (its context table and position); returns whether it existed.
  bool reset(int64_t seq);
  // Evicts every sequence idle longer than the TTL; returns how many were evicted.
  size_t evict_idle();

  size_t size() const;
  // Heap bytes of the context tables (tracked as they grow: O(1)).
  size_t memory_bytes() const { return bytes_.load(std::memory_order_relaxed); }
  // Sequences evicted by a bound since creation.
  uint64_t n_evicted() const { return n_evicted_.load(std::memory_order_relaxed); }
  const SequenceLimits& limits() const { return limits_; }

  // Moves the pending deltas out as count rows (rows.h) appended to `rows`, and clears them.
  void drain_deltas(std::vector<int32_t>* rows);
  // Occurrences pending (an upper bound of the rows the next drain returns).
  size_t pending_entries() const;

 private:
  struct alignas(64) Seq {                 // own cache lines: sequences of different threads never share one
    std::mutex mu;                         // guards context and n_counted
    CountTable context;                    // n-grams of this sequence's accepted tokens
    SeqIndex index;                        // their positions (match mode only)
    size_t n_counted = 0;                  // tokens of the sequence already counted
    size_t bytes = 0;                      // context.memory_bytes() at the last accept
    bool evicted = false;                  // erased from the set; an accept must start anew
    std::atomic<int64_t> last_used_ns{0};  // for LRU and TTL eviction
  };
  static int64_t now_ns();
  std::shared_ptr<Seq> find(int64_t seq) const;
  using Map = std::unordered_map<int64_t, std::shared_ptr<Seq>>;
  static constexpr size_t kShards = 64;
  struct alignas(64) Shard {
    mutable std::mutex mu;  // guards map (not the sequences' contents)
    Map map;
  };
  Shard& shard_of(int64_t seq) const {
    return shards_[(static_cast<uint64_t>(seq) * 0x9E3779B97F4A7C15ULL) >> 58];  // top 6 bits: 64 shards
  }
  // Evicts least recently used sequences (never `keep`) until the bounds hold. The caller
  // MUST hold no shard lock: it takes all of them, in order.
  void enforce_bounds(int64_t keep);
  bool over_bounds() const;
  // Erases `it` from `shard` (whose lock the caller holds).
  void erase_locked(Shard& shard, Map::iterator it);

  const int ngram_min_;
  const int ngram_max_;
  const bool track_deltas_;
  const bool index_sequences_;
  const SequenceLimits limits_;
  mutable Shard shards_[kShards];
  std::atomic<size_t> n_seqs_{0};
  std::atomic<size_t> bytes_{0};
  std::atomic<uint64_t> n_evicted_{0};
  // One (n-gram, follower) occurrence accepted since the last drain. Appending records is
  // several times cheaper than counting them in a hash table on every accept; drain sorts
  // and sums them once.
  struct Occurrence {
    NGram key;
    Token follower;
    bool operator<(const Occurrence& o) const {
      const int c = std::memcmp(key.tokens, o.key.tokens, sizeof(key.tokens));
      return c != 0 ? c < 0 : follower < o.follower;
    }
    bool same(const Occurrence& o) const { return key == o.key && follower == o.follower; }
  };
  // Records beyond which accept folds them into `folded_` (bounds memory between drains).
  static constexpr size_t kFoldAt = size_t{1} << 22;
  void fold_locked();

  mutable std::mutex pending_mu_;    // guards pending_ and folded_
  std::vector<Occurrence> pending_;  // occurrences accepted since the last drain (when track_deltas_)
  CountTable folded_;                // older occurrences of this drain period, counted
};

}  // namespace ngc
