// ngramcache.client._core: the module. Its constants come from the core; each class and
// the free functions are bound in their own file (bindings.h lists them), which are glue
// only: they convert arguments, release the GIL around long calls and call the core.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "ngc/draft_params.h"
#include "ngc/limits.h"
#include "ngc/rows.h"
#include "ngc/static_format.h"

namespace nb = nanobind;

namespace {

// MATCH_DEFAULTS: the match mode's tuning as {name: default}, each in its own Python type.
nb::dict match_defaults() {
  nb::dict d;
  ngc::for_each_match_param(ngc::MatchParams{}, [&](const char* name, ngc::ParamKind kind, double value) {
    switch (kind) {
      case ngc::ParamKind::kInt:
        d[name] = static_cast<int64_t>(value);
        break;
      case ngc::ParamKind::kReal:
        d[name] = value;
        break;
      case ngc::ParamKind::kFlag:
        d[name] = value != 0;
        break;
    }
  });
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "The compiled ngramcache core: count tables, static caches and the drafter.";
  m.attr("FORMAT_VERSION") = ngc::format::kVersion;
  m.attr("MATCH_DEFAULTS") = match_defaults();
  m.attr("MAX_DRAFT") = ngc::kMaxDraft;
  m.attr("NGRAM_MAX") = ngc::kNgramMax;
  m.attr("MAX_VOCAB") = ngc::kMaxVocab;
  m.attr("ROW_WIDTH") = ngc::rows::kWidth;
  m.attr("FINGERPRINT_SIZE") = ngc::kFingerprintSize;
  m.attr("UNTAGGED") = nb::bytes(std::string(ngc::kFingerprintSize, '\0').data(), ngc::kFingerprintSize);

  ngc::py::bind_static_cache(m);
  ngc::py::bind_count_table(m);
  ngc::py::bind_drafter(m);
  ngc::py::bind_builder(m);
  ngc::py::bind_functions(m);
}
