// libFuzzer target: StaticCache::open, verify() and every look-up on arbitrary bytes.
//
// Each input is tried twice:
//   1. as given: most mutations stop at the header checksum, which is what a damaged file
//      does in the field;
//   2. sealed (seal.h): the header checksum and every in-bounds section checksum
//      recomputed, so the mutations reach the structural checks behind them.
// After a successful open every reader path runs (key_at over all keys, find on keys from
// the file and from the input, token_at/count_at/count_of, followers_of, and for a
// version-2 file the corpus index's longest matches, drafts and trees). When verify()
// accepts the file, the readers must also agree with each other (see check_consistent).
//
// Out-of-bounds reads of the mapping: ASan does not see into mmap'd memory, so the
// target is linked with -Wl,--wrap=mmap,--wrap=munmap and the core's mapping of the
// fuzz input becomes a heap copy of exactly the file's size. After open() returns, the
// bytes outside the sections (header, section table, padding) are poisoned too: no
// reader may touch them once the header has been parsed.

#include <sanitizer/asan_interface.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz_support.h"
#include "ngc/match.h"
#include "ngc/static_cache.h"
#include "ngc/static_format.h"
#include "seal.h"

namespace {

using ngc::fuzz::le32;

// --- the mmap of the fuzz input, as a heap block ASan can check -------------------------

bool g_intercept = false;          // true while StaticCache::open runs on the fuzz input
const uint8_t* g_block = nullptr;  // the heap copy standing in for the mapping, or null
size_t g_block_size = 0;           // its size (== the file size)
uint64_t g_intercepted = 0;        // mappings replaced so far (sanity check)

}  // namespace

extern "C" void* __real_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off);
extern "C" int __real_munmap(void* addr, size_t len);

extern "C" void* __wrap_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  if (!g_intercept || fd < 0 || addr != nullptr || g_block != nullptr)
    return __real_mmap(addr, len, prot, flags, fd, off);
  auto* p = static_cast<uint8_t*>(std::malloc(len == 0 ? 1 : len));
  size_t done = 0;
  while (done < len) {
    const ssize_t r = ::pread(fd, p + done, len - done, off + static_cast<off_t>(done));
    if (r <= 0) {
      std::free(p);
      errno = EIO;
      return MAP_FAILED;
    }
    done += static_cast<size_t>(r);
  }
  g_block = p;
  g_block_size = len;
  ++g_intercepted;
  return p;
}

extern "C" int __wrap_munmap(void* addr, size_t len) {
  if (addr != nullptr && addr == g_block) {
    NGC_FUZZ_CHECK(len == g_block_size);
    ASAN_UNPOISON_MEMORY_REGION(g_block, g_block_size);
    std::free(const_cast<uint8_t*>(g_block));
    g_block = nullptr;
    g_block_size = 0;
    return 0;
  }
  return __real_munmap(addr, len);
}

