#include "ngc/sequences.h"

#include <string>

namespace ngc {

Status SequenceSet::accept(int64_t seq, const Token* tokens, size_t n_tokens) {
  auto it = seqs_.find(seq);
  const size_t done = it == seqs_.end() ? 0 : it->second->n_counted;
  if (n_tokens < done) {
    return Status::InvalidArgument("sequence " + std::to_string(seq) + " has " + std::to_string(n_tokens) +
                                   " tokens but " + std::to_string(done) +
                                   " were already accepted; pass the whole sequence, or reset() it first");
  }
  if (n_tokens == done) return Status::Ok();
  if (it == seqs_.end()) it = seqs_.emplace(seq, std::make_unique<Seq>()).first;
  Seq& s = *it->second;
  const size_t n_new = n_tokens - done;
  s.context.update(tokens, n_tokens, n_new, ngram_min_, ngram_max_);
  if (track_deltas_) pending_.update(tokens, n_tokens, n_new, ngram_min_, ngram_max_);
  s.n_counted = n_tokens;
  return Status::Ok();
}

const CountTable* SequenceSet::context(int64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? nullptr : &it->second->context;
}

size_t SequenceSet::n_counted(int64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second->n_counted;
}

bool SequenceSet::reset(int64_t seq) { return seqs_.erase(seq) > 0; }

void SequenceSet::drain_deltas(std::vector<int32_t>* rows) {
  pending_.for_each([&](const NGram& key, const PartView& part) {
    for (uint32_t j = 0; j < part.size; ++j) {
      uint32_t c = part.followers[j].count;
      while (c > 0) {
        const int32_t chunk = c > INT32_MAX ? INT32_MAX : static_cast<int32_t>(c);
        rows->push_back(key.size());
        for (int t = 0; t < kNgramMax; ++t) rows->push_back(key.tokens[t]);
        rows->push_back(part.followers[j].token);
        rows->push_back(chunk);
        c -= static_cast<uint32_t>(chunk);
      }
    }
  });
  pending_.clear();
}

}  // namespace ngc
