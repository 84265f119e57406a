// The match mode (match.h): the options of the sequence, the history and the corpus, their
// walks and the count tables' walk, composed into draft_match and draft_tree. The repairs of a
// draft across an edit (splice, resync, realign) are match_edits.cc's.
#include "ngc/match.h"

#include <algorithm>

#include "match_internal.h"
#include "ngc/drafter.h"

namespace ngc {
namespace {

using match_detail::kRealignBelow;
using match_detail::max_length_for;
using match_detail::next_token;
using match_detail::realign;
using match_detail::resync;
using match_detail::Source;
using match_detail::Sources;
using match_detail::splice_sequence;

constexpr int kMaxCandidates = 64;  // candidates are bits of a uint64_t in draft_tree
constexpr int kMaxOptions = 16;

// One way to continue: the occurrences of one match (a suffix of the sequence of
// `length` tokens). The draft follows them forward.
struct Option {
  uint32_t length = 0;  // tokens matched
  int n = 0;
  uint32_t pos[kMaxCandidates];  // where each occurrence ends
  Source src[kMaxCandidates];    // in which text
};

// The occurrences of the tail's matches in a hash-chain index, most recent first, with
// their lengths (appended to pos/src/len_of, at most kMaxCandidates in all).
void chain_matches(const Sources& s, Source src, const MatchParams& p, uint32_t* pos, Source* srcs, uint32_t* len_of,
                   int* n) {
  const SeqIndex& index = src == Source::kSequence ? *s.sequence : *s.history;
  const Token* text = src == Source::kSequence ? s.seq : index.tokens();
  const size_t n_text = src == Source::kSequence ? s.n_seq : index.size();
  const size_t n_seq = s.n_seq;
  if (n_seq < 2) return;
  int visited = 0;
  for (uint32_t e = index.head(s.seq[n_seq - 2], s.seq[n_seq - 1]); e != 0 && visited < p.max_chain;
       e = index.prev(e - 1), ++visited) {
    const size_t i = e - 1;
    // In the sequence, the occurrence must end before the tail does (and be in what was given).
    if (i + 1 >= n_text) continue;
    uint32_t len = 0;
    const uint32_t most = static_cast<uint32_t>(std::min<size_t>({static_cast<size_t>(p.max_match), i + 1, n_seq - 1}));
    while (len < most && text[i - len] == s.seq[n_seq - 1 - len]) ++len;
    if (len < static_cast<uint32_t>(p.min_match) || len < 2) continue;  // a hash collision (or a separator)
    int slot = *n;
    if (*n == kMaxCandidates) {
      // Full: replace the shortest (the most recent of those) when this one is longer.
      slot = 0;
      for (int k = 1; k < *n; ++k)
        if (len_of[k] < len_of[slot]) slot = k;
      if (len <= len_of[slot]) continue;
    } else {
      ++*n;
    }
    pos[slot] = static_cast<uint32_t>(i);
    srcs[slot] = src;
    len_of[slot] = len;
  }
}

// Options from the sequence and the history together (one text to the drafter): for each
// of the longest distinct match lengths, the occurrences at least that long.
void text_options(const Sources& s, const MatchParams& p, Option* out, int* n_out) {
  uint32_t pos[kMaxCandidates], len_of[kMaxCandidates];
  Source srcs[kMaxCandidates];
  int n = 0;
  if (s.sequence) chain_matches(s, Source::kSequence, p, pos, srcs, len_of, &n);
  if (s.history && s.history->size() > 0) chain_matches(s, Source::kHistory, p, pos, srcs, len_of, &n);
  uint32_t lengths[kMaxCandidates];
  int n_lengths = 0;
  for (int k = 0; k < n; ++k) {
    int j = 0;
    while (j < n_lengths && lengths[j] != len_of[k]) ++j;
    if (j == n_lengths) lengths[n_lengths++] = len_of[k];
  }
  std::sort(lengths, lengths + n_lengths, [](uint32_t a, uint32_t b) { return a > b; });
  for (int l = 0; l < std::min(n_lengths, p.max_options) && *n_out < kMaxOptions; ++l) {
    Option& o = out[(*n_out)++];
    o.length = lengths[l];
    o.n = 0;
    for (int k = 0; k < n && o.n < p.max_candidates; ++k) {
      if (len_of[k] >= lengths[l]) {
        o.pos[o.n] = pos[k];
        o.src[o.n++] = srcs[k];
      }
    }
  }
}

// Options from the corpus index: the runs of the longest matches whose runs differ.
void corpus_options(const Sources& s, const MatchParams& p, Option* out, int* n_out) {
  const CorpusIndex& ix = *s.corpus;
  CorpusMatch runs[format::kMaxIndexDepth + 1];
  const int deepest = corpus_matches(ix, s.seq, s.n_seq, static_cast<uint32_t>(p.max_match), runs);
  uint64_t last_size = 0;
  int taken = 0;
  for (int j = deepest; j >= p.corpus_min_match && taken < p.max_options && *n_out < kMaxOptions; --j) {
    const CorpusMatch& m = runs[j];
    const uint64_t size = m.hi - m.lo;
    if (size == last_size) continue;  // the same occurrences as a longer match
    last_size = size;
    ++taken;
    Option& o = out[(*n_out)++];
    o.length = m.length;
    const uint64_t take = std::min<uint64_t>(size, static_cast<uint64_t>(p.max_candidates));
    o.n = static_cast<int>(take);
    for (uint64_t k = 0; k < take; ++k) {
      o.pos[k] = ix.suffixes[m.lo + k * size / take];  // spread over the run
      o.src[k] = Source::kCorpus;
    }
  }
}

int gather_options(const Sources& s, const MatchParams& p, Option* out) {
  int n = 0;
  text_options(s, p, out, &n);
  if (s.corpus && !s.corpus->empty()) corpus_options(s, p, out, &n);
  return n;
}

// An occurrence's vote: one, or `sequence_weight` for one in the sequence being drafted.
double weight(Source src, const MatchParams& p) { return src == Source::kSequence ? p.sequence_weight : 1.0; }

// The probability that the next token is the most frequent one: its share of the
// occurrences that go on, shrunk towards 0 by a prior that a longer match needs less of.
double share(double count, double live, const Option& o, const MatchParams& p) {
  const double prior = o.n > 0 && o.src[0] == Source::kCorpus ? p.corpus_prior : p.prior;
  return count / (live + prior / std::max<uint32_t>(o.length, 1));
}

// Follows one option forward greedily: the draft in out[0..), its length, and its score
// (the expected number of accepted tokens: the sum of each prefix's probability); odds[i]
// is token i's own probability (its share), given the ones before it.
int walk(const Sources& s, const Option& o, const MatchParams& p, int limit, Token* out, double* score,
         double* last_prob, float* odds) {
  uint64_t mask = o.n == 64 ? ~uint64_t{0} : (uint64_t{1} << o.n) - 1;
  double prob = 1.0;
  *last_prob = 1.0;
  *score = 0;
  int n_out = 0;
  Token next_of[kMaxCandidates];
  Token distinct[kMaxCandidates];
  double counts[kMaxCandidates];
  while (n_out < limit) {
    int n_distinct = 0, best = -1;
    double live = 0;
    for (int k = 0; k < o.n; ++k) {
      next_of[k] = (mask >> k & 1) ? next_token(s, o.src[k], o.pos[k], n_out, out, n_out) : -1;
      if (next_of[k] < 0) continue;
      const double w = weight(o.src[k], p);
      live += w;
      int d = 0;
      while (d < n_distinct && distinct[d] != next_of[k]) ++d;
      if (d == n_distinct) {
        distinct[n_distinct] = next_of[k];
        counts[n_distinct++] = 0;
      }
      counts[d] += w;
      if (best < 0 || counts[d] > counts[best]) best = d;  // ties: the earlier occurrence's
    }
    if (live == 0) break;
    const double q = share(counts[best], live, o, p);
    prob *= q;
    if (prob < p.min_prob) break;
    *score += prob;
    *last_prob = prob;
    odds[n_out] = static_cast<float>(q);
    out[n_out++] = distinct[best];
    for (int k = 0; k < o.n; ++k) {
      if (next_of[k] != distinct[best]) mask &= ~(uint64_t{1} << k);
    }
  }
  return n_out;
}

// The count tables' walk: each token the best follower of the longest n-gram at the tail
// of sequence + draft that the context table (else the dynamic table) knows, with its
// share of the counts as its probability. Exact frequencies for short matches, where the
// occurrences a chain finds are a sample. probs[i] (when non-null) is the draft's probability
// up to token i, odds[i] (when non-null) token i's own.
int count_walk(const Token* seq, size_t n_seq, const CountTable* context, const CountTable* dynamic,
               const MatchParams& p, int limit, double min_prob, Token* out, double* score, double* probs = nullptr,
               double start_prob = 1.0, float* odds = nullptr) {
  *score = 0;
  if (!context && !dynamic) return 0;
  Token buf[kNgramMax + kMaxDraft];
  const size_t head = std::min<size_t>(n_seq, kNgramMax);
  std::copy(seq + n_seq - head, seq + n_seq, buf);
  double prob = start_prob;
  int n_out = 0;
  while (n_out < limit) {
    const size_t avail = head + static_cast<size_t>(n_out);
    const Token* tail = buf + avail;
    PartView part;
    int found = 0;
    for (int n = std::min<int>(p.ngram_max, static_cast<int>(avail)); n >= p.ngram_min && !found; --n) {
      const NGram g = NGram::from(tail - n, n);
      const uint64_t h = g.hash();
      if ((context && context->find(g, h, &part)) || (dynamic && dynamic->find(g, h, &part))) found = n;
    }
    if (!found) break;
    Token best = -1;
    for (uint32_t j = 0; j < part.size; ++j) {
      if (part.followers[j].count == part.max_count) {  // the lowest token of the most frequent
        best = part.followers[j].token;
        break;
      }
    }
    const double q = part.max_count / (part.total + p.count_prior / found);
    prob *= q;
    if (best < 0 || prob < min_prob) break;
    *score += prob;
    if (probs) probs[n_out] = prob;
    if (odds) odds[n_out] = static_cast<float>(q);
    buf[avail] = best;
    out[n_out++] = best;
  }
  return n_out;
}

int fallback(const Token* seq, size_t n_seq, const CountTable* context, const CountTable* dynamic,
             const StaticCache* st, const MatchParams& p, int n_draft, Token* out, float* odds = nullptr) {
  if (!p.fallback) return 0;
  DraftParams dp;
  dp.n_draft = n_draft;
  dp.ngram_min = p.ngram_min;
  dp.ngram_max = p.ngram_max;
  return draft(seq, n_seq, context, dynamic, st, dp, out, odds);
}

// The linear draft before a realignment (draft_match's).
int draft_linear(const Token* seq, size_t n_seq, const MatchTables& t, const MatchParams& p, Token* out, float* odds) {
  const Sources s{seq, n_seq, t.sequence, t.history, t.static_cache ? &t.static_cache->corpus() : nullptr};
  Option options[kMaxOptions];
  const int n_options = gather_options(s, p, options);
  // The option whose draft has the most expected accepted tokens.
  double best_score = 0;
  int n_out = 0;
  Token buf[kMaxDraft];
  // The odds of the draft in `out` (best_odds) and of the walk just made (buf_odds); copied
  // to `odds` only when asked, so a draft without odds copies none.
  float buf_odds[kMaxDraft], best_odds[kMaxDraft];
  double best_last = 1.0;
  int chosen = -1;
  for (int i = 0; i < n_options; ++i) {
    double score, last;
    const int n = walk(s, options[i], p, max_length_for(p, options[i].length, p.n_draft), buf, &score, &last, buf_odds);
    if (n > 0 && score > best_score) {
      best_score = score;
      best_last = last;
      n_out = n;
      chosen = i;
      std::copy(buf, buf + n, out);
      if (odds) std::copy(buf_odds, buf_odds + n, best_odds);
    }
  }
  if (chosen >= 0 && p.splice_min > 0 && options[chosen].n > 0 && options[chosen].src[0] != Source::kSequence) {
    n_out = splice_sequence(s, p, n_out, p.n_draft, out, best_odds);
  }
  bool resynced = false;
  if (p.resync_below > 0) {
    uint32_t longest = 0;  // of the sequence/history matches
    for (int i = 0; i < n_options; ++i) {
      if (options[i].n > 0 && options[i].src[0] != Source::kCorpus) longest = std::max(longest, options[i].length);
    }
    if (longest < static_cast<uint32_t>(p.resync_below)) {
      const int n = resync(s, p, p.n_draft, buf, buf_odds);
      if (n > 0) {
        n_out = n;
        resynced = true;
        std::copy(buf, buf + n, out);
        std::copy(buf_odds, buf_odds + n, best_odds);
      }
    }
  }
  bool counted = false;
  if (p.count_option && !resynced) {
    double score;
    const int n =
        count_walk(seq, n_seq, t.context, t.dynamic, p, p.n_draft, p.min_prob, buf, &score, nullptr, 1.0, buf_odds);
    if (n > 0 && score > best_score) {
      best_score = score;
      n_out = n;
      counted = true;
      std::copy(buf, buf + n, out);
      if (odds) std::copy(buf_odds, buf_odds + n, best_odds);
    }
  }
  if (odds) std::copy(best_odds, best_odds + n_out, odds);
  if (p.extend && n_out > 0 && !counted && n_out < p.n_draft) {
    // A match's draft ended: the count tables go on from its end, at its probability.
    Token tail[kNgramMax + kMaxDraft];
    const size_t keep = std::min<size_t>(n_seq, kNgramMax);
    std::copy(seq + n_seq - keep, seq + n_seq, tail);
    std::copy(out, out + n_out, tail + keep);
    double score;
    n_out += count_walk(tail, keep + n_out, t.context, t.dynamic, p, p.n_draft - n_out, p.min_prob, out + n_out, &score,
                        nullptr, best_last, odds ? odds + n_out : nullptr);
    return n_out;
  }
  if (n_out == 0) return fallback(seq, n_seq, t.context, t.dynamic, t.static_cache, p, p.n_draft, out, odds);
  if (p.extend && n_out < p.n_draft) {
    // The tail of sequence + draft, contiguous, for the compatible steps.
    Token tail[2 * kNgramMax + kMaxDraft];
    const size_t keep = std::min<size_t>(n_seq, 2 * kNgramMax);
    std::copy(seq + n_seq - keep, seq + n_seq, tail);
    std::copy(out, out + n_out, tail + keep);
    n_out += fallback(tail, keep + n_out, t.context, t.dynamic, t.static_cache, p, p.n_draft - n_out, out + n_out,
                      odds ? odds + n_out : nullptr);
  }
  return n_out;
}

}  // namespace

int draft_match(const Token* seq, size_t n_seq, const MatchTables& t, const MatchParams& p, Token* out, float* odds) {
  if (p.resync_below <= 0) return draft_linear(seq, n_seq, t, p, out, odds);
  float own[kMaxDraft];
  float* first = odds ? odds : own;
  const int n_out = draft_linear(seq, n_seq, t, p, out, first);
  if (n_out > 0 && first[0] >= kRealignBelow) return n_out;
  const Sources s{seq, n_seq, t.sequence, t.history, t.static_cache ? &t.static_cache->corpus() : nullptr};
  Token buf[kMaxDraft];
  float buf_odds[kMaxDraft];
  const int n = realign(s, p, p.n_draft, buf, buf_odds);
  if (n == 0) return n_out;
  std::copy(buf, buf + n, out);
  if (odds) std::copy(buf_odds, buf_odds + n, odds);
  return n;
}

int draft_tree(const Token* seq, size_t n_seq, const MatchTables& t, const MatchParams& p, int budget,
               DraftTree* tree) {
  tree->clear();
  const Sources s{seq, n_seq, t.sequence, t.history, t.static_cache ? &t.static_cache->corpus() : nullptr};
  Option options[kMaxOptions];
  const int n_options = gather_options(s, p, options);
  // Best first over every option: the most probable continuation not yet in the tree
  // becomes the next node; continuations that two options share are one node.
  struct Pending {
    double prob;
    int parent;  // node index, -1: the root
    int depth;   // of the pending node (0: a child of the root)
    Token token;
    int option;
    uint64_t mask;  // the option's occurrences that agree with its path
  };
  std::vector<Pending> pending;
  Token path[kMaxDraft + 1];
  Token next_of[kMaxCandidates];
  auto expand = [&](int parent, int depth, double prob, int opt, uint64_t mask) {
    const Option& o = options[opt];
    if (depth >= max_length_for(p, o.length, kMaxDraft)) return;
    int n_path = 0;
    for (int v = parent; v >= 0; v = tree->parents[v]) ++n_path;
    for (int v = parent, i = n_path - 1; v >= 0; v = tree->parents[v], --i) path[i] = tree->tokens[v];
    double live = 0;
    for (int k = 0; k < o.n; ++k) {
      next_of[k] = (mask >> k & 1) ? next_token(s, o.src[k], o.pos[k], depth, path, n_path) : -1;
      if (next_of[k] >= 0) live += weight(o.src[k], p);
    }
    uint64_t left = mask;
    for (int k = 0; k < o.n; ++k) {
      if (!(left >> k & 1) || next_of[k] < 0) continue;
      uint64_t child = 0;
      double votes = 0;
      for (int j = k; j < o.n; ++j) {
        if ((left >> j & 1) && next_of[j] == next_of[k]) {
          child |= uint64_t{1} << j;
          votes += weight(o.src[j], p);
        }
      }
      left &= ~child;
      const double q = prob * share(votes, live, o, p);
      if (q >= p.tree_min_prob) pending.push_back({q, parent, depth, next_of[k], opt, child});
    }
  };
  for (int i = 0; i < n_options; ++i) {
    const uint64_t all = options[i].n == 64 ? ~uint64_t{0} : (uint64_t{1} << options[i].n) - 1;
    expand(-1, 0, 1.0, i, all);
  }
  // The count tables' walk is one more branch: a chain whose k-th token is pending as
  // option kChain + k once the one before it is a node.
  constexpr int kChain = 1 << 20;
  Token chain[kMaxDraft];
  double chain_prob[kMaxDraft];
  double chain_score = 0;
  const int n_chain = p.count_option ? count_walk(seq, n_seq, t.context, t.dynamic, p, budget, p.tree_min_prob, chain,
                                                  &chain_score, chain_prob)
                                     : 0;
  if (n_chain > 0) pending.push_back({chain_prob[0], -1, 0, chain[0], kChain, 0});
  while (static_cast<int>(tree->tokens.size()) < budget && !pending.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < pending.size(); ++i) {
      if (pending[i].prob > pending[best].prob) best = i;
    }
    const Pending node = pending[best];
    pending[best] = pending.back();
    pending.pop_back();
    // The same token under the same parent from another option: already a node.
    int existing = -1;
    for (int i = 0; i < static_cast<int>(tree->tokens.size()); ++i) {
      if (tree->parents[i] == node.parent && tree->tokens[i] == node.token) existing = i;
    }
    if (existing < 0) {
      tree->tokens.push_back(node.token);
      tree->parents.push_back(node.parent);
      tree->probs.push_back(static_cast<float>(node.prob));
      existing = static_cast<int>(tree->tokens.size()) - 1;
    }
    if (node.option >= kChain) {
      const int k = node.option - kChain + 1;
      if (k < n_chain) pending.push_back({chain_prob[k], existing, node.depth + 1, chain[k], kChain + k, 0});
    } else {
      expand(existing, node.depth + 1, node.prob, node.option, node.mask);
    }
  }
  if (tree->tokens.empty()) {
    Token buf[kMaxDraft];
    float odds[kMaxDraft];
    const int n = fallback(seq, n_seq, t.context, t.dynamic, t.static_cache, p, budget, buf, odds);
    double path = 1.0;
    for (int i = 0; i < n; ++i) {
      path *= odds[i];
      tree->tokens.push_back(buf[i]);
      tree->parents.push_back(i - 1);
      tree->probs.push_back(static_cast<float>(path));
    }
  }
  return static_cast<int>(tree->tokens.size());
}

}  // namespace ngc
