#include "ngc/count_table.h"

#include <algorithm>
#include <string>

#include "ngc/rows.h"

namespace ngc {
namespace {

constexpr uint64_t kIndexMask = 0xFFFFFFFFULL;

inline uint64_t tag_of(uint64_t hash) { return hash & ~kIndexMask; }

}  // namespace

int64_t CountTable::find_index(const NGram& key, uint64_t hash) const {
  if (slots_.empty()) return -1;
  const size_t mask = slots_.size() - 1;
  const uint64_t tag = tag_of(hash);
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const uint64_t s = slots_[i];
    if (s == 0) return -1;
    if ((s & ~kIndexMask) == tag) {
      const int64_t idx = static_cast<int64_t>(s & kIndexMask) - 1;
      if (entries_[idx].key == key) return idx;
    }
  }
}

bool CountTable::find(const NGram& key, uint64_t hash, PartView* out) const {
  const int64_t idx = find_index(key, hash);
  if (idx < 0 || entries_[idx].followers.empty()) return false;
  *out = view(entries_[idx]);
  return true;
}

void CountTable::grow() {
  const size_t cap = slots_.empty() ? 16 : slots_.size() * 2;
  std::vector<uint64_t> slots(cap, 0);
  const size_t mask = cap - 1;
  for (size_t idx = 0; idx < entries_.size(); ++idx) {
    const uint64_t h = entries_[idx].key.hash();
    size_t i = h & mask;
    while (slots[i] != 0) i = (i + 1) & mask;
    slots[i] = tag_of(h) | (idx + 1);
  }
  slots_.swap(slots);
}

CountTable::Entry& CountTable::find_or_insert(const NGram& key) {
  const uint64_t h = key.hash();
  int64_t idx = find_index(key, h);
  if (idx < 0) {
    if ((entries_.size() + 1) * 10 > slots_.size() * 7) grow();
    idx = static_cast<int64_t>(entries_.size());
    entries_.push_back(Entry{key, 0, 0, {}});
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    while (slots_[i] != 0) i = (i + 1) & mask;
    slots_[i] = tag_of(h) | static_cast<uint64_t>(idx + 1);
  }
  return entries_[idx];
}

void CountTable::insert_follower(Entry& e, std::vector<Follower>::iterator it, Follower f) {
  const size_t before = e.followers.capacity();
  e.followers.insert(it, f);
  follower_bytes_ += (e.followers.capacity() - before) * sizeof(Follower);
  ++n_entries_;
}

void CountTable::add(const NGram& key, Token token, uint32_t count) {
  if (count == 0) return;
  Entry& e = find_or_insert(key);
  auto it = std::lower_bound(e.followers.begin(), e.followers.end(), token,
                             [](const Follower& f, Token t) { return f.token < t; });
  uint32_t now;
  if (it != e.followers.end() && it->token == token) {
    it->count = saturating_add(it->count, count);
    now = it->count;
  } else {
    insert_follower(e, it, Follower{token, count});
    now = count;
  }
  e.total += count;
  e.max_count = std::max(e.max_count, now);
}

void CountTable::set(const NGram& key, Token token, uint32_t count) {
  if (count == 0) {
    remove(key, token);
    return;
  }
  Entry& e = find_or_insert(key);
  auto it = std::lower_bound(e.followers.begin(), e.followers.end(), token,
                             [](const Follower& f, Token t) { return f.token < t; });
  if (it != e.followers.end() && it->token == token) {
    const uint32_t old = it->count;
    it->count = count;
    e.total = e.total - old + count;
    if (count >= e.max_count) {
      e.max_count = count;
    } else if (old == e.max_count) {  // the maximum went down: find the new one
      e.max_count = 0;
      for (const Follower& f : e.followers) e.max_count = std::max(e.max_count, f.count);
    }
  } else {
    insert_follower(e, it, Follower{token, count});
    e.total += count;
    e.max_count = std::max(e.max_count, count);
  }
}

