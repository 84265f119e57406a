// Concurrent drafting and count-table updates, compared with a serial run of the same
// operations: built with -fsanitize=thread by tests/unit/test_sanitizers.py, which runs it
// and fails on any ThreadSanitizer report or any difference printed here.
//
//   concurrency_check SCRATCH_DIR
//
// 1. Drafter: 4 threads accept and draft 8 sequences (two each, interleaved), while 2 writers
//    add count rows to the shared dynamic table, one thread swaps the static cache for a
//    newer generation of the same counts and one reads the dynamic table. The writers' keys
//    use tokens the sequences never hold, so each draft MUST equal the serial run's, and the
//    dynamic table MUST end with exactly the counts of the rows added serially.
// 2. Match mode: the same in the match mode, whose accepts all feed one shared history. Its
//    drafts depend on the order of other sequences' accepts (and the history's size on where
//    one source's piece follows another's), so only the dynamic table is compared; the run
//    is there for ThreadSanitizer.
// 3. SharedCountTable: 4 threads update it from streams of their own and one merges another
//    shared table in, while 2 readers look keys up (a count never goes down). The table MUST
//    end equal to a CountTable that made the same updates serially.
//
// Prints one "ok: ..." line and exits 0, or prints the first difference and exits 1.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ngc/builder.h"
#include "ngc/count_table.h"
#include "ngc/drafter.h"
#include "ngc/ngram.h"
#include "ngc/rows.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"

namespace {

using ngc::Token;

constexpr uint32_t kVocab = 64;
constexpr int kSequences = 8;
constexpr size_t kLength = 600;
constexpr Token kSequenceTokens = 7;  // sequences hold tokens 0..6; the writers' keys 16..63
constexpr int kDrafterThreads = 4;

[[noreturn]] void fail(const std::string& what) {
  std::printf("FAILED: %s\n", what.c_str());
  std::exit(1);
}

void check(const ngc::Status& s, const char* what) {
  if (!s.ok()) fail(std::string(what) + ": " + s.message());
}

// A deterministic stream of n tokens in [0, mod).
std::vector<Token> stream(uint64_t seed, size_t n, Token mod) {
  std::vector<Token> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (Token& t : out) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t = static_cast<Token>((x >> 33) % static_cast<uint64_t>(mod));
  }
  return out;
}

// Every row of `table`, sorted (to_rows follows insertion order, which threads change).
std::vector<std::array<int32_t, ngc::rows::kWidth>> sorted_rows(const ngc::CountTable& table) {
  std::vector<int32_t> flat;
  table.to_rows(&flat);
  std::vector<std::array<int32_t, ngc::rows::kWidth>> rows(flat.size() / ngc::rows::kWidth);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(flat.data() + i * ngc::rows::kWidth, ngc::rows::kWidth, rows[i].data());
  std::sort(rows.begin(), rows.end());
  return rows;
}

std::vector<std::array<int32_t, ngc::rows::kWidth>> sorted_rows(const ngc::SharedCountTable& table) {
  auto lock = table.read();
  return sorted_rows(table.table());
}

// The row batches a writer adds: keys of 1..2 tokens in [16, kVocab), never in a sequence.
std::vector<std::vector<int32_t>> writer_batches(uint64_t seed) {
  std::vector<std::vector<int32_t>> batches(40);
  uint64_t k = 0;
  for (auto& batch : batches) {
    const std::vector<Token> t = stream(seed * 1000 + k++, 200 * 4, kVocab - 16);
    for (size_t r = 0; r < 200; ++r) {
      const int n = 1 + static_cast<int>(t[4 * r] % 2);
      batch.insert(batch.end(), {n, 16 + t[4 * r + 1], n == 2 ? 16 + t[4 * r + 2] : -1, -1, -1, 16 + t[4 * r + 3],
                                 1 + static_cast<int32_t>(r % 5)});
    }
  }
  return batches;
}

struct Setup {
  std::vector<std::vector<Token>> seqs;
  std::shared_ptr<const ngc::StaticCache> older, newer;  // the same counts, generations 1 and 2
};

