// Drafts from N native threads on disjoint sequences of one ngc::Drafter, with no Python in
// the loop: the core's own scaling. Built and run by bench_concurrency.py.
//
//   drafter_threads STATIC.ngc TOKENS.i32 OFFSETS.i64 THREADS POSITIONS REPS [private]
//
// With "private", each thread drafts with ngc::draft() over context tables of its own and
// no Drafter (no locks, no shared writes): the ideal scaling of the same work on this
// machine, the baseline the Drafter's scaling is measured against.
//
// TOKENS.i32 holds the held-out sequences back to back (int32), OFFSETS.i64 their starts
// plus the end. Each sequence accepts its first half; each thread then drafts (n_draft 8)
// at POSITIONS points of the second half of each of its sequences, REPS times. Prints
// "drafts_per_s=<x> checksum=<hex>" (the checksum covers every draft, in sequence order).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ngc/drafter.h"
#include "ngc/static_cache.h"

namespace {

template <typename T>
std::vector<T> read_all(const char* path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<T> v(static_cast<size_t>(f.tellg()) / sizeof(T));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

uint64_t mix(uint64_t h, uint64_t x) { return (h ^ x) * 0x100000001B3ULL; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s STATIC TOKENS OFFSETS THREADS POSITIONS REPS [private]\n", argv[0]);
    return 2;
  }
  std::unique_ptr<ngc::StaticCache> cache;
  ngc::Status s = ngc::StaticCache::open(argv[1], &cache);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return 1;
  }
  const std::vector<int32_t> tokens = read_all<int32_t>(argv[2]);
  const std::vector<int64_t> offsets = read_all<int64_t>(argv[3]);
  const int threads = std::stoi(argv[4]), positions = std::stoi(argv[5]), reps = std::stoi(argv[6]);
  const size_t n_seq = offsets.size() - 1;
  const bool private_tables = argc == 8 && std::string(argv[7]) == "private";

  ngc::DrafterOptions o;
  o.vocab_size = cache->info().vocab_size;
  std::copy(cache->info().fingerprint, cache->info().fingerprint + ngc::kFingerprintSize, o.fingerprint);
  ngc::Drafter d(o);
  const ngc::StaticCache* st = cache.get();
  if (!d.set_static(std::shared_ptr<const ngc::StaticCache>(std::move(cache))).ok()) return 1;
  std::vector<ngc::CountTable> contexts(private_tables ? n_seq : 0);
  d.set_dynamic(std::make_shared<ngc::SharedCountTable>());
  for (size_t i = 0; i < n_seq; ++i) {
    const size_t len = static_cast<size_t>(offsets[i + 1] - offsets[i]);
    if (private_tables) {
      contexts[i].update(tokens.data() + offsets[i], len / 2, len / 2, 1, 4);
    } else if (!d.accept(static_cast<int64_t>(i), tokens.data() + offsets[i], len / 2).ok()) {
      return 1;
    }
  }

  std::vector<uint64_t> digest(n_seq, 0);
  std::atomic<uint64_t> drafts{0};
  auto work = [&](int k) {
    const ngc::CountTable empty;  // the dynamic table, empty as the Drafter's
    int32_t out[8];
    uint64_t n = 0;
    for (int r = 0; r < reps; ++r) {
      for (size_t i = static_cast<size_t>(k); i < n_seq; i += static_cast<size_t>(threads)) {
        const int32_t* seq = tokens.data() + offsets[i];
        const size_t len = static_cast<size_t>(offsets[i + 1] - offsets[i]);
        uint64_t h = 0xCBF29CE484222325ULL;
        for (int p = 0; p < positions; ++p) {
          const size_t pos = len / 2 + (len - 1 - len / 2) * static_cast<size_t>(p) / static_cast<size_t>(positions - 1);
          int got = 0;
          if (private_tables) {
            ngc::DraftParams params;
            got = ngc::draft(seq, pos, &contexts[i], &empty, st, params, out);
          } else if (!d.draft(static_cast<int64_t>(i), seq, pos, 8, out, &got).ok()) {
            std::abort();
          }
          for (int j = 0; j < got; ++j) h = mix(h, static_cast<uint64_t>(out[j]));
          h = mix(h, 0xFFFFFFFFULL);
          ++n;
        }
        digest[i] = h;
      }
    }
    drafts += n;
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) pool.emplace_back(work, k);
  for (auto& t : pool) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t all = 0xCBF29CE484222325ULL;
  for (uint64_t h : digest) all = mix(all, h);
  std::printf("drafts_per_s=%.0f checksum=%016llx\n", static_cast<double>(drafts.load()) / secs,
              static_cast<unsigned long long>(all));
  return 0;
}