void CountTable::remove(const NGram& key, Token token) {
  const int64_t idx = find_index(key, key.hash());
  if (idx < 0) return;
  Entry& e = entries_[idx];
  auto it = std::lower_bound(e.followers.begin(), e.followers.end(), token,
                             [](const Follower& f, Token t) { return f.token < t; });
  if (it == e.followers.end() || it->token != token) return;
  const uint32_t old = it->count;
  e.followers.erase(it);
  --n_entries_;
  e.total -= old;
  if (e.followers.empty()) {
    e.total = 0;  // a saturated total cannot be unwound exactly: an empty entry starts again at 0
    e.max_count = 0;
    follower_bytes_ -= e.followers.capacity() * sizeof(Follower);
    std::vector<Follower>().swap(e.followers);
  } else if (old == e.max_count) {
    e.max_count = 0;
    for (const Follower& f : e.followers) e.max_count = std::max(e.max_count, f.count);
  }
}

void CountTable::update(const Token* tokens, size_t n_tokens, size_t n_new, int ngram_min, int ngram_max) {
  const size_t first_new = n_new >= n_tokens ? 0 : n_tokens - n_new;
  for (int n = ngram_min; n <= ngram_max; ++n) {
    for (size_t i = std::max(first_new, static_cast<size_t>(n)); i < n_tokens; ++i) {
      add(NGram::from(tokens + i - n, n), tokens[i], 1);
    }
  }
}

void CountTable::merge(const CountTable& other) {
  for (const Entry& e : other.entries_) {
    for (const Follower& f : e.followers) add(e.key, f.token, f.count);
  }
}

void CountTable::clear() {
  entries_.clear();
  slots_.clear();
  n_entries_ = 0;
  follower_bytes_ = 0;
}

Status CountTable::check_integrity() const {
  size_t used = 0, n_entries = 0;
  for (uint64_t s : slots_) {
    if (s == 0) continue;
    ++used;
    const uint64_t idx = (s & kIndexMask) - 1;
    if (idx >= entries_.size()) return Status::FormatError("slot points past the entries");
    if (tag_of(entries_[idx].key.hash()) != (s & ~kIndexMask)) {
      return Status::FormatError("slot hash tag differs from its entry's key hash");
    }
  }
  if (used != entries_.size()) {
    return Status::FormatError("index holds " + std::to_string(used) + " slots for " + std::to_string(entries_.size()) +
                               " entries");
  }
  if (!slots_.empty() && entries_.size() * 10 > slots_.size() * 7) {
    return Status::FormatError("index load above 0.7");
  }
  for (size_t idx = 0; idx < entries_.size(); ++idx) {
    const Entry& e = entries_[idx];
    const int n = e.key.size();
    if (n < 1) return Status::FormatError("entry with an empty key");
    for (int i = n; i < kNgramMax; ++i) {
      if (e.key.tokens[i] != -1) return Status::FormatError("key has a token after its end marker");
    }
    if (find_index(e.key, e.key.hash()) != static_cast<int64_t>(idx)) {
      return Status::FormatError("key " + std::to_string(idx) + " is not found through the index");
    }
    uint64_t total = 0;
    uint32_t max_count = 0;
    for (size_t j = 0; j < e.followers.size(); ++j) {
      const Follower& f = e.followers[j];
      if (f.count == 0) return Status::FormatError("follower with count 0");
      if (f.token < 0) return Status::FormatError("follower with a negative token");
      if (j > 0 && e.followers[j - 1].token >= f.token) {
        return Status::FormatError("followers not strictly sorted by token");
      }
      total += f.count;
      max_count = std::max(max_count, f.count);
    }
    // A saturated count makes the sum of counts smaller than the total that was added.
    if (total > e.total || (total != e.total && max_count != UINT32_MAX)) {
      return Status::FormatError("entry total differs from the sum of its counts");
    }
    if (max_count != e.max_count) return Status::FormatError("entry max_count is stale");
    n_entries += e.followers.size();
  }
  if (n_entries != n_entries_) return Status::FormatError("entry count is stale");
  size_t follower_bytes = 0;
  for (const Entry& e : entries_) follower_bytes += e.followers.capacity() * sizeof(Follower);
  if (follower_bytes != follower_bytes_) return Status::FormatError("follower byte count is stale");
  return Status::Ok();
}

void CountTable::to_rows(std::vector<int32_t>* out) const {
  out->reserve(out->size() + n_entries() * rows::kWidth);
  for_each([&](const NGram& key, const PartView& part) {
    for (uint32_t j = 0; j < part.size; ++j) rows::append(out, key, part.followers[j].token, part.followers[j].count);
  });
}

}  // namespace ngc
