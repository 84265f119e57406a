#include "ngc/drafter.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>

namespace ngc {
namespace {

using u128 = unsigned __int128;

// The static followers of the current step's static key (or none).
struct StaticLookup {
  const StaticCache* cache = nullptr;
  StaticPart part;
  bool found = false;

  uint64_t weight(Token t) const {  // 100 x static count, or 1 when absent
    if (!found) return 1;
    const uint32_t c = cache->count_of(part, t);
    return c == 0 ? 1 : uint64_t{100} * c;
  }
};

// The n-grams at the tail of sequence + draft, with their hashes, computed once per step
// and shared by the context and dynamic tries.
struct TailGrams {
  NGram gram[kNgramMax + 1];  // indexed by size; valid for sizes in [lo, hi]
  uint64_t hash[kNgramMax + 1];
  int lo = 1, hi = 0;  // sizes available (hi < lo: none)
};

// The odds of a drafted token: its count over the total of the key that decided, with one
// unseen follower added to the total so that a small sample is trusted less (2 of 2 -> 2/3).
float count_odds(uint64_t count, uint64_t total) {
  return static_cast<float>(static_cast<double>(count) / (static_cast<double>(total) + 1.0));
}

// One primary (context or dynamic) try over n-gram sizes ngram_max..ngram_min; `*odds` gets
// the winner's count_odds.
Token try_primary(const CountTable& table, const TailGrams& g, const StaticLookup& st, const DraftThresholds& th,
                  float* odds) {
  for (int n = g.hi; n >= g.lo; --n) {
    PartView part;
    if (!table.find(g.gram[n], g.hash[n], &part)) continue;
    const uint64_t min_samples = static_cast<uint64_t>(th.min_samples[n - 1]);
    const uint64_t min_percent = static_cast<uint64_t>(th.min_percent[n - 1]);
    // Precheck: the winner's count is at most max_count, so if even max_count fails the
    // percentage (or the total is too small) no follower can pass; skip the scan.
    if (part.total < min_samples || uint64_t{100} * part.max_count < min_percent * part.total) continue;
    Token best = -1;
    uint64_t best_count = 0, best_weight = 0;
    for (uint32_t j = 0; j < part.size; ++j) {
      const Follower& f = part.followers[j];
      const uint64_t w = st.weight(f.token);
      // Strictly greater: followers are in token order, so ties keep the lowest token.
      if (u128(f.count) * w > u128(best_count) * best_weight) {
        best = f.token;
        best_count = f.count;
        best_weight = w;
      }
    }
    if (uint64_t{100} * best_count < min_percent * part.total) continue;
    *odds = count_odds(best_count, part.total);
    return best;
  }
  return -1;
}

Token try_static(const StaticLookup& st, float* odds) {
  if (!st.found) return -1;
  const uint64_t total = st.part.total;
  const uint64_t best = st.cache->count_at(st.part, 0);
  if (total < static_cast<uint64_t>(kLax.min_samples[1])) return -1;
  if (uint64_t{100} * best < static_cast<uint64_t>(kLax.min_percent[1]) * total) return -1;
  const Token t = st.cache->token_at(st.part, 0);
  *odds = count_odds(best, total);
  return static_cast<uint32_t>(t) < st.cache->info().vocab_size ? t : -1;  // damaged file: no draft
}

}  // namespace

int draft(const Token* seq, size_t n_seq, const CountTable* context, const CountTable* dynamic,
          const StaticCache* static_cache, const DraftParams& params, Token* out, float* odds) {
  if (n_seq < 2) return 0;  // llama.cpp drafts nothing before LLAMA_NGRAM_STATIC tokens
  const int k_static = static_cache ? static_cast<int>(static_cache->info().ngram_size) : 0;
  const size_t window = static_cast<size_t>(std::max(params.ngram_max, k_static));
  // The tail of the sequence followed by the draft so far, contiguous.
  Token buf[kNgramMax + kMaxDraft];
  const size_t n_head = std::min(window, n_seq);
  std::copy(seq + n_seq - n_head, seq + n_seq, buf);
  int n_out = 0;
  while (n_out < params.n_draft) {
    const size_t avail = n_seq + static_cast<size_t>(n_out);  // tokens of sequence + draft
    const Token* tail = buf + n_head + n_out;
    const bool use_static = static_cache && avail >= static_cast<size_t>(k_static);
    if (use_static) static_cache->prefetch(tail - k_static);
    // Hash every size first and prefetch the dynamic table's slots, so their cache misses
    // overlap instead of following one another.
    TailGrams g;
    g.lo = params.ngram_min;
    g.hi = static_cast<int>(std::min<size_t>(static_cast<size_t>(params.ngram_max), avail));
    for (int n = g.lo; n <= g.hi; ++n) {
      g.gram[n] = NGram::from(tail - n, n);
      g.hash[n] = g.gram[n].hash();
      if (dynamic) dynamic->prefetch(g.hash[n]);
    }
    StaticLookup st;
    st.cache = static_cache;
    if (use_static) st.found = static_cache->find(tail - k_static, &st.part) == FindResult::kFound;
    Token t = -1;
    float p = 0;
    if (context) t = try_primary(*context, g, st, kLax, &p);
    if (t < 0 && dynamic) t = try_primary(*dynamic, g, st, kStrict, &p);
    if (t < 0) t = try_static(st, &p);
    if (t < 0) break;
    buf[n_head + n_out] = t;
    if (odds) odds[n_out] = p;
    out[n_out++] = t;
  }
  return n_out;
}

Status DrafterOptions::validate() const {
  NGC_RETURN_IF_ERROR(check_vocab_size(vocab_size));
  NGC_RETURN_IF_ERROR(check_ngram_range(ngram_min, ngram_max));
  return match.validate();
}

Status DrafterOptions::bind_tokenizer(const StaticInfo* info, const int64_t* vocab, const uint8_t* fp, size_t fp_size) {
  if (info != nullptr) {
    if (vocab && *vocab != info->vocab_size) {
      return Status::TokenizerMismatch("vocab_size " + std::to_string(*vocab) + " differs from the static cache's " +
                                       std::to_string(info->vocab_size));
    }
    if (fp) {
      NGC_RETURN_IF_ERROR(check_fingerprint_size(fp_size));
      if (std::memcmp(fp, info->fingerprint, kFingerprintSize) != 0) {
        return Status::TokenizerMismatch(
            "fingerprint differs from the static cache's: it was built for another tokenizer");
      }
    }
    vocab_size = info->vocab_size;
    std::memcpy(fingerprint, info->fingerprint, kFingerprintSize);
    return Status::Ok();
  }
  if (!vocab || !fp) {
    return Status::InvalidArgument(
        "a Drafter without a static cache needs vocab_size and fingerprint (a tokenizer's .vocab_size and "
        ".fingerprint, or UNTAGGED for raw tokens)");
  }
  NGC_RETURN_IF_ERROR(check_vocab_size(*vocab));
  NGC_RETURN_IF_ERROR(check_fingerprint_size(fp_size));
  vocab_size = static_cast<uint32_t>(*vocab);
  std::memcpy(fingerprint, fp, kFingerprintSize);
  return Status::Ok();
}

Drafter::Drafter(const DrafterOptions& options)
    : options_(options),
      seqs_(options.ngram_min, options.ngram_max, options.track_deltas, options.limits,
            options.mode == DraftMode::kMatch) {}

Status Drafter::accept(int64_t seq, const Token* tokens, size_t n) {
  const bool match = options_.mode == DraftMode::kMatch;
  if (!match && !options_.track_history) return seqs_.accept(seq, tokens, n, options_.vocab_size);
  return seqs_.accept(seq, tokens, n, options_.vocab_size, [&](const Token* fresh, size_t n_new) {
    if (options_.track_history) record_outbox(seq, static_cast<uint64_t>(fresh - tokens), fresh, n_new);
    if (!match || options_.match.history_tokens == 0) return;
    std::unique_lock lock(history_mu_);
    stage_history_locked(false, seq, fresh, n_new);
  });
}

namespace {
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Sources holding tokens back at most; beyond, every held piece joins the history at once.
constexpr size_t kMaxHeldSources = 4096;
// What an uncapped draft (a caller for whom long drafts are nearly free) looks with, at least.
constexpr int kUncappedChain = 64;
constexpr double kUncappedSequenceWeight = 4.0;
constexpr int kUncappedSpliceMin = 4;
constexpr int kUncappedResyncBelow = 4;
}  // namespace

void Drafter::stage_history_locked(bool external, int64_t key, const Token* tokens, size_t n) {
  const size_t piece = static_cast<size_t>(options_.match.history_piece);
  Held* held = nullptr;
  if (auto it = held_.find({external, key}); it != held_.end()) held = &it->second;
  // The source that wrote last goes on writing at once (its text stays in one piece); the others
  // hold their tokens back until they make a piece.
  const bool at_tail = !history_any_ || (history_seq_ == key && history_external_ == external);
  if (piece <= 1 || (held == nullptr && (at_tail || n >= piece))) {
    append_piece_locked(external, key, tokens, n);
    return;
  }
  if (held == nullptr) {
    if (held_.size() >= kMaxHeldSources) {
      for (auto& [k, h] : held_) append_piece_locked(k.external, k.id, h.tokens.data(), h.tokens.size());
      held_.clear();
      held_tokens_ = 0;
    }
    held = &held_[{external, key}];
  }
  held->tokens.insert(held->tokens.end(), tokens, tokens + n);
  held->last_ns = steady_ns();
  held_tokens_ += n;
  if (held->tokens.size() >= piece) {
    append_piece_locked(external, key, held->tokens.data(), held->tokens.size());
    held_tokens_ -= held->tokens.size();
    held_.erase({external, key});
  }
}

size_t Drafter::flush_history(double idle_seconds) {
  const int64_t now = steady_ns();
  const int64_t idle_ns = static_cast<int64_t>(std::max(0.0, idle_seconds) * 1e9);
  std::unique_lock lock(history_mu_);
  size_t flushed = 0;
  for (auto it = held_.begin(); it != held_.end();) {
    if (now - it->second.last_ns < idle_ns) {
      ++it;
      continue;
    }
    append_piece_locked(it->first.external, it->first.id, it->second.tokens.data(), it->second.tokens.size());
    flushed += it->second.tokens.size();
    it = held_.erase(it);
  }
  held_tokens_ -= flushed;
  return flushed;
}

size_t Drafter::end_history(int64_t source) {
  std::unique_lock lock(history_mu_);
  size_t n = 0;
  if (auto it = held_.find({true, source}); it != held_.end()) {
    n = it->second.tokens.size();
    append_piece_locked(true, source, it->second.tokens.data(), n);
    held_tokens_ -= n;
    held_.erase(it);
  }
  recent_.erase({true, source});
  return n;
}

bool Drafter::reset(int64_t seq) {
  {
    std::unique_lock lock(history_mu_);
    if (auto it = held_.find({false, seq}); it != held_.end()) {
      append_piece_locked(false, seq, it->second.tokens.data(), it->second.tokens.size());
      held_tokens_ -= it->second.tokens.size();
      held_.erase(it);
    }
    recent_.erase({false, seq});
  }
  return seqs_.reset(seq);
}

void Drafter::append_piece_locked(bool external, int64_t key, const Token* tokens, size_t n) {
  const size_t bound = options_.match.history_tokens;
  const size_t overlap = options_.match.history_piece > 1 ? static_cast<size_t>(options_.match.history_piece) : 0;
  std::vector<Token>* last = nullptr;
  if (overlap > 0) {
    if (recent_.size() >= kMaxHeldSources && recent_.find({external, key}) == recent_.end()) recent_.clear();
    last = &recent_[{external, key}];
  }
  if (!history_any_ || history_seq_ != key || history_external_ != external) {
    const Token separator = -1;
    history_.append(&separator, 1);
    history_seq_ = key;
    history_external_ = external;
    history_any_ = true;
    // The new piece starts with the source's last tokens before it, so a match that reaches the
    // end of its previous piece goes on in this one.
    if (last != nullptr && !last->empty()) history_.append(last->data(), last->size());
  }
  history_.append(tokens, n);
  if (last != nullptr) {
    last->insert(last->end(), tokens, tokens + n);
    if (last->size() > overlap) last->erase(last->begin(), last->end() - static_cast<std::ptrdiff_t>(overlap));
  }
  if (history_.size() > bound + bound / 2) history_.keep_last(bound);  // amortized: every bound/2 tokens
}

void Drafter::record_outbox(int64_t seq, uint64_t offset, const Token* tokens, size_t n) {
  std::lock_guard lock(outbox_mu_);
  if (outbox_tokens_ + n > kMaxOutboxTokens) {
    outbox_dropped_ += n;
    return;
  }
  outbox_tokens_ += n;
  // A sequence's first record stays its first accept alone (its prompt): publishers hash it to
  // group siblings, and the store keeps identical prompts once.
  if (!outbox_.empty() && outbox_.back().seq == seq && outbox_.back().offset != 0 &&
      outbox_.back().offset + outbox_.back().tokens.size() == offset) {
    outbox_.back().tokens.insert(outbox_.back().tokens.end(), tokens, tokens + n);
    return;
  }
  outbox_.push_back({seq, offset, std::vector<Token>(tokens, tokens + n)});
}

Status Drafter::add_history(int64_t source, const Token* tokens, size_t n) {
  if (options_.mode != DraftMode::kMatch) {
    return Status::InvalidArgument("add_history needs a Drafter in the match mode (mode='match')");
  }
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= options_.vocab_size) {
      return Status::InvalidArgument("tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                     " is outside the vocabulary [0, " + std::to_string(options_.vocab_size) + ")");
    }
  }
  if (n == 0 || options_.match.history_tokens == 0) return Status::Ok();
  std::unique_lock lock(history_mu_);
  stage_history_locked(true, source, tokens, n);
  return Status::Ok();
}

