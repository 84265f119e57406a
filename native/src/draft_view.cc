#include "ngc/draft_view.h"

#include <algorithm>
#include <string>

#include "ngc/rows.h"

namespace ngc {
namespace {

bool key_less(const NGram& a, const NGram& b) {
  return std::lexicographical_compare(a.tokens, a.tokens + kNgramMax, b.tokens, b.tokens + kNgramMax);
}

void emit(std::vector<int64_t>* out, const NGram& key, Token follower, uint64_t count) {
  out->push_back(key.size());
  for (int k = 0; k < kNgramMax; ++k) out->push_back(key.tokens[k]);
  out->push_back(follower);
  out->push_back(static_cast<int64_t>(count));
}

bool moved(uint32_t published, uint32_t now, uint32_t pct) {
  if (published == now) return false;
  const uint64_t diff = published > now ? published - now : now - published;
  return diff * 100 > static_cast<uint64_t>(pct) * published;
}

// The view of one key: its top_k followers of `full` by count (ties to the lowest token),
// by token, when its total reaches the policy's minimum; else none.
void desired(const CountTable& full, const NGram& key, const ViewPolicy& policy, std::vector<Follower>* want) {
  want->clear();
  PartView part;
  if (!full.find(key, &part) || part.total < policy.min_total[key.size() - 1]) return;
  want->assign(part.followers, part.followers + part.size);
  if (want->size() > policy.top_k) {
    std::nth_element(want->begin(), want->begin() + policy.top_k, want->end(),
                     [](const Follower& a, const Follower& b) {
                       return a.count != b.count ? a.count > b.count : a.token < b.token;
                     });
    want->resize(policy.top_k);
    std::sort(want->begin(), want->end(), [](const Follower& a, const Follower& b) { return a.token < b.token; });
  }
}

void diff_key(const CountTable& full, const CountTable& published, const NGram& key, const ViewPolicy& policy,
              std::vector<Follower>* want, std::vector<int64_t>* out) {
  desired(full, key, policy, want);
  PartView have;
  const Follower* h = nullptr;
  size_t nh = 0;
  if (published.find(key, &have)) {
    h = have.followers;
    nh = have.size;
  }
  size_t i = 0, j = 0;
  while (i < want->size() || j < nh) {
    if (j == nh || (i < want->size() && (*want)[i].token < h[j].token)) {
      emit(out, key, (*want)[i].token, (*want)[i].count);  // enters the view
      ++i;
    } else if (i == want->size() || h[j].token < (*want)[i].token) {
      emit(out, key, h[j].token, 0);  // leaves it
      ++j;
    } else {
      if (moved(h[j].count, (*want)[i].count, policy.min_change_pct)) emit(out, key, h[j].token, (*want)[i].count);
      ++i;
      ++j;
    }
  }
}

}  // namespace

Status ViewPolicy::validate() const {
  if (top_k < 1 || top_k > kMaxViewTopK) {
    return Status::InvalidArgument("top_k must be in 1.." + std::to_string(kMaxViewTopK) + ", got " +
                                   std::to_string(top_k));
  }
  for (int k = 0; k < kNgramMax; ++k) {
    if (min_total[k] < 1) return Status::InvalidArgument("min_total values must be >= 1");
  }
  return Status::Ok();
}

void view_diff(const CountTable& full, const CountTable& published, const int64_t* changed, size_t n,
               const ViewPolicy& policy, std::vector<int64_t>* out) {
  std::vector<NGram> keys;
  if (changed != nullptr) {
    keys.reserve(n);
    for (size_t i = 0; i < n; ++i) keys.push_back(rows::key_of(changed + rows::kWidth * i));
  } else {
    keys.reserve(full.n_keys() + published.n_keys());
    full.for_each([&](const NGram& k, const PartView&) { keys.push_back(k); });
    published.for_each([&](const NGram& k, const PartView&) { keys.push_back(k); });
  }
  std::sort(keys.begin(), keys.end(), key_less);
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  std::vector<Follower> want;
  for (const NGram& key : keys) diff_key(full, published, key, policy, &want, out);
}

}  // namespace ngc