Setup make_setup(const std::string& dir) {
  Setup s;
  for (int i = 0; i < kSequences; ++i) s.seqs.push_back(stream(static_cast<uint64_t>(i), kLength, kSequenceTokens));
  std::vector<ngc::TokenStream> streams;
  for (int i = 0; i < kSequences / 2; ++i) streams.push_back({s.seqs[i].data(), s.seqs[i].size()});
  for (uint64_t generation : {1, 2}) {
    ngc::StaticHeader header;
    header.vocab_size = kVocab;
    header.generation = generation;
    const std::string path = dir + "/static-" + std::to_string(generation) + ".ngc";
    check(ngc::build_static(streams, header, path, false, ngc::Builder::kMinBudget), "build_static");
    std::unique_ptr<ngc::StaticCache> cache;
    check(ngc::StaticCache::open(path, &cache), "StaticCache::open");
    (generation == 1 ? s.older : s.newer) = std::move(cache);
  }
  return s;
}

// Accepts seqs[i] a few tokens at a time, drafting after each accept; returns every draft
// (its length, then its tokens).
std::vector<Token> accept_and_draft(ngc::Drafter& d, const std::vector<Token>& seq, int64_t id) {
  std::vector<Token> out;
  Token draft[8];
  for (size_t n = 2; n < seq.size(); n += 7) {
    check(d.accept(id, seq.data(), n), "accept");
    int got = 0;
    check(d.draft(id, seq.data(), n, 8, draft, &got), "draft");
    out.push_back(got);
    out.insert(out.end(), draft, draft + got);
  }
  return out;
}

ngc::DrafterOptions options(ngc::DraftMode mode) {
  ngc::DrafterOptions o;
  o.vocab_size = kVocab;
  o.mode = mode;
  check(o.validate(), "DrafterOptions");
  return o;
}

// Part 1 (compatible mode) and 2 (match mode). Returns the number of tokens drafted.
size_t check_drafter(const Setup& s, ngc::DraftMode mode) {
  const bool compatible = mode == ngc::DraftMode::kCompatible;
  // Serial: one thread, sequence after sequence, no writer.
  ngc::Drafter serial(options(mode));
  check(serial.set_static(s.older), "set_static");
  serial.set_dynamic(std::make_shared<ngc::SharedCountTable>());
  std::vector<std::vector<Token>> want(kSequences);
  for (int i = 0; i < kSequences; ++i) want[i] = accept_and_draft(serial, s.seqs[i], i);
  ngc::SharedCountTable want_dynamic;
  const std::vector<std::vector<int32_t>> batches[2] = {writer_batches(1), writer_batches(2)};
  for (const auto& writer : batches) {
    for (const auto& b : writer)
      check(want_dynamic.add_rows(b.data(), b.size() / ngc::rows::kWidth, kVocab), "add_rows");
  }

  // Concurrent: the same operations from several threads at once.
  ngc::Drafter d(options(mode));
  check(d.set_static(s.older), "set_static");
  auto dynamic = std::make_shared<ngc::SharedCountTable>();
  d.set_dynamic(dynamic);
  std::vector<std::vector<Token>> got(kSequences);
  std::atomic<int> drafters_done{0};
  std::vector<std::thread> pool;
  for (int k = 0; k < kDrafterThreads; ++k) {
    pool.emplace_back([&, k] {
      for (int i = k; i < kSequences; i += kDrafterThreads) got[i] = accept_and_draft(d, s.seqs[i], i);
      ++drafters_done;
    });
  }
  for (const auto& writer : batches) {
    pool.emplace_back([&] {
      for (const auto& b : writer) check(dynamic->add_rows(b.data(), b.size() / ngc::rows::kWidth, kVocab), "add_rows");
    });
  }
  pool.emplace_back([&] {
    while (drafters_done.load() == 0 && d.dynamic_table()->n_keys() < 100) std::this_thread::yield();
    check(d.set_static(s.newer), "set_static (newer generation)");
  });
  pool.emplace_back([&] {  // a reader of the dynamic table while it grows
    while (drafters_done.load() < kDrafterThreads) {
      if (!dynamic->check_integrity().ok()) fail("the dynamic table lost its integrity while written");
    }
  });
  for (auto& t : pool) t.join();

  for (int i = 0; i < kSequences; ++i) {
    if (compatible && got[i] != want[i]) {
      fail("the drafts of sequence " + std::to_string(i) + " differ from the serial run's");
    }
  }
  if (sorted_rows(*dynamic) != sorted_rows(want_dynamic)) {
    fail("the dynamic table's counts differ from the rows added serially");
  }
  size_t tokens = 0;  // got[i] holds each draft's length, then its tokens
  for (const auto& g : got) tokens += g.size() - (kLength - 2 + 6) / 7;
  return tokens;
}

