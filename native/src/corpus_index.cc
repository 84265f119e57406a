// The corpus index (match.h): its longest-match search over SUFFIXES and BUCKETS, and its
// construction from a static generation's text.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ngc/match.h"

namespace ngc {

int corpus_matches(const CorpusIndex& ix, const Token* tail, size_t n, uint32_t max_length, CorpusMatch* runs) {
  if (ix.empty() || n == 0) return 0;
  const uint32_t t0 = static_cast<uint32_t>(tail[n - 1]);
  if (t0 >= ix.vocab) return 0;
  uint64_t lo = ix.buckets[t0], hi = ix.buckets[t0 + 1];
  if (lo >= hi || hi > ix.n_suffixes) return 0;  // none, or a damaged BUCKETS
  runs[1] = {1, lo, hi};
  const uint64_t limit = std::min<uint64_t>({max_length, ix.depth, n});
  uint64_t j = 1;
  for (; j < limit; ++j) {
    // The run is sorted by the token j places back (a separator above every token).
    const uint32_t want = static_cast<uint32_t>(tail[n - 1 - j]);
    auto back = [&](uint64_t i) { return ix.at(static_cast<int64_t>(ix.suffixes[i]) - static_cast<int64_t>(j)); };
    uint64_t a = lo, b = hi;
    while (a < b) {
      const uint64_t mid = a + (b - a) / 2;
      if (back(mid) < want)
        a = mid + 1;
      else
        b = mid;
    }
    const uint64_t first = a;
    // The end of the equal entries: gallop from `first` (the run narrows fast, so the
    // sub-run is usually short), then binary search the last gap.
    uint64_t step = 1;
    b = hi;
    while (a < hi && back(a) == want) {
      const uint64_t next = a + step;
      if (next >= hi || back(next) != want) {
        b = std::min(next, hi);
        break;
      }
      a = next + 1;
      step *= 2;
    }
    while (a < b) {
      const uint64_t mid = a + (b - a) / 2;
      if (back(mid) <= want)
        a = mid + 1;
      else
        b = mid;
    }
    if (a == first) break;
    lo = first;
    hi = a;
    runs[j + 1] = {static_cast<uint32_t>(j + 1), lo, hi};
  }
  return static_cast<int>(j);
}

CorpusMatch corpus_longest_match(const CorpusIndex& ix, const Token* tail, size_t n, uint32_t max_length) {
  CorpusMatch runs[format::kMaxIndexDepth + 1];
  const int deepest = corpus_matches(ix, tail, n, max_length, runs);
  return deepest > 0 ? runs[deepest] : CorpusMatch{};
}

void build_corpus_index(const std::vector<uint32_t>& text, uint32_t vocab, uint32_t depth, CorpusArrays* out) {
  constexpr uint32_t kEnd = format::kSeparator;  // ranks: the end of a stream is above every token
  const size_t n = text.size();
  std::vector<uint32_t> rank(n);
  size_t m = 0;
  for (size_t p = 0; p < n; ++p) {
    rank[p] = text[p];  // a token, or kEnd for a separator
    m += text[p] != kEnd;
  }
  struct Entry {
    uint64_t key;
    uint32_t pos;
    bool operator<(const Entry& o) const { return key != o.key ? key < o.key : pos < o.pos; }
  };
  std::vector<Entry> e(m);
  // Prefix doubling: after the round with step h, entries are sorted by their first 2h
  // tokens read backwards (a stream's start ends the string).
  for (uint64_t h = 1;; h *= 2) {
    size_t k = 0;
    int64_t last_sep = -1;
    for (size_t p = 0; p < n; ++p) {
      if (text[p] == kEnd) {
        last_sep = static_cast<int64_t>(p);
        continue;
      }
      const uint64_t in_stream =
          static_cast<uint64_t>(static_cast<int64_t>(p) - last_sep - 1);  // tokens before p in its stream
      const uint32_t second = in_stream >= h ? rank[p - h] : kEnd;
      e[k++] = {uint64_t{rank[p]} << 32 | second, static_cast<uint32_t>(p)};
    }
    std::sort(e.begin(), e.end());
    bool distinct = true;
    for (size_t i = 0; i < m; ++i) {
      if (i > 0 && e[i].key == e[i - 1].key) {
        rank[e[i].pos] = rank[e[i - 1].pos];
        distinct = false;
      } else {
        rank[e[i].pos] = static_cast<uint32_t>(i);
      }
    }
    if (distinct || 2 * h >= depth) break;
  }
  rank = std::vector<uint32_t>();
  out->suffixes.resize(m);
  out->buckets.assign(uint64_t{vocab} + 1, 0);
  for (size_t i = 0; i < m; ++i) {
    out->suffixes[i] = e[i].pos;
    ++out->buckets[text[e[i].pos] + 1];
  }
  for (uint32_t t = 0; t < vocab; ++t) out->buckets[t + 1] += out->buckets[t];
}

}  // namespace ngc
