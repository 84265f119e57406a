// The llama.cpp-compatible drafter: common_ngram_cache_draft over a context table, a
// dynamic table and a static cache, with its thresholds, made deterministic.
//
// The draft grows one token at a time. Each step looks at the tail of sequence + draft:
//   1. the context table with the lax thresholds, n-gram sizes ngram_max..ngram_min;
//   2. else the dynamic table with the strict thresholds, same sizes;
//   3. else the static cache alone (its key's best follower, if total >= 2 and
//      100 * best >= 50 * total).
// In steps 1 and 2 a follower scores count x (100 x its count after the static key, or 1
// when the static cache has no such follower); the best score wins, ties to the lowest
// token; the size passes when its total >= min_samples[n-1] and 100 x the winner's count
// >= min_percent[n-1] x total. Drafting stops at the first step that yields nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/match.h"
#include "ngc/ngram.h"
#include "ngc/rwlock.h"
#include "ngc/sequences.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"
#include "ngc/status.h"

namespace ngc {

struct DraftThresholds {
  int min_samples[kNgramMax];  // indexed by n-gram size - 1
  int min_percent[kNgramMax];
};

// llama.cpp's draft_min_sample_size_lax / draft_min_percent_lax (context table).
constexpr DraftThresholds kLax = {{2, 2, 1, 1}, {66, 50, 50, 50}};
// llama.cpp's draft_min_sample_size_strict / draft_min_percent_strict (dynamic table).
constexpr DraftThresholds kStrict = {{4, 3, 2, 2}, {75, 66, 66, 66}};

// Drafts up to params.n_draft tokens after seq[0..n_seq) into `out` (room for n_draft)
// and returns how many. Any table may be null. The caller MUST pass valid params
// (params.validate()). Reads only the last max(ngram_max, static n-gram size) tokens of
// `seq`. Never allocates. With `odds` (room for n_draft), odds[i] is drafted token i's chance
// of acceptance given the ones before it were accepted, estimated from the counts that chose
// it: count / (total + 1) of the key that decided (the static key's for a static step).
int draft(const Token* seq, size_t n_seq, const CountTable* context, const CountTable* dynamic,
          const StaticCache* static_cache, const DraftParams& params, Token* out, float* odds = nullptr);

// What accept() added to one sequence: tokens[i] sits at offset + i in it.
struct HistoryRecord {
  int64_t seq = 0;
  uint64_t offset = 0;
  std::vector<Token> tokens;
};

// The most tokens the outbox of drain_history keeps; beyond, new records are dropped (counted).
constexpr size_t kMaxOutboxTokens = size_t{1} << 20;

struct DrafterOptions {
  uint32_t vocab_size = 0;                     // token ids are < it; 1..kMaxVocab
  uint8_t fingerprint[kFingerprintSize] = {};  // the tokenizer; all zero = untagged
  int ngram_min = 1;                           // context/dynamic n-gram sizes tried
  int ngram_max = 4;
  bool track_deltas = false;   // keep accepted counts for drain_deltas
  bool track_history = false;  // keep accepted tokens for drain_history (the fleet history)
  SequenceLimits limits;       // bounds on the per-sequence tables
  DraftMode mode = DraftMode::kCompatible;
  MatchParams match;  // the match mode's tuning (n_draft is per call)

  // Checks the vocabulary size, the n-gram sizes and the match mode's tuning.
  Status validate() const;
  // Binds the options to a tokenizer: to the static cache's (`info`, when non-null), checking
  // `vocab_size` and `fingerprint` against it when they are given (non-null); else to
  // `vocab_size` and `fingerprint`, which are then both required. `fingerprint` points to
  // `fingerprint_size` bytes (kFingerprintSize of them are valid).
  Status bind_tokenizer(const StaticInfo* info, const int64_t* vocab_size, const uint8_t* fingerprint,
                        size_t fingerprint_size);
};

// Drafter: one worker's (or one service replica's) drafting state: the per-sequence context
// tables, a shared dynamic table and a static cache, bound to one tokenizer. A static cache
// of another tokenizer or vocabulary, or of an older generation than the one attached, is
// refused. Swapping the static cache or dynamic table waits only for drafts in flight
// (microseconds) and never fails one.
//
// Thread-safety: every method may be called from any thread; drafts and accepts for
// different sequences run in parallel.
class Drafter {
 public:
  // The caller MUST pass valid options (options.validate()).
  explicit Drafter(const DrafterOptions& options);

  // Attaches `cache` (null detaches). Fails with kTokenizerMismatch when its fingerprint or
  // vocabulary differs from the drafter's, kInvalidArgument when its generation is older
  // than the attached one's.
  Status set_static(std::shared_ptr<const StaticCache> cache);
  std::shared_ptr<const StaticCache> static_cache() const;
  // Attaches `table` as the dynamic table (null detaches); its owner may keep writing it.
  void set_dynamic(std::shared_ptr<SharedCountTable> table);
  std::shared_ptr<SharedCountTable> dynamic_table() const;

