#include "ngc/builder_inputs.h"

#include <unistd.h>

#include <cstring>
#include <string>

#include "ngc/llama_format.h"
#include "ngc/rows.h"

namespace ngc {

Status make_static_header(int64_t vocab_size, int ngram_size, const uint8_t* fingerprint, size_t fingerprint_size,
                          int64_t generation, StaticHeader* out) {
  NGC_RETURN_IF_ERROR(check_vocab_size(vocab_size));
  if (generation < 0) return Status::InvalidArgument("generation must be >= 0, got " + std::to_string(generation));
  if (ngram_size < 1 || ngram_size > kNgramMax) {
    return Status::InvalidArgument("ngram_size must be in 1..4, got " + std::to_string(ngram_size));
  }
  NGC_RETURN_IF_ERROR(check_fingerprint_size(fingerprint_size));
  StaticHeader h;
  h.ngram_size = static_cast<uint32_t>(ngram_size);
  h.vocab_size = static_cast<uint32_t>(vocab_size);
  std::memcpy(h.fingerprint, fingerprint, format::kFingerprintSize);
  h.generation = static_cast<uint64_t>(generation);
  *out = h;
  return Status::Ok();
}

Status check_memory_budget(int64_t memory_budget) {
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  if (memory_budget <= 0 || (physical > 0 && memory_budget > physical)) {
    return Status::InvalidArgument("memory_budget must be a positive number of bytes within this machine's memory (" +
                                   std::to_string(physical >> 20) + " MiB), got " + std::to_string(memory_budget));
  }
  return Status::Ok();
}

Status check_min_budget(int64_t memory_budget) {
  if (memory_budget < static_cast<int64_t>(Builder::kMinBudget)) {
    return Status::InvalidArgument("memory_budget must be at least 16 MiB, got " + std::to_string(memory_budget));
  }
  return Status::Ok();
}

Status check_index_depth(int64_t index_depth) {
  if (index_depth < 1 || index_depth > static_cast<int64_t>(format::kMaxIndexDepth)) {
    return Status::InvalidArgument("index_depth must be in 1.." + std::to_string(format::kMaxIndexDepth) + ", got " +
                                   std::to_string(index_depth));
  }
  return Status::Ok();
}

Status add_count_rows(Builder* builder, const int32_t* rows, size_t n) {
  const StaticHeader& h = builder->options().header;
  const int k = static_cast<int>(h.ngram_size);
  NGC_RETURN_IF_ERROR(rows::validate_all(rows, n, h.vocab_size, INT32_MAX));
  for (size_t i = 0; i < n; ++i) {
    const int32_t size = rows[rows::kWidth * i + rows::kN];
    if (size != k) {
      return Status::InvalidArgument("row " + std::to_string(i) + " has an n-gram of " + std::to_string(size) +
                                     " tokens; this builder's keys have " + std::to_string(k));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const int32_t* r = rows + rows::kWidth * i;
    NGC_RETURN_IF_ERROR(builder->add_count(r + rows::kT0, r[rows::kFollower], static_cast<uint64_t>(r[rows::kCount])));
  }
  return Status::Ok();
}

Status add_static_counts(Builder* builder, const StaticCache& cache, const std::string& name) {
  const StaticHeader& h = builder->options().header;
  const StaticInfo& info = cache.info();
  if (info.ngram_size != h.ngram_size) {
    return Status::InvalidArgument(name + " has keys of " + std::to_string(info.ngram_size) +
                                   " tokens; this builder's have " + std::to_string(h.ngram_size));
  }
  if (info.vocab_size > h.vocab_size) {
    return Status::InvalidArgument(name + " has vocabulary size " + std::to_string(info.vocab_size) +
                                   ", above this builder's " + std::to_string(h.vocab_size));
  }
  for (uint64_t i = 0; i < info.n_keys; ++i) {
    NGram key;
    StaticPart part;
    NGC_RETURN_IF_ERROR(cache.key_at(i, &key, &part).annotate(name));
    for (uint32_t j = 0; j < part.size; ++j) {
      NGC_RETURN_IF_ERROR(
          builder->add_count(key.tokens, cache.token_at(part, j), cache.count_at(part, j)).annotate(name));
    }
  }
  if (info.n_tokens == 0 && info.n_keys > 0) {
    builder->mark_tokens_unknown();  // its source did not record it: the sum cannot be known
  } else {
    builder->add_observed_tokens(info.n_tokens);
  }
  return Status::Ok();
}

Status import_llama_counts(Builder* builder, const std::string& path) {
  const StaticHeader& h = builder->options().header;
  const int k = static_cast<int>(h.ngram_size);
  return read_llama_file(path, h.vocab_size, [&](const NGram& key, Token follower, uint32_t count) -> Status {
    if (key.size() != k) {
      return Status::FormatError("an n-gram of " + std::to_string(key.size()) + " tokens; this import builds keys of " +
                                 std::to_string(k) + " (a static cache has one n-gram size)");
    }
    return builder->add_count(key.tokens, follower, count);
  });
}

}  // namespace ngc