// Part 3. Returns the number of (key, follower) counts compared.
size_t check_count_table() {
  constexpr int kWriters = 4;
  std::vector<std::vector<Token>> streams;
  for (int k = 0; k < kWriters; ++k) streams.push_back(stream(100 + static_cast<uint64_t>(k), 20000, 40));
  const std::vector<Token> merged_stream = stream(200, 5000, 40);
  auto update_in_steps = [](auto&& update, const std::vector<Token>& tokens) {
    for (size_t n = 0; n < tokens.size();) {
      const size_t step = std::min<size_t>(500, tokens.size() - n);
      n += step;
      update(tokens.data(), n, step);
    }
  };
  // Serial.
  ngc::CountTable want;
  for (const auto& t : streams) {
    update_in_steps([&](const Token* p, size_t n, size_t n_new) { want.update(p, n, n_new, 1, 4); }, t);
  }
  ngc::CountTable other;
  other.update(merged_stream.data(), merged_stream.size(), merged_stream.size(), 1, 4);
  want.merge(other);

  // Concurrent.
  ngc::SharedCountTable table, shared_other;
  shared_other.merge(other);
  std::atomic<int> writers_done{0};
  std::vector<std::thread> pool;
  for (int k = 0; k < kWriters; ++k) {
    pool.emplace_back([&, k] {
      update_in_steps(
          [&](const Token* p, size_t n, size_t n_new) {
            check(table.update(p, n, static_cast<int64_t>(n_new), 1, 4, kVocab), "SharedCountTable::update");
          },
          streams[k]);
      ++writers_done;
    });
  }
  pool.emplace_back([&] {
    check(table.merge(shared_other), "SharedCountTable::merge");
    ++writers_done;
  });
  for (int r = 0; r < 2; ++r) {
    pool.emplace_back([&, r] {
      // The counts of a few bigrams of stream r: each only grows.
      std::vector<int64_t> last(50, 0);
      std::vector<Token> tokens;
      std::vector<int64_t> counts;
      while (writers_done.load() < kWriters + 1) {
        for (size_t j = 0; j < last.size(); ++j) {
          table.lookup(ngc::NGram::from(streams[r].data() + 10 * j, 2), &tokens, &counts);
          int64_t sum = 0;
          for (int64_t c : counts) sum += c;
          if (sum < last[j]) fail("a count went down while the table was only added to");
          last[j] = sum;
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  check(table.check_integrity(), "check_integrity");
  const auto got_rows = sorted_rows(table), want_rows = sorted_rows(want);
  if (got_rows != want_rows) {
    fail("the table holds " + std::to_string(got_rows.size()) + " counts after the concurrent updates, " +
         std::to_string(want_rows.size()) + " after the serial ones, or other values");
  }
  return got_rows.size();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  const Setup s = make_setup(argv[1]);
  const size_t drafted = check_drafter(s, ngc::DraftMode::kCompatible);
  const size_t matched = check_drafter(s, ngc::DraftMode::kMatch);
  const size_t counts = check_count_table();
  std::printf("ok: %zu drafted tokens equal to the serial run's, %zu drafted in the match mode, %zu counts equal\n",
              drafted, matched, counts);
  return 0;
}
