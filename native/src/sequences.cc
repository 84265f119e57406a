#include "ngc/sequences.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "ngc/rows.h"

namespace ngc {

Status SequenceLimits::from(int64_t max_sequences, double idle_ttl_seconds, int64_t max_memory, SequenceLimits* out) {
  if (max_sequences < 0) {
    return Status::InvalidArgument("max_sequences must be >= 0 (0: unlimited), got " + std::to_string(max_sequences));
  }
  // Written so that NaN fails too; the bound keeps the milliseconds within int64.
  if (!(idle_ttl_seconds >= 0) || idle_ttl_seconds > 1e9) {
    return Status::InvalidArgument("idle_ttl must be a number of seconds >= 0 (0: never), got " +
                                   std::to_string(idle_ttl_seconds));
  }
  if (max_memory < 0)
    return Status::InvalidArgument("max_memory must be >= 0 bytes (0: unlimited), got " + std::to_string(max_memory));
  out->max_sequences = static_cast<size_t>(max_sequences);
  out->idle_ttl_ms = static_cast<int64_t>(idle_ttl_seconds * 1000.0);
  if (idle_ttl_seconds > 0 && out->idle_ttl_ms == 0) out->idle_ttl_ms = 1;
  out->max_memory_bytes = static_cast<size_t>(max_memory);
  return Status::Ok();
}

SequenceSet::SequenceSet(int ngram_min, int ngram_max, bool track_deltas, SequenceLimits limits, bool index_sequences)
    : ngram_min_(ngram_min),
      ngram_max_(ngram_max),
      track_deltas_(track_deltas),
      index_sequences_(index_sequences),
      limits_(limits) {}

int64_t SequenceSet::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::shared_ptr<SequenceSet::Seq> SequenceSet::find(int64_t seq) const {
  Shard& sh = shard_of(seq);
  std::lock_guard lock(sh.mu);
  auto it = sh.map.find(seq);
  return it == sh.map.end() ? nullptr : it->second;
}

Status SequenceSet::accept(int64_t seq, const Token* tokens, size_t n_tokens, uint32_t vocab,
                           const std::function<void(const Token*, size_t)>& on_new) {
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
      bool inserted;
      {
        Shard& sh = shard_of(seq);
        std::lock_guard lock(sh.mu);
        auto it = sh.map.try_emplace(seq, nullptr).first;
        inserted = it->second == nullptr;
        if (inserted) {
          it->second = std::make_shared<Seq>();
          it->second->last_used_ns.store(now_ns(), std::memory_order_relaxed);
          n_seqs_.fetch_add(1, std::memory_order_relaxed);
        }
        s = it->second;
      }
      if (inserted && over_bounds()) enforce_bounds(seq);
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
      if (index_sequences_) s->index.extend(tokens, n_tokens);
      s->n_counted = n_tokens;
      if (on_new) on_new(tokens + done, n_new);
      const size_t now = s->context.memory_bytes() + s->index.memory_bytes();
      grew = now - s->bytes;
      s->bytes = now;
      // Counted under the sequence's lock, so an eviction (which takes it) sees these bytes.
      bytes_.fetch_add(grew, std::memory_order_relaxed);
      if (track_deltas_) {
        std::lock_guard plock(pending_mu_);
        const size_t first_new = n_tokens - n_new;
        for (int k = ngram_min_; k <= ngram_max_; ++k) {
          for (size_t i = std::max(first_new, static_cast<size_t>(k)); i < n_tokens; ++i) {
            pending_.push_back({NGram::from(tokens + i - k, k), tokens[i]});
          }
        }
        if (pending_.size() >= kFoldAt) fold_locked();
      }
    }
    if (over_bounds()) enforce_bounds(seq);
    return Status::Ok();
  }
}

void SequenceSet::erase_locked(Shard& shard, Map::iterator it) {
  size_t b;
  {
    std::lock_guard lock(it->second->mu);  // waits for a call in flight on it
    b = it->second->bytes;
    it->second->bytes = 0;
    it->second->evicted = true;
  }
  bytes_.fetch_sub(b, std::memory_order_relaxed);
  n_seqs_.fetch_sub(1, std::memory_order_relaxed);
  shard.map.erase(it);
}

bool SequenceSet::over_bounds() const {
  return (limits_.max_sequences != 0 && n_seqs_.load(std::memory_order_relaxed) > limits_.max_sequences) ||
         (limits_.max_memory_bytes != 0 && memory_bytes() > limits_.max_memory_bytes);
}

void SequenceSet::enforce_bounds(int64_t keep) {
  std::unique_lock<std::mutex> locks[kShards];
  for (size_t i = 0; i < kShards; ++i) locks[i] = std::unique_lock(shards_[i].mu);
  if (!over_bounds()) return;
  // Least recently used first; one sort for however many evictions are needed.
  std::vector<std::pair<int64_t, int64_t>> order;  // (last used, sequence id)
  order.reserve(n_seqs_.load(std::memory_order_relaxed));
  for (const Shard& sh : shards_) {
    for (const auto& [id, s] : sh.map) {
      if (id != keep) order.emplace_back(s->last_used_ns.load(std::memory_order_relaxed), id);
    }
  }
  std::sort(order.begin(), order.end());
  for (const auto& [used, id] : order) {
    if (!over_bounds()) break;
    Shard& sh = shard_of(id);
    erase_locked(sh, sh.map.find(id));
    n_evicted_.fetch_add(1, std::memory_order_relaxed);
  }
}

size_t SequenceSet::evict_idle() {
  if (limits_.idle_ttl_ms <= 0) return 0;
  const int64_t cutoff = now_ns() - limits_.idle_ttl_ms * 1'000'000;
  size_t n = 0;
  for (Shard& sh : shards_) {
    std::lock_guard lock(sh.mu);
    for (auto it = sh.map.begin(); it != sh.map.end();) {
      auto next = std::next(it);
      if (it->second->last_used_ns.load(std::memory_order_relaxed) < cutoff) {
        erase_locked(sh, it);
        ++n;
      }
      it = next;
    }
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
  Shard& sh = shard_of(seq);
  std::lock_guard lock(sh.mu);
  auto it = sh.map.find(seq);
  if (it == sh.map.end()) return false;
  erase_locked(sh, it);
  return true;
}

size_t SequenceSet::size() const { return n_seqs_.load(std::memory_order_relaxed); }

void SequenceSet::fold_locked() {
  for (const Occurrence& o : pending_) folded_.add(o.key, o.follower, 1);
  pending_.clear();
}

void SequenceSet::drain_deltas(std::vector<int32_t>* out) {
  std::vector<Occurrence> drained;
  CountTable folded;
  {
    std::lock_guard lock(pending_mu_);
    std::swap(drained, pending_);
    std::swap(folded, folded_);
  }
  if (folded.n_entries() > 0) {  // rare: more than kFoldAt occurrences between two drains
    for (const Occurrence& o : drained) folded.add(o.key, o.follower, 1);
    folded.for_each([&](const NGram& key, const PartView& part) {
      for (uint32_t j = 0; j < part.size; ++j) rows::append(out, key, part.followers[j].token, part.followers[j].count);
    });
    return;
  }
  std::sort(drained.begin(), drained.end());
  for (size_t i = 0; i < drained.size();) {
    size_t j = i + 1;
    while (j < drained.size() && drained[j].same(drained[i])) ++j;
    rows::append(out, drained[i].key, drained[i].follower, j - i);
    i = j;
  }
}

size_t SequenceSet::pending_entries() const {
  std::lock_guard lock(pending_mu_);
  return pending_.size() + folded_.n_entries();
}

}  // namespace ngc