  // Drafts up to n_draft (1..kMaxDraft) tokens after tokens[0..n) of sequence `seq` into
  // `out` (room for n_draft); `*n_out` is how many. Checks the tail tokens it reads. With
  // `odds` (room for n_draft), each drafted token's conditional odds (ngc::draft, draft_match).
  // With `uncapped` (match mode only), a match's draft is cut neither by its length
  // (length_factor) nor by its probability (min_prob): the longest draft up to n_draft, for a
  // caller that weighs the odds against verify costs and cuts it itself; it also looks further
  // back (max_chain >= 64) and prefers the sequence's own text (sequence_weight >= 4, a splice
  // at a 4-token match: see MatchParams), since which text a long draft copies is what counts;
  // after new text (no 4-token match) it resumes the text it was copying (resync_below 4), and
  // after a replaced token it copies what follows it where its draft is a guess (match_edits.cc).
  Status draft(int64_t seq, const Token* tokens, size_t n, int n_draft, Token* out, int* n_out, float* odds = nullptr,
               bool uncapped = false) const;
  // draft() for m sequences: seqs[i] after tokens[i][0..sizes[i]) into out + i x n_draft
  // (room for m x n_draft), lengths[i] how many, each `uncapped` as draft() takes it. The
  // first failure stops the batch and names its index.
  Status draft_batch(size_t m, const int64_t* seqs, const Token* const* tokens, const size_t* sizes, int n_draft,
                     Token* out, int32_t* lengths, bool uncapped = false) const;
  // Drafts a tree of at most `budget` (1..kMaxDraft) nodes (match mode only; match.h).
  Status draft_tree(int64_t seq, const Token* tokens, size_t n, int budget, DraftTree* tree) const;
  // See SequenceSet::accept. In the match mode the new tokens also join the history that
  // other sequences match against (bounded by match.history_tokens).
  Status accept(int64_t seq, const Token* tokens, size_t n);

  // The fleet history (match mode only). Appends tokens of a sequence generated elsewhere to
  // the history the match mode drafts from, as accept() does for this drafter's own
  // sequences: consecutive calls with the same `source` continue one text, another source
  // (or a local accept in between) starts a new one. kInvalidArgument in the compatible
  // mode or for a token outside the vocabulary (nothing is appended then).
  Status add_history(int64_t source, const Token* tokens, size_t n);
  // With track_history: moves the records accepted since the last call into `out`, oldest
  // first, consecutive accepts of one sequence merged (but never into its first record, which
  // stays its first accept: the prompt).
  void drain_history(std::vector<HistoryRecord>* out);
  // Tokens accepted but never drained because the outbox held kMaxOutboxTokens (in total).
  size_t history_dropped() const;
  // Tokens in the match history now (bounded by match.history_tokens), not counting those
  // still held back for their piece (match.history_piece).
  size_t history_size() const;
  // Moves the tokens held back for a piece into the history, for the sources idle for at
  // least `idle_seconds` (0: all); returns how many tokens. A client calls it now and then,
  // so the last tokens of a finished sequence join the history too.
  size_t flush_history(double idle_seconds);
  // Forgets sequence `seq` (SequenceSet::reset), its held-back tokens joining the history first.
  bool reset(int64_t seq);
  // add_history's `source` has ended: its held-back tokens join the history now (whatever
  // their number) and its overlap is forgotten. Returns how many tokens joined.
  size_t end_history(int64_t source);

  SequenceSet& sequences() { return seqs_; }
  const SequenceSet& sequences() const { return seqs_; }
  const DrafterOptions& options() const { return options_; }
  // Heap bytes of this drafter's own tables (context tables); the static cache is mapped
  // and shared, the dynamic table belongs to its owner.
  size_t memory_bytes() const;

 private:
  const DrafterOptions options_;
  SequenceSet seqs_;
  mutable RwLock tables_mu_;                   // guards the two pointers below
  std::shared_ptr<const StaticCache> static_;  // may be null
  std::shared_ptr<SharedCountTable> dynamic_;  // may be null
  // The match mode's history: the sequences' accepted tokens, the latest last, a separator
  // where the sequence changes. Lock order: a sequence's lock, then this one.
  mutable RwLock history_mu_;
  SeqIndex history_;
  int64_t history_seq_ = 0;
  bool history_any_ = false;
  bool history_external_ = false;  // history_seq_ names an add_history source, not a local sequence
  // Tokens of each source held back until they make a piece (match.history_piece), under
  // history_mu_; the key is (external, id).
  struct Held {
    std::vector<Token> tokens;
    int64_t last_ns = 0;
  };
  struct HeldKey {
    bool external;
    int64_t id;
    bool operator==(const HeldKey& o) const { return external == o.external && id == o.id; }
  };
  struct HeldKeyHash {
    size_t operator()(const HeldKey& k) const {
      return std::hash<int64_t>()(k.id) * 2 + static_cast<size_t>(k.external);
    }
  };
  std::unordered_map<HeldKey, Held, HeldKeyHash> held_;
  size_t held_tokens_ = 0;
  // Each source's last history_piece tokens in the history (the overlap a new piece starts with).
  std::unordered_map<HeldKey, std::vector<Token>, HeldKeyHash> recent_;
  // Holds tokens back for their piece, or appends them (see append_piece_locked).
  void stage_history_locked(bool external, int64_t key, const Token* tokens, size_t n);
  // The outbox of drain_history, under its own lock (accepts of different sequences write it).
  mutable std::mutex outbox_mu_;
  std::vector<HistoryRecord> outbox_;
  size_t outbox_tokens_ = 0;
  size_t outbox_dropped_ = 0;
  // Appends to the history under history_mu_, starting a new text when the key changes.
  void append_piece_locked(bool external, int64_t key, const Token* tokens, size_t n);
  void record_outbox(int64_t seq, uint64_t offset, const Token* tokens, size_t n);
  // Checks the tokens a draft reads first (the last kNgramMax).
  Status check_tail(const Token* tokens, size_t n) const;
};

}  // namespace ngc