namespace {

// --- the target ---------------------------------------------------------------------------

bool same_part(const ngc::StaticPart& a, const ngc::StaticPart& b) {
  return a.followers == b.followers && a.size == b.size && a.total == b.total && a.first == b.first;
}

// Reads every follower of `part` through every accessor; returns the sum of the counts.
uint64_t read_part(const ngc::StaticCache& c, const ngc::StaticPart& part) {
  uint64_t sum = 0;
  for (uint32_t j = 0; j < part.size; ++j) {
    sum += c.count_at(part, j);
    (void)c.count_of(part, c.token_at(part, j));
  }
  (void)c.count_of(part, -1);
  (void)c.count_of(part, static_cast<ngc::Token>(c.info().vocab_size));
  return sum;
}

// The corpus index's readers (version 2): longest matches, drafts and trees over tails
// taken from the input (reduced into the vocabulary) and from TEXT itself.
void exercise_corpus(const ngc::StaticCache& c, const uint8_t* data, size_t size) {
  const ngc::CorpusIndex& ix = c.corpus();
  if (ix.empty()) return;
  const uint32_t V = c.info().vocab_size;
  ngc::MatchTables tables;
  tables.static_cache = &c;
  ngc::MatchParams params;
  params.n_draft = 8;
  ngc::DraftTree tree;
  std::vector<ngc::Token> tail;
  for (size_t at = 0, n = 0; at + 4 <= size && n < 16; at += 37, ++n) {
    tail.clear();
    for (size_t j = at; j + 4 <= size && tail.size() < 12; j += 4)
      tail.push_back(static_cast<ngc::Token>(le32(data + j) % V));
    const ngc::CorpusMatch m = ngc::corpus_longest_match(ix, tail.data(), tail.size(), ix.depth);
    NGC_FUZZ_CHECK(m.length <= tail.size() && m.length <= ix.depth && m.lo <= m.hi && m.hi <= ix.n_suffixes);
    ngc::Token out[8];
    NGC_FUZZ_CHECK(ngc::draft_match(tail.data(), tail.size(), tables, params, out) <= 8);
    NGC_FUZZ_CHECK(ngc::draft_tree(tail.data(), tail.size(), tables, params, 8, &tree) <= 8);
  }
}

// Every reader on a file that opened: never an out-of-bounds read, whatever the sections hold.
void exercise(const ngc::StaticCache& c, const uint8_t* data, size_t size) {
  const ngc::StaticInfo& info = c.info();
  for (uint64_t i = 0; i < info.n_keys; ++i) {
    ngc::NGram key;
    ngc::StaticPart part;
    (void)c.followers_of(i);
    if (!c.key_at(i, &key, &part).ok()) continue;
    read_part(c, part);
    c.prefetch(key.tokens);
    ngc::StaticPart found;
    if (c.find(key.tokens, &found) == ngc::FindResult::kFound) read_part(c, found);
  }
  ngc::NGram key;
  ngc::StaticPart part;
  NGC_FUZZ_CHECK(!c.key_at(info.n_keys, &key, &part).ok());
  // Keys taken from the input itself: raw (mostly outside the vocabulary) and reduced
  // into it (mostly real rows).
  const uint32_t V = info.vocab_size;
  for (size_t at = 0, n = 0; at + 16 <= size && n < 64; at += 16, ++n) {
    ngc::Token raw[4], reduced[4];
    for (int j = 0; j < 4; ++j) {
      raw[j] = static_cast<ngc::Token>(le32(data + at + 4 * j));
      reduced[j] = static_cast<ngc::Token>(le32(data + at + 4 * j) % (V + 1));
    }
    for (const ngc::Token* k : {raw, reduced}) {
      ngc::StaticPart found;
      if (c.find(k, &found) == ngc::FindResult::kFound) read_part(c, found);
    }
  }
  exercise_corpus(c, data, size);
}

// What verify() promises: on a file it accepts, the readers agree with each other.
void check_consistent(const ngc::StaticCache& c) {
  const ngc::StaticInfo& info = c.info();
  const uint32_t V = info.vocab_size, k = info.ngram_size;
  ngc::NGram prev;
  for (uint64_t i = 0; i < info.n_keys; ++i) {
    ngc::NGram key;
    ngc::StaticPart part;
    NGC_FUZZ_CHECK(c.key_at(i, &key, &part).ok());
    for (uint32_t j = 0; j < k; ++j) NGC_FUZZ_CHECK(key.tokens[j] >= 0 && static_cast<uint32_t>(key.tokens[j]) < V);
    NGC_FUZZ_CHECK(key.size() == static_cast<int>(k));
    if (i > 0) {
      // Keys are strictly increasing in file order.
      bool less = false;
      for (uint32_t j = 0; j < k; ++j) {
        if (prev.tokens[j] != key.tokens[j]) {
          less = prev.tokens[j] < key.tokens[j];
          break;
        }
      }
      NGC_FUZZ_CHECK(less);
    }
    prev = key;
    NGC_FUZZ_CHECK(part.size >= 1);
    NGC_FUZZ_CHECK(c.followers_of(i) == part.size);
    uint64_t total = 0;
    const uint32_t best = c.count_at(part, 0);
    for (uint32_t j = 0; j < part.size; ++j) {
      const ngc::Token t = c.token_at(part, j);
      const uint32_t n = c.count_at(part, j);
      NGC_FUZZ_CHECK(t >= 0 && static_cast<uint32_t>(t) < V);
      NGC_FUZZ_CHECK(n >= 1);
      NGC_FUZZ_CHECK(c.count_of(part, t) == n);
      if (j >= 1) NGC_FUZZ_CHECK(n < best || (n == best && t > c.token_at(part, 0)));
      if (j >= 2) NGC_FUZZ_CHECK(c.token_at(part, j - 1) < t);
      total += n;
    }
    NGC_FUZZ_CHECK(std::min<uint64_t>(total, UINT32_MAX) == part.total);
    ngc::StaticPart found;
    NGC_FUZZ_CHECK(c.find(key.tokens, &found) == ngc::FindResult::kFound);
    NGC_FUZZ_CHECK(same_part(found, part));
  }
  // A verified index finds every string of its text: the tail ending at each token
  // position (within its stream, at most the depth) matches at least that long.
  const ngc::CorpusIndex& ix = c.corpus();
  for (uint64_t p = 0; p < ix.n_text && p < 256; ++p) {
    if (ix.text[p] == ngc::format::kSeparator) continue;
    std::vector<ngc::Token> tail;
    for (uint64_t q = p + 1; q-- > 0 && ix.text[q] != ngc::format::kSeparator && tail.size() < ix.depth;) {
      tail.insert(tail.begin(), static_cast<ngc::Token>(ix.text[q]));
    }
    const ngc::CorpusMatch m = ngc::corpus_longest_match(ix, tail.data(), tail.size(), ix.depth);
    NGC_FUZZ_CHECK(m.length == tail.size() && m.hi > m.lo);
  }
}

void check_file(ngc::fuzz::MemFile& file, const uint8_t* data, size_t size) {
  const std::string& path = file.write(data, size);
  std::unique_ptr<ngc::StaticCache> cache;
  g_intercept = true;
  const ngc::Status s = ngc::StaticCache::open(path, &cache);
  g_intercept = false;
  if (!s.ok()) {
    NGC_FUZZ_CHECK(cache == nullptr && !s.message().empty());
    NGC_FUZZ_CHECK(g_block == nullptr);  // a failed open unmaps what it mapped
    return;
  }
  if (g_intercepted == 0 || g_block == nullptr) {
    ngc::fuzz::invariant_failed(
        "the core's mmap was not intercepted: out-of-bounds reads of the mapping would go unseen");
  }
  NGC_FUZZ_CHECK(cache->mapped_bytes() == size && g_block_size == size);
  // From here on only the sections are readable.
  ASAN_POISON_MEMORY_REGION(g_block, g_block_size);
  const ngc::StaticInfo& info = cache->info();
  for (uint32_t i = 0; i < info.n_sections; ++i)
    ASAN_UNPOISON_MEMORY_REGION(g_block + info.sections[i].offset, info.sections[i].length);

  const bool verified = cache->verify().ok();
  exercise(*cache, data, size);
  if (verified) check_consistent(*cache);
  cache.reset();
  NGC_FUZZ_CHECK(g_block == nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ngc::fuzz::MemFile file("ngc-static");
  check_file(file, data, size);
  std::vector<uint8_t> sealed(data, data + size);
  if (ngc::fuzz::seal(sealed) && std::memcmp(sealed.data(), data, size) != 0)
    check_file(file, sealed.data(), sealed.size());
  return 0;
}
