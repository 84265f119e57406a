// What a Builder is fed from outside the core, checked: its header from a caller's values,
// its memory budget, weighted count rows, another static cache, a llama.cpp cache file.
// Each checks everything it can before the builder changes, and names what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ngc/builder.h"
#include "ngc/static_cache.h"
#include "ngc/static_writer.h"
#include "ngc/status.h"

namespace ngc {

// A static file's header from a caller's values: vocab_size 1..kMaxVocab, generation >= 0,
// ngram_size 1..kNgramMax, a fingerprint of kFingerprintSize bytes (`fingerprint_size`).
Status make_static_header(int64_t vocab_size, int ngram_size, const uint8_t* fingerprint, size_t fingerprint_size,
                          int64_t generation, StaticHeader* out);
// Fails unless 0 < memory_budget <= this machine's physical memory.
Status check_memory_budget(int64_t memory_budget);
// Fails unless memory_budget >= Builder::kMinBudget (build_static()'s budget).
Status check_min_budget(int64_t memory_budget);
// Fails unless 1 <= index_depth <= format::kMaxIndexDepth.
Status check_index_depth(int64_t index_depth);

// Adds n int32 count rows (rows.h) whose n-gram size is the builder's, all checked first.
Status add_count_rows(Builder* builder, const int32_t* rows, size_t n);
// Adds every count of `cache` (same n-gram size, vocabulary no larger than the builder's)
// and its n_tokens to the header's (unknown when `cache` does not know its own). `name`
// (its path) prefixes the errors.
Status add_static_counts(Builder* builder, const StaticCache& cache, const std::string& name);
// Adds every entry of llama.cpp cache file `path` (keys of the builder's n-gram size only).
Status import_llama_counts(Builder* builder, const std::string& path);

}  // namespace ngc