void Drafter::drain_history(std::vector<HistoryRecord>* out) {
  std::lock_guard lock(outbox_mu_);
  for (auto& r : outbox_) out->push_back(std::move(r));
  outbox_.clear();
  outbox_tokens_ = 0;
}

size_t Drafter::history_dropped() const {
  std::lock_guard lock(outbox_mu_);
  return outbox_dropped_;
}

size_t Drafter::history_size() const {
  std::shared_lock lock(history_mu_);
  return history_.size();
}

size_t Drafter::memory_bytes() const {
  std::shared_lock lock(history_mu_);
  return seqs_.memory_bytes() + history_.memory_bytes() + held_tokens_ * sizeof(Token);
}

Status Drafter::check_tail(const Token* tokens, size_t n) const {
  // Only the tail is read by the compatible mode (the whole sequence may be long): check
  // just that. The match mode reads further back, but only compares those tokens.
  const size_t window = std::min<size_t>(n, kNgramMax);
  for (size_t i = n - window; i < n; ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= options_.vocab_size) {
      return Status::InvalidArgument("tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                     " is outside the vocabulary [0, " + std::to_string(options_.vocab_size) + ")");
    }
  }
  return Status::Ok();
}

Status Drafter::draft_tree(int64_t seq, const Token* tokens, size_t n, int budget, DraftTree* tree) const {
  tree->clear();
  if (options_.mode != DraftMode::kMatch) return Status::InvalidArgument("tree drafts need the match mode");
  if (budget < 1 || budget > kMaxDraft) {
    return Status::InvalidArgument("budget must be in 1.." + std::to_string(kMaxDraft) + ", got " +
                                   std::to_string(budget));
  }
  NGC_RETURN_IF_ERROR(check_tail(tokens, n));
  MatchParams p = options_.match;
  p.n_draft = budget;
  std::shared_lock tables(tables_mu_);
  std::shared_lock<RwLock> dyn_lock;
  if (dynamic_) dyn_lock = dynamic_->read();
  seqs_.with_tables(seq, [&](const CountTable* context, const SeqIndex* index) {
    std::shared_lock history(history_mu_);
    MatchTables t{index, &history_, context, dynamic_ ? &dynamic_->table() : nullptr, static_.get()};
    return ngc::draft_tree(tokens, n, t, p, budget, tree);
  });
  return Status::Ok();
}

