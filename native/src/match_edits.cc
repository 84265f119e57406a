// The match mode's repairs of a linear draft across an edit of the text being copied
// (match_internal.h): splice_sequence, resync and realign. Each finds, through the sequence's
// and the history's hash chains, where the copy should go on, and copies from there.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "match_internal.h"

namespace ngc::match_detail {
namespace {

// How many tokens before and at text[j] equal those before and at seq[i] (at most `most`).
uint32_t match_back(const Token* text, size_t j, const Token* seq, size_t i, uint32_t most) {
  uint32_t len = 0;
  while (len < most && len <= j && len <= i && text[j - len] == seq[i - len]) ++len;
  return len;
}

// Whether text[from..n_text) is seq[at..] (the history's copy of the sequence being drafted,
// which the history takes in as the sequence is accepted, or the part of it held so far).
bool copies_sequence(const Token* text, size_t from, size_t n_text, const Token* seq, size_t at, size_t n_seq) {
  return n_text - from <= n_seq - at && std::equal(text + from, text + n_text, seq + at);
}

// Copies src's text from position `from` on into out[0..) after a match of `best` tokens ending
// just before it (its length), odds[i] growing with the tokens copied (a copy that held so far
// tends to go on), cut as a match's draft is.
int copy_from(const Sources& s, const MatchParams& p, Source src, size_t from, uint32_t best, int limit, Token* out,
              float* odds) {
  limit = max_length_for(p, best, limit);  // a capped draft's bounds (an uncapped one has none)
  double prob = 1.0;
  int n = 0;
  while (n < limit) {
    const Token t = next_token(s, src, static_cast<uint32_t>(from - 1), n, out, n);
    if (t < 0) break;
    const double q = 1.0 / (1.0 + p.prior / (best + static_cast<uint32_t>(n)));
    prob *= q;
    if (prob < p.min_prob) break;
    if (odds) odds[n] = static_cast<float>(q);
    out[n++] = t;
  }
  return n;
}

}  // namespace

constexpr int kSpliceChain = 8;  // sequence positions tried per drafted position: bounds a splice's cost

int splice_sequence(const Sources& s, const MatchParams& p, int n_out, int limit, Token* out, float* odds) {
  if (!s.sequence || s.n_seq < 2) return n_out;
  const Token* seq = s.seq;
  const size_t n_seq = s.n_seq;
  auto virt = [&](size_t end, size_t back) -> Token {  // token `back` places before `end` of seq + out
    const size_t q = end - 1 - back;
    return q < n_seq ? seq[q] : out[q - n_seq];
  };
  for (int d = 1; d < n_out; ++d) {
    const size_t end = n_seq + static_cast<size_t>(d);
    const Token a = virt(end, 1), b = virt(end, 0);
    uint32_t best_len = 0;
    size_t best_i = 0;
    int visited = 0;
    for (uint32_t e = s.sequence->head(a, b); e != 0 && visited < kSpliceChain;
         e = s.sequence->prev(e - 1), ++visited) {
      const size_t i = e - 1;
      if (i + 1 >= n_seq) continue;
      uint32_t len = 0;
      const uint32_t most = static_cast<uint32_t>(std::min<size_t>(static_cast<size_t>(p.max_match), i + 1));
      while (len < most && seq[i - len] == virt(end, len)) ++len;
      if (len > best_len) {
        best_len = len;
        best_i = i;
      }
    }
    if (best_len < static_cast<uint32_t>(p.splice_min) || seq[best_i + 1] == out[d]) continue;
    const float q = static_cast<float>(1.0 / (1.0 + p.prior / best_len));
    int n = d;
    for (size_t j = best_i + 1; j < n_seq && n < limit; ++j) {
      if (odds) odds[n] = q;
      out[n++] = seq[j];
    }
    return n;
  }
  return n_out;
}

// After new text (an edit's insertion or replacement) the sequence's tail matches nothing long,
// yet the text it was copying usually goes on a little further along: where it left off, past
// about as many tokens as the new text has. With `p.resync_below` > 0 and no sequence/history
// match that long, the draft resumes that text: of the tail's last kResyncBack positions, the
// latest that ends a match of kResyncAnchor tokens or more says which text and where the copy
// stopped; the draft goes on after the occurrence of the sequence's last token, within the new
// text's length plus kResyncWindow tokens from there, that matches the tail longest (the first
// of equals). On the code-edit replays (tests/bench/replay_transformers_drafts.py) these
// constants were the best of those tried (back 16-48, anchor 4-8, window 8-64).
constexpr size_t kResyncBack = 24;
constexpr uint32_t kResyncAnchor = 6;
constexpr size_t kResyncWindow = 16;

// The resumed draft in out[0..) (its length; 0: no text to resume), odds[i] growing with the
// tokens copied (a copy that held so far tends to go on), cut as a match's draft is.
int resync(const Sources& s, const MatchParams& p, int limit, Token* out, float* odds) {
  const Token* seq = s.seq;
  const size_t n_seq = s.n_seq;
  if (n_seq < 3) return 0;
  const uint32_t most = static_cast<uint32_t>(p.max_match);
  Source src = Source::kSequence;
  size_t resume = 0, since = 0;  // where the copy stopped in src's text, and the new tokens since
  bool found = false;
  for (size_t i = n_seq - 1; i >= 1 && n_seq - 1 - i < kResyncBack && !found; --i) {
    uint32_t best = 0;
    for (const Source from : {Source::kSequence, Source::kHistory}) {
      const SeqIndex* index = from == Source::kSequence ? s.sequence : s.history;
      if (!index || index->size() == 0) continue;
      const Token* text = from == Source::kSequence ? seq : index->tokens();
      const size_t end = from == Source::kSequence ? i - 1 : index->size() - 1;  // room for a next token
      int visited = 0;
      for (uint32_t e = index->head(seq[i - 1], seq[i]); e != 0 && visited < p.max_chain;
           e = index->prev(e - 1), ++visited) {
        const size_t j = e - 1;
        if (j >= end) continue;
        const uint32_t len = match_back(text, j, seq, i, most);
        if (len < kResyncAnchor || len <= best) continue;
        if (from == Source::kHistory && copies_sequence(text, j + 1, index->size(), seq, i + 1, n_seq)) continue;
        best = len;
        src = from;
        resume = j + 1;
        since = n_seq - 1 - i;
        found = true;
      }
    }
  }
  if (!found) return 0;
  const Token* text = src == Source::kSequence ? seq : s.history->tokens();
  const size_t n_text = src == Source::kSequence ? n_seq - 1 : s.history->size();
  uint32_t best = 0;
  size_t at = 0;
  for (size_t q = resume; q < n_text && q <= resume + since + kResyncWindow; ++q) {
    if (text[q - 1] != seq[n_seq - 1]) continue;
    const uint32_t len = match_back(text, q - 1, seq, n_seq - 1, most);
    if (len > best) {
      best = len;
      at = q;
    }
  }
  if (best == 0) return 0;
  return copy_from(s, p, src, at, best, limit, out, odds);
}

// After a token that replaced one of the text being copied (a renamed word, a changed literal),
// nothing ends like the tail and the draft is a guess; the copy usually goes on right after the
// replaced token. So the draft copies what follows the replaced token instead: the tail before
// the new token ends a match of kRealignAnchor tokens or more (the longest; the sequence's before
// the history's, the most recent of equals) whose next token is another. On the code-edit replays
// (tests/bench/replay_transformers_drafts.py) one replaced token, this anchor and kRealignBelow
// were the best of those tried (anchors 2-4, odds 0.3-0.55, 2-3 replaced tokens).
constexpr uint32_t kRealignAnchor = 3;

// The realigned draft in out[0..) (its length; 0: no such match), odds[i] as resync's.
int realign(const Sources& s, const MatchParams& p, int limit, Token* out, float* odds) {
  const Token* seq = s.seq;
  const size_t n_seq = s.n_seq;
  if (n_seq < 4) return 0;
  const uint32_t most = static_cast<uint32_t>(p.max_match);
  const size_t e = n_seq - 2;  // the tail before the new token ends here
  uint32_t best = 0;
  Source src = Source::kSequence;
  size_t start = 0;  // where the draft copies from in src's text
  for (const Source from : {Source::kSequence, Source::kHistory}) {
    const SeqIndex* index = from == Source::kSequence ? s.sequence : s.history;
    if (!index || index->size() == 0) continue;
    const Token* text = from == Source::kSequence ? seq : index->tokens();
    const size_t n_text = from == Source::kSequence ? n_seq : index->size();
    int visited = 0;
    for (uint32_t x = index->head(seq[e - 1], seq[e]); x != 0 && visited < p.max_chain;
         x = index->prev(x - 1), ++visited) {
      const size_t j = x - 1;
      if (j + 2 >= n_text) continue;  // room for the replaced token and one to copy (before the tail's)
      if (text[j + 1] == seq[e + 1] || text[j + 1] < 0) continue;  // not replaced (a plain match), or a text's end
      const uint32_t len = match_back(text, j, seq, e, most);
      if (len < kRealignAnchor || len <= best) continue;
      best = len;
      src = from;
      start = j + 2;
    }
  }
  if (best == 0) return 0;
  return copy_from(s, p, src, start, best, limit, out, odds);
}

}  // namespace ngc::match_detail
