#include "ngc/limits.h"

#include <string>

namespace ngc {

Status check_vocab_size(int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > kMaxVocab) {
    return Status::InvalidArgument("vocab_size must be in 1.." + std::to_string(kMaxVocab) + " (2^24), got " +
                                   std::to_string(vocab_size));
  }
  return Status::Ok();
}

Status check_fingerprint_size(size_t size) {
  if (size != kFingerprintSize) {
    return Status::InvalidArgument("fingerprint must be " + std::to_string(kFingerprintSize) +
                                   " bytes (a tokenizer's .fingerprint, or UNTAGGED), got " + std::to_string(size));
  }
  return Status::Ok();
}

}  // namespace ngc