Status Drafter::set_static(std::shared_ptr<const StaticCache> cache) {
  if (cache) {
    const StaticInfo& info = cache->info();
    if (std::memcmp(info.fingerprint, options_.fingerprint, kFingerprintSize) != 0) {
      return Status::TokenizerMismatch(
          "the static cache was built for another tokenizer (its fingerprint differs from the drafter's)");
    }
    if (info.vocab_size != options_.vocab_size) {
      return Status::TokenizerMismatch("the static cache's vocabulary size " + std::to_string(info.vocab_size) +
                                       " differs from the drafter's " + std::to_string(options_.vocab_size));
    }
  }
  std::unique_lock lock(tables_mu_);
  if (cache && static_ && cache->info().generation < static_->info().generation) {
    return Status::InvalidArgument("generation " + std::to_string(cache->info().generation) +
                                   " is older than the attached generation " +
                                   std::to_string(static_->info().generation));
  }
  static_.swap(cache);
  lock.unlock();
  return Status::Ok();  // `cache` (the old one) is released here, outside the lock
}

std::shared_ptr<const StaticCache> Drafter::static_cache() const {
  std::shared_lock lock(tables_mu_);
  return static_;
}

void Drafter::set_dynamic(std::shared_ptr<SharedCountTable> table) {
  std::unique_lock lock(tables_mu_);
  dynamic_.swap(table);
}

