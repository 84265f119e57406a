// Builder: counts the (k-gram, follower) pairs of token streams within a memory budget and
// writes them as a static cache (llama-lookup-create at corpus scale).
//
// Each pair is packed into one integer of k+1 token fields (uint64_t when (k+1) x
// token_bits <= 64, else 128 bits) and appended to a buffer. A full buffer is sorted in
// parallel parts and written as a run of (pair, count) records to an unlinked scratch
// file. finish() merges the runs (and what is still in memory) in order, sums the counts
// of equal pairs and streams the keys to a StaticWriter. Memory stays within the budget
// whatever the corpus size; disk holds the runs.
//
// Thread-safety: none; one builder per thread (it runs its own sorting threads).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ngc/ngram.h"
#include "ngc/static_writer.h"
#include "ngc/status.h"

namespace ngc {

struct BuilderOptions {
  StaticHeader header;                  // n-gram size, vocabulary, fingerprint, generation
  uint64_t memory_budget = 1ull << 30;  // bytes for buffers; >= kMinBudget
  std::string scratch_dir;              // where runs go; empty: the output's directory
  int threads = 0;                      // sorting threads; 0: all cores
  int max_fan_in = 64;                  // runs merged at once (>= 2); more merge in passes
  // A corpus index for the match mode (static_format.h, version 2) of the tokens added
  // (not of counts added). It takes half the budget (32 bytes per indexed token while it
  // is sorted); tokens past that are counted but not indexed (BuildStats says how many).
  bool corpus_index = false;
  uint32_t index_depth = 32;  // 1..64: the longest match the index can find
};

struct BuildStats {
  uint64_t n_tokens = 0;        // tokens added
  uint64_t n_streams = 0;       // streams begun
  uint64_t n_pairs = 0;         // (k-gram, follower) occurrences counted
  uint64_t n_runs = 0;          // sorted runs spilled to disk
  uint64_t bytes_spilled = 0;   // bytes of those runs
  uint64_t n_keys = 0;          // keys written (after finish)
  uint64_t n_merge_passes = 0;  // intermediate merges needed because runs exceeded max_fan_in
  uint64_t n_indexed = 0;       // tokens in the corpus index
  uint64_t n_not_indexed = 0;   // tokens left out of it (over its share of the budget)
};

class Builder {
 public:
  static constexpr uint64_t kMinBudget = 16ull << 20;

  // Prepares to build the static cache `path`.
  static Status create(const BuilderOptions& options, const std::string& path, std::unique_ptr<Builder>* out);
  virtual ~Builder() = default;

  // Starts a new stream: n-grams never span two streams (llama-lookup-create counts each
  // input on its own).
  virtual void begin_stream() = 0;
  // Appends tokens to the current stream; every token MUST be below the vocabulary size
  // (checked: a bad token fails the call and adds nothing of it).
  virtual Status add_tokens(const Token* data, size_t n) = 0;
  // Appends tokens to the corpus index only (no n-gram is counted), as its own text: for
  // texts whose counts arrive otherwise (the fleet history, whose counts the dynamic table
  // holds). Checked like add_tokens; a no-op without options().corpus_index.
  virtual Status add_index_tokens(const Token* data, size_t n) = 0;
  // Adds `count` occurrences of follower `follower` after the k tokens at `key`.
  virtual Status add_count(const Token* key, Token follower, uint64_t count) = 0;
  // Adds n to the informational token count the header records (tokens observed by
  // counts that arrive already counted: a merged cache).
  virtual void add_observed_tokens(uint64_t n) = 0;
  // The header's token count cannot be known (counts merged from a source that did not
  // record it): the header records 0, "unknown".
  virtual void mark_tokens_unknown() = 0;
  // finish() polls `fn` every 65536 pairs; when it returns true, finish() stops with
  // kCancelled and writes nothing.
  virtual void set_interrupt_check(std::function<bool()> fn) = 0;
  // Merges everything and writes the file (temporary name, fsync, rename).
  virtual Status finish() = 0;
  virtual const BuildStats& stats() const = 0;
  virtual const BuilderOptions& options() const = 0;
};

// Counts the (k-gram, follower) pairs of each stream (n-grams never span two streams, as
// llama-lookup-create counts each of its inputs) and writes them as a static cache.
// Every token MUST be in [0, header.vocab_size); the function checks and refuses others.
struct TokenStream {
  const Token* data;  // borrowed; MUST stay alive for the call
  size_t size;
};
// (An in-memory convenience over Builder.) `memory_budget` bounds the builder as in
// BuilderOptions (the corpus index gets half of it); when `stats` is not null it receives the
// build's statistics, n_not_indexed included (tokens past the index's share of the budget).
Status build_static(const std::vector<TokenStream>& streams, const StaticHeader& header, const std::string& path,
                    bool corpus_index = false, uint64_t memory_budget = uint64_t{1} << 30, BuildStats* stats = nullptr);

}  // namespace ngc
