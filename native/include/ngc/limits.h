// The limits every part of ngramcache shares: the core, the static format, count rows and
// namespaces of the counts store (the Python side reads them from the compiled module as
// NGRAM_MAX, MAX_VOCAB, MAX_DRAFT and FINGERPRINT_SIZE; nothing else defines them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ngc/status.h"

namespace ngc {

// The longest n-gram a key can hold (llama.cpp's LLAMA_NGRAM_MAX).
constexpr int kNgramMax = 4;

// Token ids are 0 <= id < vocab_size <= kMaxVocab. The static format packs a follower's
// token and count into 32 bits with at least 8 bits of count, so a token has at most 24.
constexpr uint32_t kMaxVocab = 1u << 24;

// The largest n_draft a call may ask for.
constexpr int kMaxDraft = 256;

// A tokenizer fingerprint: 32 opaque bytes (a digest of the tokenizer's definition).
constexpr uint32_t kFingerprintSize = 32;

// Fails unless 1 <= vocab_size <= kMaxVocab.
Status check_vocab_size(int64_t vocab_size);
// Fails unless a fingerprint of `size` bytes has kFingerprintSize.
Status check_fingerprint_size(size_t size);

}  // namespace ngc
