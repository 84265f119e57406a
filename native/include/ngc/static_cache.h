// StaticCache: a read-only, memory-mapped static cache file (format: static_format.h).
//
// Opening maps the file and validates its header and section table only, so it costs O(1)
// in the file size; the page cache holds one copy of the file for every process of a node.
// A core built with NGC_HEAP_FILES (the sanitizer builds, never a release) reads the file
// into a heap block of exactly its size instead: AddressSanitizer does not see into a
// mapping, but it reports any read past the end of that block (open_mode() says which).
// Thread-safety: every method is const and safe to call from any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ngc/ngram.h"
#include "ngc/static_format.h"
#include "ngc/status.h"

namespace ngc {

struct SectionInfo {
  uint32_t id = 0;        // format::SectionId
  uint64_t offset = 0;    // from the start of the file; a multiple of 8
  uint64_t length = 0;    // in bytes
  uint64_t checksum = 0;  // checksum64 of the section bytes
};

// The header fields of a static cache (see static_format.h for each one's meaning).
struct StaticInfo {
  uint32_t format_version = 0;
  uint32_t ngram_size = 0;
  uint32_t vocab_size = 0;
  uint8_t fingerprint[format::kFingerprintSize] = {};
  uint64_t generation = 0;
  uint64_t n_keys = 0;
  uint64_t n_followers = 0;
  uint64_t n_tokens = 0;
  uint64_t n_overflow = 0;
  uint32_t token_bits = 0;
  uint64_t file_size = 0;
  uint32_t n_sections = 0;                     // 6 (version 1) or 9 (version 2)
  uint32_t index_depth = 0;                    // the corpus index's depth D; 0: no index
  uint64_t n_text = 0;                         // TEXT entries (tokens and separators)
  uint64_t n_suffixes = 0;                     // SUFFIXES entries (indexed tokens)
  SectionInfo sections[format::kNumSections];  // the first n_sections are valid
};

// The corpus index of a version-2 file (static_format.h, sections 7-9), borrowed from the
// mapping: valid while the StaticCache lives. Lengths are validated at open; the values
// are not (a reader bounds-checks each one it uses: see match.h).
struct CorpusIndex {
  const uint32_t* text = nullptr;
  uint64_t n_text = 0;
  const uint32_t* suffixes = nullptr;
  uint64_t n_suffixes = 0;
  const uint32_t* buckets = nullptr;  // vocab + 1 entries
  uint32_t vocab = 0;
  uint32_t depth = 0;  // 0: no index

  bool empty() const { return n_suffixes == 0 || depth == 0; }
  // TEXT[q], or kSeparator outside [0, n_text).
  uint32_t at(int64_t q) const { return (q >= 0 && static_cast<uint64_t>(q) < n_text) ? text[q] : format::kSeparator; }
};

// The followers of one key. Borrowed from the mapping: valid while the StaticCache lives.
struct StaticPart {
  const uint32_t* followers = nullptr;  // packed; [0] is the best follower, [1..size) sorted by token
  uint32_t size = 0;                    // >= 1 when found
  uint32_t total = 0;                   // sum of the counts (saturated)
  uint32_t first = 0;                   // follower index of followers[0], for OVERFLOW look-ups
};

enum class FindResult { kFound, kNotFound, kCorrupt };

class StaticCache {
 public:
  // Maps and validates `path`. On success `*out` owns the mapping.
  static Status open(const std::string& path, std::unique_ptr<StaticCache>* out);
  ~StaticCache();
  StaticCache(const StaticCache&) = delete;
  StaticCache& operator=(const StaticCache&) = delete;

  const StaticInfo& info() const { return info_; }

  // Finds the key of info().ngram_size tokens at `key`. The caller MUST pass that many
  // tokens. kCorrupt means the file's bytes point outside their sections.
  FindResult find(const Token* key, StaticPart* out) const;

  // Hints the CPU to load the ROWS entries find(key) reads first.
  void prefetch(const Token* key) const {
    const uint32_t t0 = static_cast<uint32_t>(key[0]);
    if (t0 < info_.vocab_size) __builtin_prefetch(rows_ + t0);
  }

  // The count of follower `token` in `part`, or 0 when it is not a follower.
  uint32_t count_of(const StaticPart& part, Token token) const;
  // The token and count of follower j (0 <= j < part.size).
  Token token_at(const StaticPart& part, uint32_t j) const {
    return static_cast<Token>(part.followers[j] >> count_bits_);
  }
  uint32_t count_at(const StaticPart& part, uint32_t j) const;

  // Checks every section checksum and every structural invariant; O(file size).
  Status verify() const;

  // Reads key i (0 <= i < n_keys) into `key` and its followers into `part`; for export.
  Status key_at(uint64_t i, NGram* key, StaticPart* part) const;

  // The number of followers of key i (0 <= i < n_keys), 0 when STARTS is damaged there.
  uint32_t followers_of(uint64_t i) const {
    const uint32_t b = starts_[i], e = starts_[i + 1];
    return (b < e && e <= info_.n_followers) ? e - b : 0;
  }

  // The corpus index (empty for a version-1 file).
  const CorpusIndex& corpus() const { return corpus_; }

  // Bytes of the mapping (the file size).
  size_t mapped_bytes() const { return size_; }

  // How the file is held: "mmap" (a shared read-only mapping), or "heap" (a private copy of
  // exactly its size: a core built with NGC_HEAP_FILES).
  const char* open_mode() const { return heap_ != nullptr ? "heap" : "mmap"; }

 private:
  StaticCache() = default;
  Status validate_header();

  const uint8_t* base_ = nullptr;    // the file's bytes: the mapping (owned, unmapped by the destructor) or heap_
  size_t size_ = 0;                  // bytes mapped (== file size)
  std::unique_ptr<uint8_t[]> heap_;  // the copy of the file when built with NGC_HEAP_FILES; else null
  StaticInfo info_;
  uint32_t count_bits_ = 0;    // 32 - token_bits
  uint32_t count_escape_ = 0;  // (1 << count_bits_) - 1: the count lives in OVERFLOW
  // Section pointers into the mapping; lengths validated at open.
  const uint32_t* rows_ = nullptr;
  const uint32_t* keys_ = nullptr;
  const uint32_t* starts_ = nullptr;
  const uint32_t* totals_ = nullptr;
  const uint32_t* followers_ = nullptr;
  const uint32_t* overflow_ = nullptr;  // pairs (follower_index, count)
  CorpusIndex corpus_;
  Status verify_corpus() const;
};

}  // namespace ngc
