// StaticWriter: writes a static cache file (static_format.h) from keys given in order.
//
// The file is written to a temporary name beside `path`, fsync'd, then renamed over
// `path`, so a reader sees either no file or the whole file. Sections other than ROWS are
// streamed to unlinked scratch files beside `path` while keys are added, so memory stays
// O(vocab_size) whatever the number of keys. Thread-safety: none; one writer per thread.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ngc/checksum.h"
#include "ngc/ngram.h"
#include "ngc/static_format.h"
#include "ngc/status.h"

namespace ngc {

// What the header of a new static cache says about its contents.
struct StaticHeader {
  uint32_t ngram_size = 2;                             // tokens per key, 1..4
  uint32_t vocab_size = 0;                             // 1..2^24; every token is below it
  uint8_t fingerprint[format::kFingerprintSize] = {};  // the tokenizer fingerprint
  uint64_t generation = 0;                             // generation number in the namespace
  uint64_t n_tokens = 0;                               // tokens counted (informational)
};

class StaticWriter {
 public:
  // Checks `header` and prepares to write `path`.
  static Status create(const std::string& path, const StaticHeader& header, std::unique_ptr<StaticWriter>* out);
  ~StaticWriter();

  // Adds one key (header.ngram_size tokens) and its followers. Keys MUST come in strictly
  // increasing lexicographic order; followers MUST be sorted by token, unique, counts > 0.
  Status add(const Token* key, const Follower* followers, size_t n_followers);

  // Writes every section and the header, fsyncs, and renames onto `path`.
  Status finish();

  // Adds a corpus index (static_format.h, version 2): `text` with its SUFFIXES and
  // BUCKETS (match.h: build_corpus_index) sorted to `depth` (1..kMaxIndexDepth). The
  // file is then written as version 2. Checked by finish().
  void set_corpus_index(std::vector<uint32_t> text, std::vector<uint32_t> suffixes, std::vector<uint32_t> buckets,
                        uint32_t depth) {
    text_ = std::move(text);
    suffixes_ = std::move(suffixes);
    buckets_ = std::move(buckets);
    depth_ = depth;
  }

  void set_n_tokens(uint64_t n) { header_.n_tokens = n; }
  uint64_t n_keys() const { return n_keys_; }

 private:
  StaticWriter() = default;

  // An append-only section in an unlinked scratch file, checksummed as it is written.
  struct Spill {
    int fd = -1;               // owned; closed by the destructor
    std::vector<uint8_t> buf;  // bytes not yet written to fd
    Checksum64 sum;            // of every byte appended
    uint64_t bytes = 0;        // appended in all
    std::string dir;           // the folder of the (unlinked) file, for error messages
    Status open(const std::string& dir);
    Status append_u32(uint32_t v) {
      const size_t n = buf.size();
      buf.resize(n + 4);
      std::memcpy(buf.data() + n, &v, 4);
      return buf.size() >= kFlushBytes ? flush() : Status::Ok();
    }
    Status flush();
    ~Spill();
    static constexpr size_t kFlushBytes = 1 << 20;
  };

  std::string path_;
  StaticHeader header_;
  uint32_t count_bits_ = 0;  // 32 - token_bits
  uint32_t escape_ = 0;      // the count field value that means "see OVERFLOW"
  bool has_prev_ = false;
  NGram prev_;  // the last key added, for the order check
  uint64_t n_keys_ = 0;
  uint64_t n_followers_ = 0;
  uint64_t n_overflow_ = 0;
  std::vector<uint32_t> rows_;                       // keys per first token until finish() prefix-sums them
  Spill spills_[format::kNumSectionsV1 - 1];         // KEYS, STARTS, TOTALS, FOLLOWERS, OVERFLOW
  std::vector<uint32_t> text_, suffixes_, buckets_;  // the corpus index; empty: none
  uint32_t depth_ = 0;
};

}  // namespace ngc
