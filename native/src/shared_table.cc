#include "ngc/shared_table.h"

#include <algorithm>
#include <string>

#include "ngc/draft_params.h"
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

Status SharedCountTable::update(const Token* tokens, size_t n, int64_t n_new, int ngram_min, int ngram_max,
                                uint32_t vocab_limit) {
  NGC_RETURN_IF_ERROR(check_ngram_range(ngram_min, ngram_max));
  if (n_new < 0 || static_cast<size_t>(n_new) > n) {
    return Status::InvalidArgument("n_new must be in [0, len(tokens)], got " + std::to_string(n_new));
  }
  NGC_RETURN_IF_ERROR(check_tokens(tokens, n, vocab_limit, "tokens"));
  write([&](CountTable& t) { t.update(tokens, n, static_cast<size_t>(n_new), ngram_min, ngram_max); });
  return Status::Ok();
}

Status SharedCountTable::add(const NGram& key, int64_t token, int64_t count) {
  if (token < 0 || token >= kMaxVocab) {
    return Status::InvalidArgument("follower token must be in [0, " + std::to_string(kMaxVocab) + "), got " +
                                   std::to_string(token));
  }
  if (count <= 0 || count > UINT32_MAX) {
    return Status::InvalidArgument("count must be in [1, 2^32), got " + std::to_string(count));
  }
  write([&](CountTable& t) { t.add(key, static_cast<Token>(token), static_cast<uint32_t>(count)); });
  return Status::Ok();
}

Status SharedCountTable::add_rows(const int32_t* rows, size_t n, uint32_t vocab_limit) {
  return apply_rows(rows, n, vocab_limit, 1, INT32_MAX,
                    [this](const NGram& key, Token f, int32_t c) { table_.add(key, f, static_cast<uint32_t>(c)); });
}

Status SharedCountTable::assign_rows(const int64_t* rows, size_t n, uint32_t vocab_limit, bool zero_removes) {
  return apply_rows(rows, n, vocab_limit, zero_removes ? 0 : 1, INT64_MAX,
                    [this](const NGram& key, Token f, int64_t c) {
                      table_.set(key, f, static_cast<uint32_t>(std::min<int64_t>(c, UINT32_MAX)));
                    });
}

void SharedCountTable::merge(const CountTable& other) {
  write([&](CountTable& t) { t.merge(other); });
}

Status SharedCountTable::merge(const SharedCountTable& other) {
  if (&other == this) return Status::InvalidArgument("cannot merge a table into itself");
  CountTable copy;
  {
    auto lock = other.read();
    copy = other.table_;
  }
  merge(copy);
  return Status::Ok();
}

void SharedCountTable::clear() {
  write([](CountTable& t) { t.clear(); });
}

size_t SharedCountTable::n_keys() const {
  auto lock = read();
  return table_.n_keys();
}

size_t SharedCountTable::n_entries() const {
  auto lock = read();
  return table_.n_entries();
}

size_t SharedCountTable::memory_bytes() const {
  auto lock = read();
  return table_.memory_bytes();
}

Status SharedCountTable::check_integrity() const {
  auto lock = read();
  return table_.check_integrity();
}

void SharedCountTable::to_rows(std::vector<int32_t>* out) const {
  auto lock = read();
  table_.to_rows(out);
}

void SharedCountTable::lookup(const NGram& key, std::vector<Token>* tokens, std::vector<int64_t>* counts) const {
  tokens->clear();
  counts->clear();
  auto lock = read();
  PartView part;
  if (!table_.find(key, &part)) return;
  tokens->reserve(part.size);
  counts->reserve(part.size);
  for (uint32_t j = 0; j < part.size; ++j) {
    tokens->push_back(part.followers[j].token);
    counts->push_back(part.followers[j].count);
  }
}

Status SharedCountTable::view_diff(const SharedCountTable& published, const int64_t* changed, size_t n,
                                   const ViewPolicy& policy, std::vector<int64_t>* out) const {
  if (&published == this) return Status::InvalidArgument("the published view must be another table");
  NGC_RETURN_IF_ERROR(policy.validate());
  if (changed != nullptr) NGC_RETURN_IF_ERROR(rows::validate_all(changed, n, kMaxVocab, INT64_MAX, 0));
  // Two shared locks: writers of either table never wait for the other's, so no cycle.
  auto full_lock = read();
  auto published_lock = published.read();
  ngc::view_diff(table_, published.table_, changed, n, policy, out);
  return Status::Ok();
}

}  // namespace ngc
