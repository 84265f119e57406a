#include "ngc/sequences.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "ngc/rows.h"

namespace ngc {

SequenceSet::SequenceSet(int ngram_min, int ngram_max, bool track_deltas, SequenceLimits limits)
    : ngram_min_(ngram_min), ngram_max_(ngram_max), track_deltas_(track_deltas), limits_(limits) {}

int64_t SequenceSet::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::shared_ptr<SequenceSet::Seq> SequenceSet::find(int64_t seq) const {
  std::lock_guard lock(map_mu_);
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? nullptr : it->second;
}

Status SequenceSet::accept(int64_t seq, const Token* tokens, size_t n_tokens, uint32_t vocab) {
  for (;;) {
    std::shared_ptr<Seq> s = find(seq);
    if (!s) {
      // Check before creating, so a bad first call leaves nothing behind.
      for (size_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab) {
          return Status::InvalidArgument("tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                         " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        }
      }
      if (n_tokens == 0) return Status::Ok();
      std::lock_guard lock(map_mu_);
      auto [it, inserted] = seqs_.try_emplace(seq, nullptr);
      if (inserted) {
        it->second = std::make_shared<Seq>();
        it->second->last_used_ns.store(now_ns(), std::memory_order_relaxed);
      }
      s = it->second;
      if (inserted) enforce_bounds_locked(seq);
    }
    size_t grew = 0;
    {
      std::lock_guard lock(s->mu);
      if (s->evicted) continue;  // evicted between find() and here: start it again
      const size_t done = s->n_counted;
      if (n_tokens < done) {
        return Status::InvalidArgument("sequence " + std::to_string(seq) + " has " + std::to_string(n_tokens) +
                                       " tokens but " + std::to_string(done) +
                                       " were already accepted; pass the whole sequence, or reset() it first");
      }
      // The new tokens and the n-gram prefixes before them are read: check those.
      const size_t from = done >= static_cast<size_t>(kNgramMax) ? done - kNgramMax : 0;
      for (size_t i = from; i < n_tokens; ++i) {
        if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab) {
          return Status::InvalidArgument("tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                         " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        }
      }
      s->last_used_ns.store(now_ns(), std::memory_order_relaxed);
      if (n_tokens == done) return Status::Ok();
      const size_t n_new = n_tokens - done;
      s->context.update(tokens, n_tokens, n_new, ngram_min_, ngram_max_);
      s->n_counted = n_tokens;
      const size_t now = s->context.memory_bytes();
      grew = now - s->bytes;
      s->bytes = now;
      // Counted under the sequence's lock, so an eviction (which takes it) sees these bytes.
      bytes_.fetch_add(grew, std::memory_order_relaxed);
      if (track_deltas_) {
        std::lock_guard plock(pending_mu_);
        pending_.update(tokens, n_tokens, n_new, ngram_min_, ngram_max_);
      }
    }
    if (limits_.max_memory_bytes != 0 && memory_bytes() > limits_.max_memory_bytes) {
      std::lock_guard lock(map_mu_);
      enforce_bounds_locked(seq);
    }
    return Status::Ok();
  }
}

void SequenceSet::erase_locked(std::unordered_map<int64_t, std::shared_ptr<Seq>>::iterator it) {
  size_t b;
  {
    std::lock_guard lock(it->second->mu);  // waits for a call in flight on it
    b = it->second->bytes;
    it->second->bytes = 0;
    it->second->evicted = true;
  }
  bytes_.fetch_sub(b, std::memory_order_relaxed);
  seqs_.erase(it);
}

void SequenceSet::enforce_bounds_locked(int64_t keep) {
  const bool over_count = limits_.max_sequences != 0 && seqs_.size() > limits_.max_sequences;
  const bool over_bytes = limits_.max_memory_bytes != 0 && memory_bytes() > limits_.max_memory_bytes;
  if (!over_count && !over_bytes) return;
  // Least recently used first; one sort for however many evictions are needed.
  std::vector<std::pair<int64_t, int64_t>> order;  // (last used, sequence id)
  order.reserve(seqs_.size());
  for (const auto& [id, s] : seqs_) {
    if (id != keep) order.emplace_back(s->last_used_ns.load(std::memory_order_relaxed), id);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [used, id] : order) {
    const bool count_ok = limits_.max_sequences == 0 || seqs_.size() <= limits_.max_sequences;
    const bool bytes_ok = limits_.max_memory_bytes == 0 || memory_bytes() <= limits_.max_memory_bytes;
    if (count_ok && bytes_ok) break;
    erase_locked(seqs_.find(id));
    n_evicted_.fetch_add(1, std::memory_order_relaxed);
  }
}

size_t SequenceSet::evict_idle() {
  if (limits_.idle_ttl_ms <= 0) return 0;
  const int64_t cutoff = now_ns() - limits_.idle_ttl_ms * 1'000'000;
  std::lock_guard lock(map_mu_);
  size_t n = 0;
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    auto next = std::next(it);
    if (it->second->last_used_ns.load(std::memory_order_relaxed) < cutoff) {
      erase_locked(it);
      ++n;
    }
    it = next;
  }
  n_evicted_.fetch_add(n, std::memory_order_relaxed);
  return n;
}

size_t SequenceSet::n_counted(int64_t seq) const {
  std::shared_ptr<Seq> s = find(seq);
  if (!s) return 0;
  std::lock_guard lock(s->mu);
  return s->n_counted;
}

bool SequenceSet::reset(int64_t seq) {
  std::lock_guard lock(map_mu_);
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return false;
  erase_locked(it);
  return true;
}

size_t SequenceSet::size() const {
  std::lock_guard lock(map_mu_);
  return seqs_.size();
}

void SequenceSet::drain_deltas(std::vector<int32_t>* out) {
  CountTable drained;
  {
    std::lock_guard lock(pending_mu_);
    std::swap(drained, pending_);
  }
  drained.for_each([&](const NGram& key, const PartView& part) {
    for (uint32_t j = 0; j < part.size; ++j) rows::append(out, key, part.followers[j].token, part.followers[j].count);
  });
}

size_t SequenceSet::pending_entries() const {
  std::lock_guard lock(pending_mu_);
  return pending_.n_entries();
}

}  // namespace ngc