std::shared_ptr<SharedCountTable> Drafter::dynamic_table() const {
  std::shared_lock lock(tables_mu_);
  return dynamic_;
}

Status Drafter::draft(int64_t seq, const Token* tokens, size_t n, int n_draft, Token* out, int* n_out, float* odds,
                      bool uncapped) const {
  *n_out = 0;
  NGC_RETURN_IF_ERROR(check_n_draft(n_draft));
  NGC_RETURN_IF_ERROR(check_tail(tokens, n));
  DraftParams p;
  p.n_draft = n_draft;
  p.ngram_min = options_.ngram_min;
  p.ngram_max = options_.ngram_max;
  std::shared_lock tables(tables_mu_);
  std::shared_lock<RwLock> dyn_lock;
  if (dynamic_) dyn_lock = dynamic_->read();
  const CountTable* dyn = dynamic_ ? &dynamic_->table() : nullptr;
  if (options_.mode == DraftMode::kMatch) {
    MatchParams mp = options_.match;
    mp.n_draft = n_draft;
    if (uncapped) {
      mp.min_prob = 0.0;
      mp.length_factor = kMaxDraft;  // any match of >= 1 token may draft n_draft tokens
      // A long draft is nearly free, so which text it copies decides: look further back in
      // the chains and trust the sequence's own text (an edit's source) over other sequences'
      // (tuned on the code-edit replays, tests/bench/replay_transformers_drafts.py).
      mp.max_chain = std::max(mp.max_chain, kUncappedChain);
      mp.sequence_weight = std::max(mp.sequence_weight, kUncappedSequenceWeight);
      if (mp.splice_min == 0) mp.splice_min = kUncappedSpliceMin;
      // After new text (an edit's insertion), resume the text being copied, and go on past a
      // replaced token where the draft is a guess (both resync_below; match_edits.cc).
      if (mp.resync_below == 0) mp.resync_below = kUncappedResyncBelow;
    }
    *n_out = seqs_.with_tables(seq, [&](const CountTable* context, const SeqIndex* index) {
      std::shared_lock history(history_mu_);
      const MatchTables t{index, &history_, context, dyn, static_.get()};
      return ngc::draft_match(tokens, n, t, mp, out, odds);
    });
    return Status::Ok();
  }
  *n_out = seqs_.with_context(
      seq, [&](const CountTable* context) { return ngc::draft(tokens, n, context, dyn, static_.get(), p, out, odds); });
  return Status::Ok();
}

Status Drafter::draft_batch(size_t m, const int64_t* seqs, const Token* const* tokens, const size_t* sizes, int n_draft,
                            Token* out, int32_t* lengths, bool uncapped) const {
  NGC_RETURN_IF_ERROR(check_n_draft(n_draft));
  for (size_t i = 0; i < m; ++i) {
    Status s = draft(seqs[i], tokens[i], sizes[i], n_draft, out + i * static_cast<size_t>(n_draft), &lengths[i],
                     nullptr, uncapped);
    if (!s.ok()) return Status(s.code(), "sequence " + std::to_string(i) + ": " + s.message());
  }
  return Status::Ok();
}

}  // namespace ngc
