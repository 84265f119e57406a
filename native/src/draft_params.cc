#include "ngc/draft_params.h"

#include <string>

namespace ngc {
namespace {

// One tuning parameter: its accepted range (checked on the value as given, before it is
// converted to the field's type) and how it is stored.
struct ParamRange {
  const char* name;
  double lo, hi;
  void (*put)(MatchParams&, double);
};

// The ranges keep a draft's work bounded per token (chains, candidates, options) and the
// probabilities meaningful; names are those of for_each_match_param().
constexpr ParamRange kRanges[] = {
    {"min_match", 1, 64, [](MatchParams& p, double x) { p.min_match = static_cast<int>(x); }},
    {"max_match", 2, 1024, [](MatchParams& p, double x) { p.max_match = static_cast<int>(x); }},
    {"max_chain", 1, 1 << 16, [](MatchParams& p, double x) { p.max_chain = static_cast<int>(x); }},
    {"max_candidates", 1, 64, [](MatchParams& p, double x) { p.max_candidates = static_cast<int>(x); }},
    {"prior", 0, 1e6, [](MatchParams& p, double x) { p.prior = x; }},
    {"min_prob", 0, 1, [](MatchParams& p, double x) { p.min_prob = x; }},
    {"tree_min_prob", 0, 1, [](MatchParams& p, double x) { p.tree_min_prob = x; }},
    {"length_factor", 0.01, 1e6, [](MatchParams& p, double x) { p.length_factor = x; }},
    {"fallback", 0, 1, [](MatchParams& p, double x) { p.fallback = x != 0; }},
    {"extend", 0, 1, [](MatchParams& p, double x) { p.extend = x != 0; }},
    {"count_option", 0, 1, [](MatchParams& p, double x) { p.count_option = x != 0; }},
    {"count_prior", 0, 1e6, [](MatchParams& p, double x) { p.count_prior = x; }},
    {"corpus_prior", 0, 1e6, [](MatchParams& p, double x) { p.corpus_prior = x; }},
    {"splice_min", 0, 64, [](MatchParams& p, double x) { p.splice_min = static_cast<int>(x); }},
    {"resync_below", 0, 64, [](MatchParams& p, double x) { p.resync_below = static_cast<int>(x); }},
    {"sequence_weight", 1, 1e6, [](MatchParams& p, double x) { p.sequence_weight = x; }},
    {"max_options", 1, 8, [](MatchParams& p, double x) { p.max_options = static_cast<int>(x); }},
    {"history_tokens", 0, 1e9, [](MatchParams& p, double x) { p.history_tokens = static_cast<size_t>(x); }},
    {"history_piece", 1, 4096, [](MatchParams& p, double x) { p.history_piece = static_cast<int>(x); }},
    {"corpus_min_match", 1, 64, [](MatchParams& p, double x) { p.corpus_min_match = static_cast<int>(x); }},
};

const ParamRange* find_range(std::string_view name) {
  for (const ParamRange& r : kRanges) {
    if (name == r.name) return &r;
  }
  return nullptr;
}

Status check_in_range(const ParamRange& r, double x) {
  // Written so that NaN fails too.
  if (!(x >= r.lo && x <= r.hi)) {
    return Status::InvalidArgument("match_params['" + std::string(r.name) + "'] must be in " + std::to_string(r.lo) +
                                   ".." + std::to_string(r.hi));
  }
  return Status::Ok();
}

}  // namespace

Status check_ngram_range(int ngram_min, int ngram_max) {
  if (ngram_min < 1 || ngram_max > kNgramMax || ngram_min > ngram_max) {
    return Status::InvalidArgument("need 1 <= ngram_min <= ngram_max <= 4, got ngram_min=" + std::to_string(ngram_min) +
                                   ", ngram_max=" + std::to_string(ngram_max));
  }
  return Status::Ok();
}

Status check_n_draft(int n_draft) {
  if (n_draft < 1 || n_draft > kMaxDraft) {
    return Status::InvalidArgument("n_draft must be in 1.." + std::to_string(kMaxDraft) + ", got " +
                                   std::to_string(n_draft));
  }
  return Status::Ok();
}

Status parse_draft_mode(std::string_view name, DraftMode* out) {
  if (name == "compatible") {
    *out = DraftMode::kCompatible;
  } else if (name == "match") {
    *out = DraftMode::kMatch;
  } else {
    return Status::InvalidArgument("mode must be 'compatible' or 'match', got '" + std::string(name) + "'");
  }
  return Status::Ok();
}

const char* draft_mode_name(DraftMode mode) { return mode == DraftMode::kMatch ? "match" : "compatible"; }

Status DraftParams::validate() const {
  NGC_RETURN_IF_ERROR(check_ngram_range(ngram_min, ngram_max));
  return check_n_draft(n_draft);
}

Status MatchParams::set(std::string_view name, double value) {
  const ParamRange* r = find_range(name);
  if (r == nullptr) return Status::InvalidArgument("match_params has no '" + std::string(name) + "'");
  NGC_RETURN_IF_ERROR(check_in_range(*r, value));
  r->put(*this, value);
  return Status::Ok();
}

Status MatchParams::validate() const {
  NGC_RETURN_IF_ERROR(check_ngram_range(ngram_min, ngram_max));
  NGC_RETURN_IF_ERROR(check_n_draft(n_draft));
  Status s;
  for_each_match_param(*this, [&](const char* name, ParamKind, double value) {
    if (s.ok()) s = check_in_range(*find_range(name), value);
  });
  return s;
}

}  // namespace ngc
