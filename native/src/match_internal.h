// What the match mode's two units share, private to the core (nothing outside native/src
// includes it): match.cc gathers options, walks them and composes draft_match and draft_tree;
// match_edits.cc repairs a linear draft across an edit of the text being copied (splice,
// resync, realign). Both read the texts through Sources and next_token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ngc/draft_params.h"
#include "ngc/ngram.h"
#include "ngc/seq_index.h"
#include "ngc/static_cache.h"

namespace ngc::match_detail {

enum class Source : uint8_t { kSequence, kHistory, kCorpus };

// The text each source's occurrences continue into.
struct Sources {
  const Token* seq;           // the sequence being drafted
  size_t n_seq;               // its length
  const SeqIndex* sequence;   // may be null
  const SeqIndex* history;    // may be null
  const CorpusIndex* corpus;  // may be null or empty
};

// The token `depth` places after the occurrence ending at `pos`, or -1 when its text ends
// there. For the sequence, the text goes on into `path` (n_path tokens: the draft so far).
inline Token next_token(const Sources& s, Source src, uint32_t pos, int depth, const Token* path, int n_path) {
  const uint64_t q = uint64_t{pos} + 1 + static_cast<uint64_t>(depth);
  switch (src) {
    case Source::kCorpus: {
      const uint32_t t = s.corpus->at(static_cast<int64_t>(q));
      return t < s.corpus->vocab ? static_cast<Token>(t) : -1;  // separator, end, or a damaged entry
    }
    case Source::kHistory:
      return q < s.history->size() ? s.history->tokens()[q] : -1;  // -1 also at a separator
    case Source::kSequence:
    default:
      if (q < s.n_seq) return s.seq[q];
      return q - s.n_seq < static_cast<uint64_t>(n_path) ? path[q - s.n_seq] : -1;
  }
}

// The most tokens a match of `match_length` tokens drafts: ceil(length_factor x length), at
// least 1, at most `limit`.
inline int max_length_for(const MatchParams& p, uint32_t match_length, int limit) {
  const double cap = std::ceil(p.length_factor * match_length);
  return cap < limit ? std::max(1, static_cast<int>(cap)) : limit;
}

// Repairs across an edit (match_edits.cc). Each writes a draft into out[0..) (room for
// `limit`) and returns its length; odds[i] (when non-null) is token i's own probability.

// A draft taken from other texts (history, corpus) where the sequence's own text knows better:
// at the first drafted position d where the sequence plus the draft so far ends with a match of
// at least `p.splice_min` tokens in the sequence whose next token differs from the draft's, the
// rest of the draft becomes the sequence's continuation (its longest such match, the most recent
// of equals). `out` holds the draft's n_out tokens; returns the draft's new length.
int splice_sequence(const Sources& s, const MatchParams& p, int n_out, int limit, Token* out, float* odds);

// After new text, the draft resumes the text the sequence was copying (0: no text to resume);
// draft_linear calls it when no sequence/history match is `p.resync_below` tokens long.
int resync(const Sources& s, const MatchParams& p, int limit, Token* out, float* odds);

// After a replaced token, the draft copies what follows the token it replaced (0: no such
// match); draft_match calls it, with `p.resync_below` > 0, when the linear draft's first token
// has odds below kRealignBelow or nothing was drafted.
constexpr float kRealignBelow = 0.5f;
int realign(const Sources& s, const MatchParams& p, int limit, Token* out, float* odds);

}  // namespace ngc::match_detail
