#include "ngc/ngram.h"

#include <string>

namespace ngc {

Status make_ngram(const int64_t* tokens, size_t n, uint32_t vocab_limit, NGram* out) {
  if (n == 0 || n > static_cast<size_t>(kNgramMax)) {
    return Status::InvalidArgument("an n-gram has 1..4 tokens, got " + std::to_string(n));
  }
  NGram g;
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= static_cast<int64_t>(vocab_limit)) {
      return Status::InvalidArgument("token " + std::to_string(tokens[i]) + " is outside the vocabulary [0, " +
                                     std::to_string(vocab_limit) + ")");
    }
    g.tokens[i] = static_cast<Token>(tokens[i]);
  }
  *out = g;
  return Status::Ok();
}

Status check_tokens(const Token* tokens, size_t n, uint32_t vocab, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab) {
      return Status::InvalidArgument(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                     " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace ngc
