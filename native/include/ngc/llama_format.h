// llama.cpp's n-gram cache file format (common_ngram_cache_save / _load), read and written.
//
// No header: records to the end of the file, each
//   int32 ngram[4]      the key, unused slots -1 (LLAMA_NGRAM_MAX = 4)
//   int32 n_followers   > 0
//   n_followers x (int32 token, int32 count)   count > 0
// all little-endian. A file from another model loads silently in llama.cpp; here every
// token is checked against the vocabulary and every problem names its byte offset.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "ngc/ngram.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"
#include "ngc/status.h"

namespace ngc {

// Called once per (key, follower, count) of a llama.cpp file, in file order.
using LlamaEntryFn = std::function<Status(const NGram& key, Token follower, uint32_t count)>;

// Reads `path`, checking tokens against [0, vocab_size), and calls `fn` for every entry.
// A truncated record, a count <= 0, a key with a token after an unused slot, or a token
// outside the vocabulary fails with the byte offset of the problem.
Status read_llama_file(const std::string& path, uint32_t vocab_size, const LlamaEntryFn& fn);

// Writes every key of `cache` as llama.cpp records (counts above INT32_MAX are capped),
// atomically (temporary file, fsync, rename).
// `interrupted`, when given, is polled every few MB; when it returns true the export stops
// with kCancelled and `path` is left as it was.
Status write_llama_file(const StaticCache& cache, const std::string& path,
                        const std::function<bool()>& interrupted = {});

// Adds every entry of llama.cpp file `path` (any n-gram sizes: a dynamic cache) to `table`,
// all or nothing: the table changes only when the whole file is good. vocab_size is
// checked (1..kMaxVocab) first.
Status load_llama_counts(const std::string& path, int64_t vocab_size, SharedCountTable* table);

}  // namespace ngc
