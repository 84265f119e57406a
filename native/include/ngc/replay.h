// replay: llama-lookup-stats' simulation of drafting over a token stream, in the core so
// its timings measure the drafter rather than the interpreter around it.
#pragma once

#include <cstdint>
#include <vector>

#include "ngc/count_table.h"
#include "ngc/drafter.h"
#include "ngc/match.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"
#include "ngc/status.h"

namespace ngc {

struct ReplayStats {
  uint64_t n_chunks = 0;         // chunks of n_ctx tokens replayed
  uint64_t n_draft_calls = 0;    // calls to draft()
  uint64_t n_drafted = 0;        // tokens drafted
  uint64_t n_accept = 0;         // drafted tokens equal to the stream's next token
  uint64_t t_draft_ns = 0;       // time in draft() and context updates (as lookup-stats counts)
  uint64_t t_draft_only_ns = 0;  // time in draft() alone
};

// Cuts `tokens` into chunks of n_ctx (a last partial chunk is skipped, and so is a last
// full chunk that ends exactly at the end, as llama-lookup-stats does). In each chunk the
// output starts with the chunk's first token; until it holds n_ctx tokens: draft up to
// n_draft tokens after it, walk the draft while each token equals the chunk's next one
// (appending and counting it), then append the chunk's next token unless the output is
// full. Every appended token updates the context table. After a chunk, the context table
// is merged into `dynamic` (which MUST be non-null) and cleared.
// When `drafts` is non-null, each call's drafted tokens are appended to it followed by -1.
ReplayStats replay(const Token* tokens, size_t n_tokens, size_t n_ctx, const DraftParams& params,
                   const StaticCache* static_cache, CountTable* dynamic, std::vector<Token>* drafts);

// The same replay in the match mode (match.h): each chunk also keeps a SeqIndex of its
// output. With tree_budget > 0 each step drafts a tree of at most that many nodes and
// accepts its longest path that equals the stream's next tokens (n_drafted counts nodes;
// `drafts` gets each tree's tokens).
ReplayStats replay_match(const Token* tokens, size_t n_tokens, size_t n_ctx, const MatchParams& params, int tree_budget,
                         const StaticCache* static_cache, CountTable* dynamic, std::vector<Token>* drafts);

// A replay's settings, as a caller outside the core gives them. Valid when validate() is ok.
struct ReplayOptions {
  int64_t n_ctx = 0;  // tokens per chunk, >= 2
  DraftMode mode = DraftMode::kCompatible;
  DraftParams draft;    // n_draft and the n-gram sizes (both modes)
  MatchParams match;    // the match mode's tuning; its n_draft and n-gram sizes are draft's
  int tree_budget = 0;  // 0..kMaxDraft; > 0: tree drafts (match mode only)

  // Checks the n-gram sizes, the tree budget (and its mode), n_draft, n_ctx, then the match
  // mode's tuning.
  Status validate() const;
};

// replay() or replay_match() as `options` say, checked first: the options, and the tokens
// against the static cache's vocabulary (kMaxVocab without one). `dynamic` (non-null) is
// held under its exclusive lock for the whole replay.
Status run_replay(const Token* tokens, size_t n_tokens, const ReplayOptions& options, const StaticCache* static_cache,
                  SharedCountTable* dynamic, std::vector<Token>* drafts, ReplayStats* stats);

}  // namespace ngc
