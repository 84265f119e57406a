#include "ngc/replay.h"

#include <chrono>
#include <string>

namespace ngc {
namespace {

inline uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace

ReplayStats replay(const Token* tokens, size_t n_tokens, size_t n_ctx, const DraftParams& params,
                   const StaticCache* static_cache, CountTable* dynamic, std::vector<Token>* drafts) {
  ReplayStats st;
  CountTable context;
  std::vector<Token> output;
  output.reserve(n_ctx);
  Token draft_buf[kMaxDraft];
  // llama-lookup-stats' loop condition is strict: a chunk that ends exactly at the end of
  // the input is skipped too. Kept, so the figures match its own.
  for (size_t start = 0; n_ctx > 0 && start + n_ctx < n_tokens; start += n_ctx) {
    const Token* chunk = tokens + start;
    output.assign(1, chunk[0]);
    while (output.size() < n_ctx) {
      uint64_t t0 = now_ns();
      const int n = draft(output.data(), output.size(), &context, dynamic, static_cache, params, draft_buf);
      uint64_t dt = now_ns() - t0;
      st.t_draft_ns += dt;
      st.t_draft_only_ns += dt;
      ++st.n_draft_calls;
      st.n_drafted += static_cast<uint64_t>(n);
      if (drafts) {
        drafts->insert(drafts->end(), draft_buf, draft_buf + n);
        drafts->push_back(-1);
      }
      for (int j = 0; j < n && output.size() < n_ctx; ++j) {
        if (chunk[output.size()] != draft_buf[j]) break;
        ++st.n_accept;
        output.push_back(draft_buf[j]);
        t0 = now_ns();
        context.update(output.data(), output.size(), 1, params.ngram_min, params.ngram_max);
        st.t_draft_ns += now_ns() - t0;
      }
      if (output.size() < n_ctx) {
        output.push_back(chunk[output.size()]);
        t0 = now_ns();
        context.update(output.data(), output.size(), 1, params.ngram_min, params.ngram_max);
        st.t_draft_ns += now_ns() - t0;
      }
    }
    dynamic->merge(context);
    context.clear();
    ++st.n_chunks;
  }
  return st;
}

ReplayStats replay_match(const Token* tokens, size_t n_tokens, size_t n_ctx, const MatchParams& params, int tree_budget,
                         const StaticCache* static_cache, CountTable* dynamic, std::vector<Token>* drafts) {
  ReplayStats st;
  CountTable context;
  SeqIndex index;
  SeqIndex history;  // the chunks before this one, as earlier requests are to a worker
  DraftTree tree;
  MatchTables tables;
  tables.sequence = &index;
  tables.history = &history;
  tables.context = &context;
  tables.dynamic = dynamic;
  tables.static_cache = static_cache;
  std::vector<Token> output;
  output.reserve(n_ctx);
  Token draft_buf[kMaxDraft];
  for (size_t start = 0; n_ctx > 0 && start + n_ctx < n_tokens; start += n_ctx) {
    const Token* chunk = tokens + start;
    output.assign(1, chunk[0]);
    index.clear();
    index.extend(output.data(), output.size());
    auto append = [&](Token t) {
      output.push_back(t);
      const uint64_t t0 = now_ns();
      context.update(output.data(), output.size(), 1, params.ngram_min, params.ngram_max);
      index.extend(output.data(), output.size());
      st.t_draft_ns += now_ns() - t0;
    };
    while (output.size() < n_ctx) {
      const uint64_t t0 = now_ns();
      int n;
      if (tree_budget > 0) {
        n = draft_tree(output.data(), output.size(), tables, params, tree_budget, &tree);
      } else {
        n = draft_match(output.data(), output.size(), tables, params, draft_buf);
      }
      const uint64_t dt = now_ns() - t0;
      st.t_draft_ns += dt;
      st.t_draft_only_ns += dt;
      ++st.n_draft_calls;
      st.n_drafted += static_cast<uint64_t>(n);
      if (drafts) {
        const Token* d = tree_budget > 0 ? tree.tokens.data() : draft_buf;
        drafts->insert(drafts->end(), d, d + n);
        drafts->push_back(-1);
      }
      if (tree_budget > 0) {
        // Down the tree while a child of the current node is the stream's next token.
        int node = -1;
        while (output.size() < n_ctx) {
          const Token want = chunk[output.size()];
          int next = -1;
          for (int i = node + 1; i < n; ++i) {
            if (tree.parents[i] == node && tree.tokens[i] == want) {
              next = i;
              break;
            }
          }
          if (next < 0) break;
          ++st.n_accept;
          append(want);
          node = next;
        }
      } else {
        for (int j = 0; j < n && output.size() < n_ctx; ++j) {
          if (chunk[output.size()] != draft_buf[j]) break;
          ++st.n_accept;
          append(draft_buf[j]);
        }
      }
      if (output.size() < n_ctx) append(chunk[output.size()]);
    }
    dynamic->merge(context);
    context.clear();
    const Token separator = -1;
    history.append(&separator, 1);
    history.append(output.data(), output.size());
    if (params.history_tokens == 0) history.clear();
    history.keep_last(params.history_tokens);
    ++st.n_chunks;
  }
  return st;
}

Status ReplayOptions::validate() const {
  NGC_RETURN_IF_ERROR(check_ngram_range(draft.ngram_min, draft.ngram_max));
  if (tree_budget < 0 || tree_budget > kMaxDraft) {
    return Status::InvalidArgument("tree_budget must be in 0.." + std::to_string(kMaxDraft) + ", got " +
                                   std::to_string(tree_budget));
  }
  if (tree_budget > 0 && mode != DraftMode::kMatch) return Status::InvalidArgument("tree drafts need mode='match'");
  NGC_RETURN_IF_ERROR(check_n_draft(draft.n_draft));
  if (n_ctx < 2) return Status::InvalidArgument("n_ctx must be >= 2, got " + std::to_string(n_ctx));
  MatchParams m = match;
  m.n_draft = draft.n_draft;
  m.ngram_min = draft.ngram_min;
  m.ngram_max = draft.ngram_max;
  return m.validate();
}

Status run_replay(const Token* tokens, size_t n_tokens, const ReplayOptions& options, const StaticCache* static_cache,
                  SharedCountTable* dynamic, std::vector<Token>* drafts, ReplayStats* stats) {
  NGC_RETURN_IF_ERROR(options.validate());
  NGC_RETURN_IF_ERROR(
      check_tokens(tokens, n_tokens, static_cache ? static_cache->info().vocab_size : kMaxVocab, "tokens"));
  const size_t n_ctx = static_cast<size_t>(options.n_ctx);
  MatchParams mp = options.match;
  mp.n_draft = options.draft.n_draft;
  mp.ngram_min = options.draft.ngram_min;
  mp.ngram_max = options.draft.ngram_max;
  *stats = dynamic->write([&](CountTable& table) {
    if (options.mode == DraftMode::kMatch) {
      return replay_match(tokens, n_tokens, n_ctx, mp, options.tree_budget, static_cache, &table, drafts);
    }
    return replay(tokens, n_tokens, n_ctx, options.draft, static_cache, &table, drafts);
  });
  return Status::Ok();
}

}  // namespace ngc
