// SequenceSet: the per-sequence context tables of one drafter, and the n-gram counts
// accepted since the last drain (the deltas a client pushes to the fleet's dynamic table).
//
// Thread-safety: none; the owner serializes every call (the bindings hold a mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/status.h"

namespace ngc {

class SequenceSet {
 public:
  SequenceSet(int ngram_min, int ngram_max, bool track_deltas)
      : ngram_min_(ngram_min), ngram_max_(ngram_max), track_deltas_(track_deltas) {}

  // Counts the tokens of sequence `seq` that are new since its last accept: `tokens` is the
  // whole sequence so far, of which the first n_counted were counted before. Fails (and
  // changes nothing) when the sequence is shorter than what was counted.
  Status accept(int64_t seq, const Token* tokens, size_t n_tokens);

  // The context table of `seq`, or null when it has accepted nothing.
  const CountTable* context(int64_t seq) const;
  // How many tokens of `seq` have been counted (0 for an unknown sequence).
  size_t n_counted(int64_t seq) const;

  // Forgets `seq` (its context table and position); returns whether it existed.
  bool reset(int64_t seq);
  size_t size() const { return seqs_.size(); }

  // Moves the pending deltas out as rows (n, t0, t1, t2, t3, follower, count) appended to
  // `rows`, and clears them. Counts above INT32_MAX are split over several rows.
  void drain_deltas(std::vector<int32_t>* rows);
  size_t pending_entries() const { return pending_.n_entries(); }

 private:
  struct Seq {
    CountTable context;    // n-grams of this sequence's accepted tokens
    size_t n_counted = 0;  // tokens of the sequence already counted
  };
  int ngram_min_;
  int ngram_max_;
  bool track_deltas_;
  std::unordered_map<int64_t, std::unique_ptr<Seq>> seqs_;
  CountTable pending_;  // counts accepted since the last drain (when track_deltas_)
};

}  // namespace ngc
