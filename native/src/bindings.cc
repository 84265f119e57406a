// ngramcache.client._core: nanobind glue between Python and the ngc core. No logic lives here beyond
// argument checks, locking and conversions; raise_status() is the one place a Status
// becomes a Python exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "ngc/builder.h"
#include "ngc/checksum.h"
#include "ngc/count_table.h"
#include "ngc/draft_view.h"
#include "ngc/drafter.h"
#include "ngc/file_util.h"
#include "ngc/llama_format.h"
#include "ngc/match.h"
#include "ngc/replay.h"
#include "ngc/rows.h"
#include "ngc/sequences.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"
#include "ngc/static_writer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using ngc::Status;
using ngc::StatusCode;
using ngc::Token;
namespace rows = ngc::rows;
using Path = std::filesystem::path;

[[noreturn]] void raise_status(const Status& s) {
  const char* cls = nullptr;
  if (s.code() == StatusCode::kCancelled) {
    if (PyErr_Occurred()) throw nb::python_error();  // the KeyboardInterrupt that stopped it
    PyErr_SetString(PyExc_KeyboardInterrupt, s.message().c_str());
    throw nb::python_error();
  }
  switch (s.code()) {
    case StatusCode::kFormatError: cls = "CacheFormatError"; break;
    case StatusCode::kTokenizerMismatch: cls = "TokenizerMismatchError"; break;
    case StatusCode::kIoError: PyErr_SetString(PyExc_OSError, s.message().c_str()); throw nb::python_error();
    default: cls = "InvalidArgumentError"; break;
  }
  nb::object type = nb::module_::import_("ngramcache.client.errors").attr(cls);
  PyErr_SetString(type.ptr(), s.message().c_str());
  throw nb::python_error();
}

void check(const Status& s) {
  if (!s.ok()) raise_status(s);
}

[[noreturn]] void invalid(const std::string& msg) { raise_status(Status::InvalidArgument(msg)); }

using I32Array = nb::ndarray<nb::ro, nb::device::cpu>;

// A borrowed view of a 1-D C-contiguous int32 numpy array (no copy).
struct TokenView {
  I32Array array;  // holds a reference to the buffer while the view lives
  const Token* data = nullptr;
  size_t size = 0;
};

std::string type_str(nb::handle obj) {
  nb::object s = nb::steal(PyObject_Str(obj.ptr()));
  if (!s.is_valid()) {
    PyErr_Clear();
    return "?";
  }
  return nb::cast<std::string>(s);
}

TokenView as_tokens(nb::handle h, const char* what) {
  TokenView v;
  if (!nb::try_cast(h, v.array, false)) {
    invalid(std::string(what) + " must be a 1-D numpy array of int32, got " +
            std::string(Py_TYPE(h.ptr())->tp_name) +
            "; use numpy.asarray(x, dtype=numpy.int32)");
  }
  if (v.array.dtype() != nb::dtype<int32_t>()) {
    invalid(std::string(what) + " must have dtype int32, got " +
            type_str(h.attr("dtype")) + "; use numpy.asarray(x, dtype=numpy.int32)");
  }
  if (v.array.ndim() != 1) invalid(std::string(what) + " must be 1-D, got " + std::to_string(v.array.ndim()) + " dimensions");
  if (v.array.shape(0) > 1 && v.array.stride(0) != 1) invalid(std::string(what) + " must be contiguous");
  v.data = static_cast<const Token*>(v.array.data());
  v.size = v.array.shape(0);
  return v;
}

template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

// An n-gram given from Python as a sequence of 1..4 ints >= 0.
ngc::NGram as_ngram(const std::vector<int64_t>& tokens, uint32_t vocab_limit) {
  if (tokens.empty() || tokens.size() > ngc::kNgramMax) {
    invalid("an n-gram has 1..4 tokens, got " + std::to_string(tokens.size()));
  }
  ngc::NGram g;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= static_cast<int64_t>(vocab_limit)) {
      invalid("token " + std::to_string(tokens[i]) + " is outside the vocabulary [0, " + std::to_string(vocab_limit) + ")");
    }
    g.tokens[i] = static_cast<Token>(tokens[i]);
  }
  return g;
}

void check_ngram_range(int ngram_min, int ngram_max) {
  if (ngram_min < 1 || ngram_max > ngc::kNgramMax || ngram_min > ngram_max) {
    invalid("need 1 <= ngram_min <= ngram_max <= 4, got ngram_min=" + std::to_string(ngram_min) +
            ", ngram_max=" + std::to_string(ngram_max));
  }
}

// The drafting mode by name: false for "compatible", true for "match".
bool parse_mode(const std::string& mode) {
  if (mode == "compatible") return false;
  if (mode == "match") return true;
  invalid("mode must be 'compatible' or 'match', got '" + mode + "'");
  return false;
}

// The match mode's tuning, defaults overridden by a dict of {name: number} (tests and
// benchmarks tune with it; users keep the defaults).
ngc::MatchParams match_params_from(nb::handle overrides) {
  ngc::MatchParams p;
  if (overrides.is_none()) return p;
  if (!nb::isinstance<nb::dict>(overrides)) invalid("match_params must be a dict or None");
  for (auto [k, v] : nb::borrow<nb::dict>(overrides)) {
    const std::string key = nb::cast<std::string>(k);
    const double x = nb::cast<double>(v);
    auto in = [&](double lo, double hi) {
      if (!(x >= lo && x <= hi)) invalid("match_params['" + key + "'] must be in " + std::to_string(lo) + ".." + std::to_string(hi));
      return x;
    };
    if (key == "min_match") p.min_match = static_cast<int>(in(1, 64));
    else if (key == "max_match") p.max_match = static_cast<int>(in(2, 1024));
    else if (key == "max_chain") p.max_chain = static_cast<int>(in(1, 1 << 16));
    else if (key == "max_candidates") p.max_candidates = static_cast<int>(in(1, 64));
    else if (key == "prior") p.prior = in(0, 1e6);
    else if (key == "min_prob") p.min_prob = in(0, 1);
    else if (key == "tree_min_prob") p.tree_min_prob = in(0, 1);
    else if (key == "length_factor") p.length_factor = in(0.01, 1e6);
    else if (key == "fallback") p.fallback = in(0, 1) != 0;
    else if (key == "extend") p.extend = in(0, 1) != 0;
    else if (key == "count_option") p.count_option = in(0, 1) != 0;
    else if (key == "count_prior") p.count_prior = in(0, 1e6);
    else if (key == "corpus_prior") p.corpus_prior = in(0, 1e6);
    else if (key == "max_options") p.max_options = static_cast<int>(in(1, 8));
    else if (key == "history_tokens") p.history_tokens = static_cast<size_t>(in(0, 1e9));
    else if (key == "corpus_min_match") p.corpus_min_match = static_cast<int>(in(1, 64));
    else invalid("match_params has no '" + key + "'");
  }
  return p;
}

void check_tokens(const Token* p, size_t n, uint32_t vocab, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] < 0 || static_cast<uint32_t>(p[i]) >= vocab) {
      invalid(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
}

// Count tables carry no vocabulary of their own: their tokens are bounded by the one limit.
constexpr uint32_t kAnyToken = ngc::kMaxVocab;

// For long native calls made with the GIL released: runs Python's signal handlers, so a
// Ctrl-C stops the call (true) with its KeyboardInterrupt pending for raise_status.
bool python_interrupted() {
  nb::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

struct PyStaticBuilder {
  std::unique_ptr<ngc::Builder> builder;
  bool finished = false;  // finish() ran (successfully or not); the builder is spent
  int ngram_size = 2;     // tokens per key
  uint32_t vocab_size = 0;

  ngc::Builder& get() {
    if (finished) invalid("this StaticBuilder has finished; create a new one");
    return *builder;
  }
};

nb::dict build_stats(const ngc::BuildStats& st) {
  nb::dict d;
  d["n_tokens"] = st.n_tokens;
  d["n_streams"] = st.n_streams;
  d["n_pairs"] = st.n_pairs;
  d["n_runs"] = st.n_runs;
  d["bytes_spilled"] = st.bytes_spilled;
  d["n_keys"] = st.n_keys;
  d["n_merge_passes"] = st.n_merge_passes;
  d["n_indexed"] = st.n_indexed;
  d["n_not_indexed"] = st.n_not_indexed;
  return d;
}

void check_vocab_size(int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > ngc::kMaxVocab) {
    invalid("vocab_size must be in 1.." + std::to_string(ngc::kMaxVocab) + " (2^24), got " + std::to_string(vocab_size));
  }
}

void check_fingerprint(const nb::bytes& fingerprint) {
  if (fingerprint.size() != ngc::kFingerprintSize) {
    invalid("fingerprint must be " + std::to_string(ngc::kFingerprintSize) + " bytes (a tokenizer's .fingerprint, or UNTAGGED), got " +
            std::to_string(fingerprint.size()));
  }
}

ngc::StaticHeader make_header(int64_t vocab_size, int ngram_size, nb::bytes fingerprint, int64_t generation) {
  check_vocab_size(vocab_size);
  if (generation < 0) invalid("generation must be >= 0, got " + std::to_string(generation));
  if (ngram_size < 1 || ngram_size > ngc::kNgramMax) invalid("ngram_size must be in 1..4, got " + std::to_string(ngram_size));
  check_fingerprint(fingerprint);
  ngc::StaticHeader h;
  h.ngram_size = static_cast<uint32_t>(ngram_size);
  h.vocab_size = static_cast<uint32_t>(vocab_size);
  std::memcpy(h.fingerprint, fingerprint.c_str(), ngc::format::kFingerprintSize);
  h.generation = static_cast<uint64_t>(generation);
  return h;
}

// Count rows (rows.h) as a checked, borrowed view.
template <typename T>
struct RowsView {
  nb::ndarray<nb::ro, nb::device::cpu> array;  // holds a reference to the buffer
  const T* data = nullptr;
  size_t n = 0;
};

template <typename T>
RowsView<T> as_rows(nb::handle h) {
  RowsView<T> v;
  const char* type = sizeof(T) == 4 ? "int32" : "int64";
  if (!nb::try_cast(h, v.array, false) || v.array.dtype() != nb::dtype<T>() || v.array.ndim() != 2 ||
      v.array.shape(1) != rows::kWidth ||
      (v.array.shape(0) > 0 && (v.array.stride(1) != 1 || v.array.stride(0) != rows::kWidth))) {
    invalid(std::string("rows must be a C-contiguous ") + type + " numpy array of shape (m, " + std::to_string(rows::kWidth) +
            ") (see ngramcache.client.rows)");
  }
  v.data = static_cast<const T*>(v.array.data());
  v.n = v.array.shape(0);
  return v;
}

nb::ndarray<nb::numpy, int32_t> rows_to_numpy(std::vector<int32_t>&& rows) {
  const size_t m = rows.size() / rows::kWidth;
  return to_numpy(std::move(rows), {m, static_cast<size_t>(rows::kWidth)});
}

struct PyStaticCache {
  std::shared_ptr<const ngc::StaticCache> cache;  // shared with the drafters it is attached to
  std::string path;
};

// A CountTable shared with Python and with the drafters it is attached to.
struct PyCountTable {
  std::shared_ptr<ngc::SharedCountTable> shared = std::make_shared<ngc::SharedCountTable>();
};

struct PyDrafter {
  std::unique_ptr<ngc::Drafter> drafter;
  nb::object static_ref = nb::none();   // the Python objects attached, for the properties
  nb::object dynamic_ref = nb::none();
};

// Looks `ngram` up in `c` (it MUST have the file's n-gram size); false when absent.
bool find_static(const PyStaticCache& c, const std::vector<int64_t>& ngram, ngc::StaticPart* part) {
  const auto& info = c.cache->info();
  if (ngram.size() != info.ngram_size) {
    invalid("this static cache has keys of " + std::to_string(info.ngram_size) + " tokens, got an n-gram of " +
            std::to_string(ngram.size()));
  }
  const ngc::NGram g = as_ngram(ngram, info.vocab_size);
  const ngc::FindResult r = c.cache->find(g.tokens, part);
  if (r == ngc::FindResult::kCorrupt) raise_status(Status::FormatError(c.path + ": key index points outside its section"));
  return r == ngc::FindResult::kFound;
}

nb::tuple part_to_numpy(const ngc::PartView& part) {
  std::vector<int32_t> toks(part.size);
  std::vector<int64_t> counts(part.size);
  for (uint32_t j = 0; j < part.size; ++j) {
    toks[j] = part.followers[j].token;
    counts[j] = part.followers[j].count;
  }
  return nb::make_tuple(to_numpy(std::move(toks), {part.size}), to_numpy(std::move(counts), {part.size}));
}

std::vector<int32_t> table_rows(const ngc::CountTable& t) {
  std::vector<int32_t> out;
  out.reserve(t.n_entries() * rows::kWidth);
  t.for_each([&](const ngc::NGram& key, const ngc::PartView& part) {
    for (uint32_t j = 0; j < part.size; ++j) rows::append(&out, key, part.followers[j].token, part.followers[j].count);
  });
  return out;
}

// `obj` as a StaticCache (or null for None); a clear TypeError for anything else.
PyStaticCache* as_static_cache(nb::handle obj, const char* what) {
  if (obj.is_none()) return nullptr;
  if (!nb::isinstance<PyStaticCache>(obj)) {
    std::string msg = std::string(what) + " must be a StaticCache or None, got " + Py_TYPE(obj.ptr())->tp_name;
    if (PyUnicode_Check(obj.ptr()) || PyObject_HasAttrString(obj.ptr(), "__fspath__")) msg += "; open the file first: StaticCache.open(path)";
    throw nb::type_error(msg.c_str());
  }
  return &nb::cast<PyStaticCache&>(obj);
}

PyCountTable* as_count_table(nb::handle obj, const char* what) {
  if (obj.is_none()) return nullptr;
  if (!nb::isinstance<PyCountTable>(obj)) {
    throw nb::type_error((std::string(what) + " must be a CountTable or None, got " + Py_TYPE(obj.ptr())->tp_name).c_str());
  }
  return &nb::cast<PyCountTable&>(obj);
}

void set_static(PyDrafter& d, nb::object cache) {
  PyStaticCache* sc = as_static_cache(cache, "static");
  check(d.drafter->set_static(sc ? sc->cache : nullptr));
  d.static_ref = cache;
}

nb::bytes fingerprint_bytes(const uint8_t* fp) { return nb::bytes(reinterpret_cast<const char*>(fp), ngc::kFingerprintSize); }

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "The compiled ngramcache core: count tables, static caches and the drafter.";
  m.attr("FORMAT_VERSION") = ngc::format::kVersion;
  {
    const ngc::MatchParams p;
    nb::dict d;
    d["min_match"] = p.min_match;
    d["corpus_min_match"] = p.corpus_min_match;
    d["max_match"] = p.max_match;
    d["max_chain"] = p.max_chain;
    d["max_candidates"] = p.max_candidates;
    d["max_options"] = p.max_options;
    d["prior"] = p.prior;
    d["count_prior"] = p.count_prior;
    d["corpus_prior"] = p.corpus_prior;
    d["min_prob"] = p.min_prob;
    d["tree_min_prob"] = p.tree_min_prob;
    d["length_factor"] = p.length_factor;
    d["history_tokens"] = p.history_tokens;
    d["count_option"] = p.count_option;
    d["extend"] = p.extend;
    d["fallback"] = p.fallback;
    m.attr("MATCH_DEFAULTS") = d;
  }
  m.attr("MAX_DRAFT") = ngc::kMaxDraft;
  m.attr("NGRAM_MAX") = ngc::kNgramMax;
  m.attr("MAX_VOCAB") = ngc::kMaxVocab;
  m.attr("ROW_WIDTH") = rows::kWidth;
  m.attr("FINGERPRINT_SIZE") = ngc::kFingerprintSize;
  m.attr("UNTAGGED") = nb::bytes(std::string(ngc::kFingerprintSize, '\0').data(), ngc::kFingerprintSize);

  nb::class_<PyStaticCache>(m, "StaticCache",
                            "A read-only, memory-mapped static cache file. Opening costs O(1) in its size.\n"
                            "Thread-safe: every method may be called from any thread.")
      .def_static(
          "open",
          [](const Path& path) {
            std::unique_ptr<ngc::StaticCache> cache;
            check(ngc::StaticCache::open(path.string(), &cache));
            auto* c = new PyStaticCache();
            c->cache = std::move(cache);
            c->path = path.string();
            return c;
          },
          nb::sig("def open(path: str | os.PathLike[str]) -> StaticCache"), "path"_a, nb::rv_policy::take_ownership,
          "Maps and validates the header of the static cache at `path`.\n\n"
          "Raises:\n    CacheFormatError: the file is truncated, corrupt or not a static cache.\n"
          "    OSError: the file cannot be opened or mapped.")
      .def_prop_ro("path", [](const PyStaticCache& c) { return c.path; })
      .def_prop_ro("format_version", [](const PyStaticCache& c) { return c.cache->info().format_version; })
      .def_prop_ro("ngram_size", [](const PyStaticCache& c) { return c.cache->info().ngram_size; })
      .def_prop_ro("vocab_size", [](const PyStaticCache& c) { return c.cache->info().vocab_size; })
      .def_prop_ro("fingerprint", [](const PyStaticCache& c) {
        return fingerprint_bytes(c.cache->info().fingerprint);
      })
      .def_prop_ro("generation", [](const PyStaticCache& c) { return c.cache->info().generation; })
      .def_prop_ro("n_keys", [](const PyStaticCache& c) { return c.cache->info().n_keys; })
      .def_prop_ro("n_followers", [](const PyStaticCache& c) { return c.cache->info().n_followers; })
      .def_prop_ro("n_tokens", [](const PyStaticCache& c) { return c.cache->info().n_tokens; })
      .def_prop_ro("n_overflow", [](const PyStaticCache& c) { return c.cache->info().n_overflow; })
      .def_prop_ro("file_size", [](const PyStaticCache& c) { return c.cache->info().file_size; })
      .def_prop_ro("index_depth", [](const PyStaticCache& c) { return c.cache->info().index_depth; },
                   "The corpus index's depth (the longest match it finds); 0: the file has no corpus index.")
      .def_prop_ro("n_indexed", [](const PyStaticCache& c) { return c.cache->info().n_suffixes; },
                   "Corpus tokens in the corpus index (0: none).")
      .def(
          "corpus_match",
          [](const PyStaticCache& c, nb::handle tokens) {
            TokenView v = as_tokens(tokens, "tokens");
            check_tokens(v.data, v.size, c.cache->info().vocab_size, "tokens");
            const ngc::CorpusIndex& ix = c.cache->corpus();
            const ngc::CorpusMatch m = ngc::corpus_longest_match(ix, v.data, v.size, ix.depth);
            return nb::make_tuple(m.length, m.hi - m.lo);
          },
          nb::sig("def corpus_match(self, tokens: NDArray[numpy.int32]) -> tuple[int, int]"), "tokens"_a,
          "The longest suffix of `tokens` (at most index_depth tokens) that the corpus index holds:\n"
          "(its length, how many times it occurs). (0, 0) when none, or without a corpus index.")
      .def_prop_ro(
          "sections",
          [](const PyStaticCache& c) {
            nb::list out;
            const ngc::StaticInfo& info = c.cache->info();
            for (uint32_t i = 0; i < info.n_sections; ++i) {
              const ngc::SectionInfo& s = info.sections[i];
              nb::dict d;
              d["name"] = ngc::format::section_name(s.id);
              d["offset"] = s.offset;
              d["length"] = s.length;
              d["checksum"] = s.checksum;
              out.append(d);
            }
            return out;
          },
          nb::sig("def sections(self) -> list[dict[str, int | str]]"),
          "The section table: a list of dicts with name, offset, length and checksum.")
      .def(
          "lookup",
          [](const PyStaticCache& c, const std::vector<int64_t>& ngram) {
            ngc::StaticPart part;
            std::vector<std::pair<int32_t, int64_t>> items;
            if (find_static(c, ngram, &part)) {
              for (uint32_t j = 0; j < part.size; ++j) items.emplace_back(c.cache->token_at(part, j), c.cache->count_at(part, j));
              std::sort(items.begin(), items.end());
            }
            std::vector<int32_t> toks;
            std::vector<int64_t> counts;
            for (auto& [t, n] : items) {
              toks.push_back(t);
              counts.push_back(n);
            }
            const size_t n = toks.size();
            return nb::make_tuple(to_numpy(std::move(toks), {n}), to_numpy(std::move(counts), {n}));
          },
          nb::sig("def lookup(self, ngram: Sequence[int]) -> tuple[NDArray[numpy.int32], NDArray[numpy.int64]]"), "ngram"_a,
          "The followers of `ngram` (exactly ngram_size tokens) as (tokens int32, counts int64),\n"
          "sorted by token; empty arrays when the n-gram is absent.")
      .def(
          "best",
          [](const PyStaticCache& c, const std::vector<int64_t>& ngram) -> std::optional<std::tuple<int, int64_t, int64_t>> {
            ngc::StaticPart part;
            if (!find_static(c, ngram, &part)) return std::nullopt;
            return std::make_tuple(c.cache->token_at(part, 0), int64_t{c.cache->count_at(part, 0)}, int64_t{part.total});
          },
          "ngram"_a, "(best token, its count, total count) of `ngram`, or None when absent.")
      .def(
          "verify",
          [](const PyStaticCache& c) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = c.cache->verify();
            }
            if (!s.ok()) raise_status(Status(s.code(), c.path + ": " + s.message()));
          },
          "Checks every section checksum and structural invariant (O(file size)).\n\n"
          "Raises:\n    CacheFormatError: naming the first problem found.")
      .def(
          "to_rows",
          [](const PyStaticCache& c) {
            const auto& info = c.cache->info();
            std::vector<int32_t> out;
            out.reserve(info.n_followers * rows::kWidth);
            for (uint64_t i = 0; i < info.n_keys; ++i) {
              ngc::NGram key;
              ngc::StaticPart part;
              check(c.cache->key_at(i, &key, &part));
              std::vector<std::pair<int32_t, uint32_t>> items;
              for (uint32_t j = 0; j < part.size; ++j) items.emplace_back(c.cache->token_at(part, j), c.cache->count_at(part, j));
              std::sort(items.begin(), items.end());
              for (auto& [t, n] : items) rows::append(&out, key, t, n);
            }
            return rows_to_numpy(std::move(out));
          },
          "Every (key, follower, count) as an int32 array of rows (n, t0, t1, t2, t3, follower, count),\n"
          "keys in lexicographic order, followers by token.")
      .def(
          "follower_histogram",
          [](const PyStaticCache& c) {
            // bucket b counts the keys with [2^b, 2^(b+1)) followers
            std::vector<uint64_t> h(33, 0);
            {
              nb::gil_scoped_release release;
              for (uint64_t i = 0; i < c.cache->info().n_keys; ++i) {
                const uint32_t n = c.cache->followers_of(i);
                if (n > 0) ++h[31 - __builtin_clz(n)];
              }
            }
            while (h.size() > 1 && h.back() == 0) h.pop_back();
            return h;
          },
          nb::sig("def follower_histogram(self) -> list[int]"),
          "Keys by follower count: element b counts the keys with 2^b .. 2^(b+1)-1 followers.")
      .def("memory_bytes", [](const PyStaticCache& c) { return c.cache->mapped_bytes(); },
           "Bytes mapped (the file size); shared with every other process mapping the file.")
      .def("__repr__", [](const PyStaticCache& c) {
        const auto& i = c.cache->info();
        return "StaticCache(path=" + std::string(nb::repr(nb::str(c.path.c_str())).c_str()) + ", generation=" +
               std::to_string(i.generation) + ", ngram_size=" + std::to_string(i.ngram_size) + ", vocab_size=" +
               std::to_string(i.vocab_size) + ", n_keys=" + std::to_string(i.n_keys) + ")";
      });

  nb::class_<PyCountTable>(m, "CountTable",
                           "n-gram (1..4 tokens) -> follower counts, for context and dynamic tables; tokens are\n"
                           "below MAX_VOCAB. Thread-safe: drafts read it from any thread while writers change it\n"
                           "(change sets are applied in short chunks, so a draft waits microseconds at most).")
      .def(nb::init<>())
      .def(
          "update",
          [](PyCountTable& t, nb::handle tokens, std::optional<int64_t> n_new, int ngram_min, int ngram_max) {
            check_ngram_range(ngram_min, ngram_max);
            TokenView v = as_tokens(tokens, "tokens");
            if (n_new && (*n_new < 0 || static_cast<size_t>(*n_new) > v.size)) {
              invalid("n_new must be in [0, len(tokens)], got " + std::to_string(*n_new));
            }
            const size_t nn = n_new ? static_cast<size_t>(*n_new) : v.size;
            check_tokens(v.data, v.size, kAnyToken, "tokens");
            nb::gil_scoped_release release;
            t.shared->write([&](ngc::CountTable& table) { table.update(v.data, v.size, nn, ngram_min, ngram_max); });
          },
          nb::sig("def update(self, tokens: NDArray[numpy.int32], n_new: int | None = None, ngram_min: int = 1, ngram_max: int = 4) -> None"), "tokens"_a, "n_new"_a = nb::none(), "ngram_min"_a = 1, "ngram_max"_a = 4,
          "llama.cpp's common_ngram_cache_update: counts, for each n-gram size n and each of the last\n"
          "`n_new` positions i >= n (default: all), follower tokens[i] of key tokens[i-n:i].")
      .def(
          "add",
          [](PyCountTable& t, const std::vector<int64_t>& ngram, int64_t token, int64_t count) {
            ngc::NGram g = as_ngram(ngram, kAnyToken);
            if (token < 0 || token >= kAnyToken) {
              invalid("follower token must be in [0, " + std::to_string(kAnyToken) + "), got " + std::to_string(token));
            }
            if (count <= 0 || count > UINT32_MAX) invalid("count must be in [1, 2^32), got " + std::to_string(count));
            t.shared->write([&](ngc::CountTable& table) { table.add(g, static_cast<Token>(token), static_cast<uint32_t>(count)); });
          },
          "ngram"_a, "token"_a, "count"_a = 1, "Adds `count` to follower `token` of `ngram`.")
      .def(
          "add_rows",
          [](PyCountTable& t, nb::handle rows_obj) {
            RowsView<int32_t> v = as_rows<int32_t>(rows_obj);
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.shared->add_rows(v.data, v.n, kAnyToken);
            }
            check(s);
          },
          nb::sig("def add_rows(self, rows: NDArray[numpy.int32]) -> None"), "rows"_a,
          "Adds int32 count rows (n, t0, t1, t2, t3, follower, count); all are checked before any is added.")
      .def(
          "assign_rows",
          [](PyCountTable& t, nb::handle rows_obj, bool zero_removes) {
            RowsView<int64_t> v = as_rows<int64_t>(rows_obj);
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.shared->assign_rows(v.data, v.n, kAnyToken, zero_removes);
            }
            check(s);
          },
          nb::sig("def assign_rows(self, rows: NDArray[numpy.int64], *, zero_removes: bool = False) -> None"), "rows"_a,
          nb::kw_only(), "zero_removes"_a = false,
          "Sets absolute counts from int64 rows (n, t0, t1, t2, t3, follower, count), as a counts store\n"
          "returns them: each (n-gram, follower) is inserted or overwritten (an upsert); counts above\n"
          "2^32-1 saturate. With zero_removes, a count of 0 removes the follower (a draft view's\n"
          "change log); otherwise counts must be >= 1. All rows are checked before any is applied;\n"
          "drafts running meanwhile see a valid table with part of the rows applied.")
      .def(
          "view_diff",
          [](const PyCountTable& t, const PyCountTable& published, nb::handle changed_obj, uint32_t top_k,
             const std::vector<int64_t>& min_total, uint32_t min_change_pct) {
            if (t.shared == published.shared) invalid("the published view must be another table");
            if (top_k < 1 || top_k > ngc::kMaxViewTopK) {
              invalid("top_k must be in 1.." + std::to_string(ngc::kMaxViewTopK) + ", got " + std::to_string(top_k));
            }
            if (min_total.size() != static_cast<size_t>(ngc::kNgramMax)) {
              invalid("min_total needs " + std::to_string(ngc::kNgramMax) + " values (one per n-gram size)");
            }
            ngc::ViewPolicy policy;
            policy.top_k = top_k;
            policy.min_change_pct = min_change_pct;
            for (int k = 0; k < ngc::kNgramMax; ++k) {
              if (min_total[k] < 1) invalid("min_total values must be >= 1");
              policy.min_total[k] = static_cast<uint64_t>(min_total[k]);
            }
            std::optional<RowsView<int64_t>> changed;
            if (!changed_obj.is_none()) {
              changed = as_rows<int64_t>(changed_obj);
              check(ngc::rows::validate_all(changed->data, changed->n, kAnyToken, INT64_MAX, 0));
            }
            std::vector<int64_t> out;
            {
              nb::gil_scoped_release release;
              auto full_lock = t.shared->read();
              auto pub_lock = published.shared->read();
              ngc::view_diff(t.shared->table(), published.shared->table(), changed ? changed->data : nullptr,
                             changed ? changed->n : 0, policy, &out);
            }
            const size_t m = out.size() / ngc::rows::kWidth;
            return to_numpy(std::move(out), {m, static_cast<size_t>(ngc::rows::kWidth)});
          },
          nb::sig("def view_diff(self, published: CountTable, changed: NDArray[numpy.int64] | None = None, *, "
                  "top_k: int = 4, min_total: Sequence[int] = (4, 3, 2, 2), min_change_pct: int = 25) -> NDArray[numpy.int64]"),
          "published"_a, "changed"_a = nb::none(), nb::kw_only(), "top_k"_a = 4,
          "min_total"_a = std::vector<int64_t>{4, 3, 2, 2}, "min_change_pct"_a = 25,
          "The int64 rows (n, t0..t3, follower, count) that bring `published` to this table's draft\n"
          "view for the keys of the int64 rows `changed` (every key when None): of each key whose\n"
          "total reaches min_total[n-1], its top_k followers by count; a count already published is\n"
          "updated only when it moved by more than min_change_pct percent; count 0 removes. Apply\n"
          "the result with published.assign_rows(rows, zero_removes=True). See ngc/draft_view.h.")
      .def(
          "to_rows",
          [](const PyCountTable& t) {
            auto lock = t.shared->read();
            return rows_to_numpy(table_rows(t.shared->table()));
          },
          "Every count as int32 rows (n, t0, t1, t2, t3, follower, count), shape (m, 7).")
      .def(
          "lookup",
          [](const PyCountTable& t, const std::vector<int64_t>& ngram) {
            ngc::NGram g = as_ngram(ngram, kAnyToken);
            auto lock = t.shared->read();
            ngc::PartView part;
            if (!t.shared->table().find(g, &part)) part = ngc::PartView{};
            return part_to_numpy(part);
          },
          nb::sig("def lookup(self, ngram: Sequence[int]) -> tuple[NDArray[numpy.int32], NDArray[numpy.int64]]"), "ngram"_a, "The followers of `ngram` as (tokens int32, counts int64), sorted by token.")
      .def(
          "merge",
          [](PyCountTable& t, const PyCountTable& other) {
            if (t.shared == other.shared) invalid("cannot merge a table into itself");
            nb::gil_scoped_release release;
            ngc::CountTable copy;  // never hold one table's lock while waiting for another's
            {
              auto lock = other.shared->read();
              copy = other.shared->table();
            }
            t.shared->write([&](ngc::CountTable& table) { table.merge(copy); });
          },
          "other"_a, "Adds every count of `other` to this table.")
      .def("clear", [](PyCountTable& t) { t.shared->write([](ngc::CountTable& table) { table.clear(); }); })
      .def_prop_ro("n_keys", [](const PyCountTable& t) { auto l = t.shared->read(); return t.shared->table().n_keys(); }, "Distinct n-grams.")
      .def_prop_ro("n_entries", [](const PyCountTable& t) { auto l = t.shared->read(); return t.shared->table().n_entries(); }, "Distinct (n-gram, follower) pairs.")
      .def("__len__", [](const PyCountTable& t) { auto l = t.shared->read(); return t.shared->table().n_keys(); })
      .def("memory_bytes", [](const PyCountTable& t) { auto l = t.shared->read(); return t.shared->table().memory_bytes(); }, "Heap bytes held by the table.")
      .def(
          "check_integrity",
          [](const PyCountTable& t) {
            auto lock = t.shared->read();
            check(t.shared->table().check_integrity());
          },
          "Checks every invariant of the table; raises CacheFormatError naming the first broken one.");

  nb::class_<PyDrafter>(m, "Drafter",
                        "llama.cpp-compatible n-gram drafter over per-sequence context tables, an optional\n"
                        "dynamic CountTable and an optional StaticCache, bound to one tokenizer. Drafting never\n"
                        "touches the network.\n"
                        "Thread-safe: drafts and accepts for different sequences run in parallel from several\n"
                        "threads (the GIL is released); calls for one sequence are serialized.")
      .def(
          "__init__",
          [](PyDrafter* d, nb::object static_cache, nb::object dynamic, std::optional<nb::bytes> fingerprint,
             std::optional<int64_t> vocab_size, int ngram_min, int ngram_max, bool track_deltas, int64_t max_sequences,
             double idle_ttl, int64_t max_memory, const std::string& mode, nb::object match_params) {
            check_ngram_range(ngram_min, ngram_max);
            PyStaticCache* sc = as_static_cache(static_cache, "static");
            PyCountTable* dyn = as_count_table(dynamic, "dynamic");
            ngc::DrafterOptions o;
            if (sc) {
              const ngc::StaticInfo& info = sc->cache->info();
              if (vocab_size && *vocab_size != info.vocab_size) {
                raise_status(Status::TokenizerMismatch("vocab_size " + std::to_string(*vocab_size) + " differs from the static cache's " +
                                                       std::to_string(info.vocab_size)));
              }
              if (fingerprint) {
                check_fingerprint(*fingerprint);
                if (std::memcmp(fingerprint->c_str(), info.fingerprint, ngc::kFingerprintSize) != 0) {
                  raise_status(Status::TokenizerMismatch("fingerprint differs from the static cache's: it was built for another tokenizer"));
                }
              }
              o.vocab_size = info.vocab_size;
              std::memcpy(o.fingerprint, info.fingerprint, ngc::kFingerprintSize);
            } else {
              if (!vocab_size || !fingerprint) {
                invalid("a Drafter without a static cache needs vocab_size and fingerprint (a tokenizer's .vocab_size and "
                        ".fingerprint, or UNTAGGED for raw tokens)");
              }
              check_vocab_size(*vocab_size);
              check_fingerprint(*fingerprint);
              o.vocab_size = static_cast<uint32_t>(*vocab_size);
              std::memcpy(o.fingerprint, fingerprint->c_str(), ngc::kFingerprintSize);
            }
            if (max_sequences < 0) invalid("max_sequences must be >= 0 (0: unlimited), got " + std::to_string(max_sequences));
            if (!(idle_ttl >= 0) || idle_ttl > 1e9) invalid("idle_ttl must be a number of seconds >= 0 (0: never), got " + std::to_string(idle_ttl));
            if (max_memory < 0) invalid("max_memory must be >= 0 bytes (0: unlimited), got " + std::to_string(max_memory));
            o.ngram_min = ngram_min;
            o.ngram_max = ngram_max;
            o.mode = parse_mode(mode) ? ngc::DraftMode::kMatch : ngc::DraftMode::kCompatible;
            o.match = match_params_from(match_params);
            o.match.ngram_min = ngram_min;
            o.match.ngram_max = ngram_max;
            o.track_deltas = track_deltas;
            o.limits.max_sequences = static_cast<size_t>(max_sequences);
            o.limits.idle_ttl_ms = static_cast<int64_t>(idle_ttl * 1000.0);
            if (idle_ttl > 0 && o.limits.idle_ttl_ms == 0) o.limits.idle_ttl_ms = 1;
            o.limits.max_memory_bytes = static_cast<size_t>(max_memory);
            new (d) PyDrafter{std::make_unique<ngc::Drafter>(o)};
            set_static(*d, static_cache);
            if (dyn) {
              d->drafter->set_dynamic(dyn->shared);
              d->dynamic_ref = dynamic;
            }
          },
          nb::sig("def __init__(self, static: StaticCache | None = None, dynamic: CountTable | None = None, *, "
                  "fingerprint: bytes | None = None, vocab_size: int | None = None, ngram_min: int = 1, ngram_max: int = 4, "
                  "track_deltas: bool = False, max_sequences: int = 0, idle_ttl: float = 0.0, max_memory: int = 0, "
                  "mode: str = 'compatible', match_params: dict[str, float] | None = None) -> None"),
          "static"_a = nb::none(), "dynamic"_a = nb::none(), nb::kw_only(), "fingerprint"_a = nb::none(), "vocab_size"_a = nb::none(),
          "ngram_min"_a = 1, "ngram_max"_a = 4, "track_deltas"_a = false, "max_sequences"_a = 0, "idle_ttl"_a = 0.0,
          "max_memory"_a = 0, "mode"_a = "compatible", "match_params"_a = nb::none(),
          "Args:\n    static: a StaticCache, or None.\n    dynamic: a CountTable (the dynamic table), or None.\n"
          "    fingerprint: the tokenizer's fingerprint (32 bytes; UNTAGGED for raw tokens); taken from\n"
          "        `static` when omitted, and checked against it when given.\n"
          "    vocab_size: token ids must be below it; taken from `static` when omitted.\n"
          "    ngram_min, ngram_max: the context/dynamic n-gram sizes tried (llama.cpp: 1 and 4).\n"
          "    track_deltas: keep the counts accepted since the last drain_deltas().\n"
          "    max_sequences: most sequences kept (0: unlimited); beyond, the least recently used is evicted.\n"
          "    idle_ttl: seconds after which an unused sequence is evicted by evict_idle() (0: never).\n"
          "    max_memory: most bytes of context tables (0: unlimited); beyond, least recently used go.\n"
          "    mode: 'compatible' (llama.cpp's drafts, token for token) or 'match' (longest matches over\n"
          "        the sequence, earlier sequences and the static file's corpus index, with the count\n"
          "        tables competing; more accepted tokens per step, and draft_tree()).\n"
          "    match_params: overrides of the match mode's tuning (MATCH_DEFAULTS); rarely needed.\n\n"
          "Raises:\n    TokenizerMismatchError: `fingerprint` or `vocab_size` differs from the static cache's.")
      .def(
          "draft",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int n_draft) {
            if (n_draft < 1 || n_draft > ngc::kMaxDraft) {
              invalid("n_draft must be in 1.." + std::to_string(ngc::kMaxDraft) + ", got " + std::to_string(n_draft));
            }
            TokenView v = as_tokens(tokens, "tokens");
            std::vector<int32_t> out(static_cast<size_t>(n_draft));
            int n = 0;
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->draft(seq, v.data, v.size, n_draft, out.data(), &n);
            }
            check(s);
            out.resize(static_cast<size_t>(n));
            return to_numpy(std::move(out), {static_cast<size_t>(n)});
          },
          nb::sig("def draft(self, seq: int, tokens: NDArray[numpy.int32], n_draft: int = 8) -> NDArray[numpy.int32]"), "seq"_a, "tokens"_a, "n_draft"_a = 8,
          "Drafts up to `n_draft` tokens to follow `tokens` (the whole sequence so far, int32) of\n"
          "sequence `seq`. Returns an int32 array, empty when nothing passes the thresholds.")
      .def(
          "draft_tree",
          [](PyDrafter& d, int64_t seq, nb::handle tokens, int budget) {
            TokenView v = as_tokens(tokens, "tokens");
            ngc::DraftTree tree;
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->draft_tree(seq, v.data, v.size, budget, &tree);
            }
            check(s);
            const size_t n = tree.tokens.size();
            return nb::make_tuple(to_numpy(std::move(tree.tokens), {n}), to_numpy(std::move(tree.parents), {n}));
          },
          nb::sig("def draft_tree(self, seq: int, tokens: NDArray[numpy.int32], budget: int = 16) -> "
                  "tuple[NDArray[numpy.int32], NDArray[numpy.int32]]"),
          "seq"_a, "tokens"_a, "budget"_a = 16,
          "Drafts a tree of at most `budget` nodes (match mode) for engines that verify a tree in one\n"
          "pass: (tokens, parents), node i is tokens[i] and follows node parents[i] (-1: follows the\n"
          "sequence). Parents come before their children.")
      .def_prop_ro("mode", [](PyDrafter& d) {
        return std::string(d.drafter->options().mode == ngc::DraftMode::kMatch ? "match" : "compatible");
      }, "'compatible' or 'match'.")
      .def(
          "draft_batch",
          [](PyDrafter& d, const std::vector<int64_t>& seqs, nb::sequence token_arrays, int n_draft) {
            if (n_draft < 1 || n_draft > ngc::kMaxDraft) {
              invalid("n_draft must be in 1.." + std::to_string(ngc::kMaxDraft) + ", got " + std::to_string(n_draft));
            }
            const size_t m = seqs.size();
            if (nb::len(token_arrays) != m) {
              invalid("seqs and tokens must have the same length, got " + std::to_string(m) + " and " +
                      std::to_string(nb::len(token_arrays)));
            }
            std::vector<TokenView> views;
            views.reserve(m);
            for (size_t i = 0; i < m; ++i) views.push_back(as_tokens(token_arrays[i], ("tokens[" + std::to_string(i) + "]").c_str()));
            std::vector<int32_t> out(m * static_cast<size_t>(n_draft));
            std::vector<int32_t> lengths(m, 0);
            Status s;
            {
              nb::gil_scoped_release release;
              for (size_t i = 0; i < m && s.ok(); ++i) {
                s = d.drafter->draft(seqs[i], views[i].data, views[i].size, n_draft, out.data() + i * n_draft, &lengths[i]);
                if (!s.ok()) s = Status(s.code(), "sequence " + std::to_string(i) + ": " + s.message());
              }
            }
            check(s);
            return nb::make_tuple(to_numpy(std::move(out), {m, static_cast<size_t>(n_draft)}),
                                  to_numpy(std::move(lengths), {m}));
          },
          nb::sig("def draft_batch(self, seqs: Sequence[int], tokens: Sequence[NDArray[numpy.int32]], n_draft: int = 8) -> "
                  "tuple[NDArray[numpy.int32], NDArray[numpy.int32]]"),
          "seqs"_a, "tokens"_a, "n_draft"_a = 8,
          "Drafts for several sequences in one call (as a batching engine does each step), with the\n"
          "GIL released for the whole batch. Returns (drafts, lengths): row i of the int32 array\n"
          "drafts (shape (m, n_draft)) holds lengths[i] drafted tokens of draft(seqs[i], tokens[i],\n"
          "n_draft), then padding.")
      .def(
          "accept",
          [](PyDrafter& d, int64_t seq, nb::handle tokens) {
            TokenView v = as_tokens(tokens, "tokens");
            Status s;
            {
              nb::gil_scoped_release release;
              s = d.drafter->accept(seq, v.data, v.size);
            }
            check(s);
          },
          nb::sig("def accept(self, seq: int, tokens: NDArray[numpy.int32]) -> None"), "seq"_a, "tokens"_a,
          "Counts the tokens of `tokens` (the whole sequence so far) not yet accepted for `seq` into its\n"
          "context table (and the pending deltas).")
      .def(
          "reset",
          [](PyDrafter& d, int64_t seq) {
            nb::gil_scoped_release release;
            return d.drafter->sequences().reset(seq);
          },
          "seq"_a, "Forgets sequence `seq` and frees its context table; returns whether it was known.")
      .def(
          "evict_idle",
          [](PyDrafter& d) {
            nb::gil_scoped_release release;
            return d.drafter->sequences().evict_idle();
          },
          "Evicts the sequences unused for longer than idle_ttl; returns how many (call it periodically).")
      .def(
          "set_static",
          [](PyDrafter& d, nb::object cache) {
            set_static(d, cache);
          },
          nb::sig("def set_static(self, static: StaticCache | None) -> None"), "static"_a.none(),
          "Swaps in another static cache (a newer generation) between two drafts; drafts in flight\n"
          "finish on the old one.\n\n"
          "Raises:\n    TokenizerMismatchError: it was built for another tokenizer or vocabulary.\n"
          "    InvalidArgumentError: its generation is older than the attached one's.")
      .def(
          "set_dynamic",
          [](PyDrafter& d, nb::object table) {
            PyCountTable* t = as_count_table(table, "dynamic");
            d.drafter->set_dynamic(t ? t->shared : nullptr);
            d.dynamic_ref = table;
          },
          nb::sig("def set_dynamic(self, dynamic: CountTable | None) -> None"), "dynamic"_a.none(),
          "Attaches another dynamic table (or None).")
      .def_prop_ro("static", [](PyDrafter& d) { return d.static_ref; }, nb::sig("def static(self) -> StaticCache | None"))
      .def_prop_ro("dynamic", [](PyDrafter& d) { return d.dynamic_ref; }, nb::sig("def dynamic(self) -> CountTable | None"))
      .def_prop_ro("vocab_size", [](PyDrafter& d) { return d.drafter->options().vocab_size; })
      .def_prop_ro("fingerprint", [](PyDrafter& d) { return fingerprint_bytes(d.drafter->options().fingerprint); },
                   "The tokenizer fingerprint this drafter is bound to (UNTAGGED for raw tokens).")
      .def_prop_ro("n_sequences", [](PyDrafter& d) { return d.drafter->sequences().size(); })
      .def_prop_ro("n_evicted", [](PyDrafter& d) { return d.drafter->sequences().n_evicted(); },
                   "Sequences evicted by max_sequences, idle_ttl or max_memory so far.")
      .def("memory_bytes", [](PyDrafter& d) { return d.drafter->memory_bytes(); },
           "Heap bytes of this drafter's context tables (the static cache is mapped and shared; the\n"
           "dynamic table is counted by its owner).")
      .def(
          "context_rows",
          [](PyDrafter& d, int64_t seq) {
            std::vector<int32_t> out = d.drafter->sequences().with_context(seq, [](const ngc::CountTable* t) {
              return t ? table_rows(*t) : std::vector<int32_t>{};
            });
            return rows_to_numpy(std::move(out));
          },
          "seq"_a, "The context table of `seq` as count rows (n, t0, t1, t2, t3, follower, count).")
      .def(
          "drain_deltas",
          [](PyDrafter& d) {
            std::vector<int32_t> out;
            {
              nb::gil_scoped_release release;
              d.drafter->sequences().drain_deltas(&out);
            }
            return rows_to_numpy(std::move(out));
          },
          "The counts accepted since the last call, as count rows (n, t0, t1, t2, t3, follower, count).");

  nb::class_<PyStaticBuilder>(m, "StaticBuilder",
                              "Counts (ngram_size-gram, follower) pairs of token streams within a memory budget\n"
                              "(sorted runs spill to scratch files) and writes a static cache atomically.\n"
                              "Not thread-safe: use one builder from one thread; it sorts on `threads` threads.")
      .def(
          "__init__",
          [](PyStaticBuilder* self, const Path& path, int64_t vocab_size, int ngram_size, nb::bytes fingerprint,
             int64_t generation, int64_t memory_budget, const Path& scratch_dir, int threads, int max_fan_in, bool corpus_index,
             int index_depth) {
            ngc::BuilderOptions o;
            if (index_depth < 1 || index_depth > static_cast<int>(ngc::format::kMaxIndexDepth)) {
              invalid("index_depth must be in 1.." + std::to_string(ngc::format::kMaxIndexDepth) + ", got " + std::to_string(index_depth));
            }
            o.corpus_index = corpus_index;
            o.index_depth = static_cast<uint32_t>(index_depth);
            o.header = make_header(vocab_size, ngram_size, fingerprint, generation);
            const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
            if (memory_budget <= 0 || (physical > 0 && memory_budget > physical)) {
              invalid("memory_budget must be a positive number of bytes within this machine's memory (" +
                      std::to_string(physical >> 20) + " MiB), got " + std::to_string(memory_budget));
            }
            o.memory_budget = static_cast<uint64_t>(memory_budget);
            o.scratch_dir = scratch_dir.string();
            o.threads = threads;
            o.max_fan_in = max_fan_in;
            std::unique_ptr<ngc::Builder> b;
            check(ngc::Builder::create(o, path.string(), &b));
            new (self) PyStaticBuilder{std::move(b), false, ngram_size, static_cast<uint32_t>(vocab_size)};
          },
          nb::sig("def __init__(self, path: str | os.PathLike[str], vocab_size: int, ngram_size: int = 2, *, fingerprint: bytes, "
                  "generation: int = 0, memory_budget: int = 1 << 30, scratch_dir: str | os.PathLike[str] = '', threads: int = 0, "
                  "max_fan_in: int = 64, corpus_index: bool = False, index_depth: int = 32) -> None"),
          "path"_a, "vocab_size"_a, "ngram_size"_a = 2, nb::kw_only(), "fingerprint"_a,
          "generation"_a = 0, "memory_budget"_a = uint64_t{1} << 30, "scratch_dir"_a = "", "threads"_a = 0, "max_fan_in"_a = 64,
          "corpus_index"_a = false, "index_depth"_a = 32,
          "Args:\n    path: the static cache to write (atomically, at finish()).\n"
          "    vocab_size: every token must be below it (1..2^24).\n    ngram_size: tokens per key (1..4).\n"
          "    fingerprint: the tokenizer's fingerprint (32 bytes), or UNTAGGED for raw tokens.\n"
          "    generation: the generation number (>= 0).\n"
          "    memory_budget: bytes of buffers at most (>= 16 MiB); beyond it, sorted runs go to disk.\n"
          "    scratch_dir: where runs go (default: beside `path`).\n    threads: sorting threads (0: all cores).\n"
          "    max_fan_in: runs merged at once; more runs are merged in passes.\n"
          "    corpus_index: also index the tokens added for the match mode (format version 2). It\n"
          "        takes half the budget, 32 bytes a token while sorting; tokens past that are counted\n"
          "        but not indexed (stats['n_not_indexed']).\n"
          "    index_depth: the longest match the index finds (1..64).")
      .def("begin_stream", [](PyStaticBuilder& b) { b.get().begin_stream(); },
           "Starts a new stream (an input file): n-grams never span two streams.")
      .def(
          "add_tokens",
          [](PyStaticBuilder& b, nb::handle tokens) {
            ngc::Builder& builder = b.get();
            TokenView v = as_tokens(tokens, "tokens");
            Status s;
            {
              nb::gil_scoped_release release;
              s = builder.add_tokens(v.data, v.size);
            }
            check(s);
          },
          nb::sig("def add_tokens(self, tokens: NDArray[numpy.int32]) -> None"), "tokens"_a,
          "Appends int32 tokens to the current stream (all are checked before any is counted).")
      .def(
          "add_rows",
          [](PyStaticBuilder& b, nb::handle rows) {
            ngc::Builder& builder = b.get();
            RowsView<int32_t> v = as_rows<int32_t>(rows);
            const int k = b.ngram_size;
            Status s = rows::validate_all(v.data, v.n, b.vocab_size, INT32_MAX);
            for (size_t i = 0; i < v.n && s.ok(); ++i) {
              if (v.data[rows::kWidth * i + rows::kN] != k) {
                s = Status::InvalidArgument("row " + std::to_string(i) + " has an n-gram of " +
                                            std::to_string(v.data[rows::kWidth * i + rows::kN]) + " tokens; this builder's keys have " +
                                            std::to_string(k));
              }
            }
            if (s.ok()) {
              nb::gil_scoped_release release;
              for (size_t i = 0; i < v.n && s.ok(); ++i) {
                const int32_t* r = v.data + rows::kWidth * i;
                s = builder.add_count(r + rows::kT0, r[rows::kFollower], static_cast<uint64_t>(r[rows::kCount]));
              }
            }
            check(s);
          },
          nb::sig("def add_rows(self, rows: NDArray[numpy.int32]) -> None"), "rows"_a,
          "Adds weighted rows (n, t0, t1, t2, t3, follower, count) whose n is the builder's ngram_size.")
      .def(
          "add_static",
          [](PyStaticBuilder& b, const PyStaticCache& c) {
            ngc::Builder& builder = b.get();
            const auto& info = c.cache->info();
            if (static_cast<int>(info.ngram_size) != b.ngram_size) {
              invalid(c.path + " has keys of " + std::to_string(info.ngram_size) + " tokens; this builder's have " +
                      std::to_string(b.ngram_size));
            }
            if (info.vocab_size > b.vocab_size) {
              invalid(c.path + " has vocabulary size " + std::to_string(info.vocab_size) + ", above this builder's " +
                      std::to_string(b.vocab_size));
            }
            Status s;
            {
              nb::gil_scoped_release release;
              for (uint64_t i = 0; i < info.n_keys && s.ok(); ++i) {
                ngc::NGram key;
                ngc::StaticPart part;
                s = c.cache->key_at(i, &key, &part);
                for (uint32_t j = 0; j < part.size && s.ok(); ++j) {
                  s = builder.add_count(key.tokens, c.cache->token_at(part, j), c.cache->count_at(part, j));
                }
              }
            }
            if (!s.ok()) raise_status(Status(s.code(), c.path + ": " + s.message()));
            if (info.n_tokens == 0 && info.n_keys > 0) {
              builder.mark_tokens_unknown();  // its source did not record it: the sum cannot be known
            } else {
              builder.add_observed_tokens(info.n_tokens);
            }
          },
          "cache"_a, "Adds every count of static cache `cache` (same n-gram size) to the build, and its\n"
          "n_tokens to the header's (when `cache` does not know its own, neither does the result).")
      .def(
          "finish",
          [](PyStaticBuilder& b) {
            ngc::Builder& builder = b.get();
            b.finished = true;
            builder.set_interrupt_check(python_interrupted);
            Status s;
            {
              nb::gil_scoped_release release;
              s = builder.finish();
            }
            check(s);
            return build_stats(builder.stats());
          },
          nb::sig("def finish(self) -> dict[str, int]"),
          "Merges the runs and writes the file (temporary name, fsync, rename); returns counters.")
      .def_prop_ro("stats", [](PyStaticBuilder& b) { return build_stats(b.builder->stats()); },
                   nb::sig("def stats(self) -> dict[str, int]"), "Counters so far: tokens, streams, pairs, runs.");

  m.def(
      "import_llama",
      [](const Path& in_path_arg, PyStaticBuilder& b) {
        const std::string in_path = in_path_arg.string();
        ngc::Builder& builder = b.get();
        const int k = b.ngram_size;
        const uint32_t vocab = b.vocab_size;
        Status s;
        {
          nb::gil_scoped_release release;
          s = ngc::read_llama_file(in_path, vocab, [&](const ngc::NGram& key, Token follower, uint32_t count) -> Status {
            if (key.size() != k) {
              return Status::FormatError("an n-gram of " + std::to_string(key.size()) + " tokens; this import builds keys of " +
                                         std::to_string(k) + " (a static cache has one n-gram size)");
            }
            return builder.add_count(key.tokens, follower, count);
          });
        }
        check(s);
      },
      "path"_a, "builder"_a,
      "Adds every entry of llama.cpp cache file `path` to `builder` (whose ngram_size every key must\n"
      "have). Raises CacheFormatError naming the byte offset of a malformed record.");
  m.def(
      "load_llama_counts",
      [](const Path& in_path_arg, int64_t vocab_size, PyCountTable& table) {
        const std::string in_path = in_path_arg.string();
        check_vocab_size(vocab_size);
        Status s;
        {
          nb::gil_scoped_release release;
          ngc::CountTable staged;  // all or nothing: the table changes only if the whole file is good
          s = ngc::read_llama_file(in_path, static_cast<uint32_t>(vocab_size), [&](const ngc::NGram& key, Token follower, uint32_t count) {
            staged.add(key, follower, count);
            return Status::Ok();
          });
          if (s.ok()) table.shared->write([&](ngc::CountTable& t) { t.merge(staged); });
        }
        check(s);
      },
      "path"_a, "vocab_size"_a, "table"_a,
      "Adds every entry of llama.cpp cache file `path` (any n-gram sizes, e.g. a dynamic cache) to\n"
      "`table`; nothing is added when the file is malformed.");
  m.def(
      "export_llama",
      [](const PyStaticCache& c, const Path& out_path_arg) {
        const std::string out_path = out_path_arg.string();
        Status s;
        {
          nb::gil_scoped_release release;
          s = ngc::write_llama_file(*c.cache, out_path, python_interrupted);
        }
        check(s);
      },
      "cache"_a, "path"_a, "Writes `cache` in llama.cpp's format (loadable with llama-lookup's -lcs), atomically.");

  m.def(
      "replay",
      [](nb::handle tokens, int64_t n_ctx, int n_draft, int ngram_min, int ngram_max, nb::object static_cache,
         PyCountTable& dynamic, bool dump_drafts, const std::string& mode, int tree_budget, nb::object match_params) {
        check_ngram_range(ngram_min, ngram_max);
        const bool match = parse_mode(mode);
        if (tree_budget < 0 || tree_budget > ngc::kMaxDraft) {
          invalid("tree_budget must be in 0.." + std::to_string(ngc::kMaxDraft) + ", got " + std::to_string(tree_budget));
        }
        if (tree_budget > 0 && !match) invalid("tree drafts need mode='match'");
        if (n_draft < 1 || n_draft > ngc::kMaxDraft) {
          invalid("n_draft must be in 1.." + std::to_string(ngc::kMaxDraft) + ", got " + std::to_string(n_draft));
        }
        if (n_ctx < 2) invalid("n_ctx must be >= 2, got " + std::to_string(n_ctx));
        TokenView v = as_tokens(tokens, "tokens");
        const ngc::StaticCache* st = nullptr;
        if (PyStaticCache* sc = as_static_cache(static_cache, "static")) {
          st = sc->cache.get();
          check_tokens(v.data, v.size, st->info().vocab_size, "tokens");
        } else {
          check_tokens(v.data, v.size, kAnyToken, "tokens");
        }
        ngc::DraftParams p;
        p.n_draft = n_draft;
        p.ngram_min = ngram_min;
        p.ngram_max = ngram_max;
        ngc::MatchParams mp = match_params_from(match_params);
        mp.n_draft = n_draft;
        mp.ngram_min = ngram_min;
        mp.ngram_max = ngram_max;
        std::vector<Token> drafts;
        ngc::ReplayStats r;
        {
          nb::gil_scoped_release release;
          dynamic.shared->write([&](ngc::CountTable& table) {
            if (match) {
              r = ngc::replay_match(v.data, v.size, static_cast<size_t>(n_ctx), mp, tree_budget, st, &table,
                                    dump_drafts ? &drafts : nullptr);
            } else {
              r = ngc::replay(v.data, v.size, static_cast<size_t>(n_ctx), p, st, &table, dump_drafts ? &drafts : nullptr);
            }
          });
        }
        nb::dict out;
        out["n_chunks"] = r.n_chunks;
        out["n_draft_calls"] = r.n_draft_calls;
        out["n_drafted"] = r.n_drafted;
        out["n_accept"] = r.n_accept;
        out["t_draft_ns"] = r.t_draft_ns;
        out["t_draft_only_ns"] = r.t_draft_only_ns;
        if (dump_drafts) {
          const size_t n = drafts.size();
          out["drafts"] = to_numpy(std::move(drafts), {n});
        }
        return out;
      },
      nb::sig("def replay(tokens: NDArray[numpy.int32], n_ctx: int, n_draft: int, ngram_min: int, ngram_max: int, "
              "static: StaticCache | None, dynamic: CountTable, dump_drafts: bool = False, mode: str = 'compatible', "
              "tree_budget: int = 0, match_params: dict[str, float] | None = None) -> dict[str, typing.Any]"),
      "tokens"_a, "n_ctx"_a, "n_draft"_a, "ngram_min"_a, "ngram_max"_a, "static"_a.none(), "dynamic"_a, "dump_drafts"_a = false,
      "mode"_a = "compatible", "tree_budget"_a = 0, "match_params"_a = nb::none(),
      "llama-lookup-stats' replay of `tokens` in chunks of n_ctx; merges each chunk's context\n"
      "table into `dynamic`. Returns counters and timings (and with dump_drafts, every call's\n"
      "drafted tokens, each call's followed by -1).\n\n"
      "mode: 'compatible' (llama.cpp's drafts) or 'match' (longest-match drafts); tree_budget > 0\n"
      "(match mode): tree drafts of at most that many nodes, scored by their longest accepted\n"
      "path. match_params: overrides of the match mode's tuning (MATCH_DEFAULTS names them).");

  m.def(
      "write_file_atomic",
      [](const Path& path, nb::bytes data) {
        const std::string p = path.string();
        std::string copy(data.c_str(), data.size());
        Status s;
        {
          nb::gil_scoped_release release;
          std::unique_ptr<ngc::AtomicFile> f;
          s = ngc::AtomicFile::create(p, &f);
          if (s.ok()) s = f->write(copy.data(), copy.size());
          if (s.ok()) s = f->commit();
        }
        check(s);
      },
      nb::sig("def write_file_atomic(path: str | os.PathLike[str], data: bytes) -> None"), "path"_a, "data"_a,
      "Writes `data` to `path` whole or not at all (temporary file beside it, fsync, rename,\n"
      "fsync of the directory): the helper every writer of ngramcache publishes files with.");
  m.def(
      "checksum64",
      [](nb::bytes data, uint64_t seed) { return ngc::checksum64(data.c_str(), data.size(), seed); },
      "data"_a, "seed"_a = 0, "The 64-bit checksum used by static cache headers and sections.");
  m.def(
      "ngram_hash", [](const std::vector<int64_t>& ngram) { return as_ngram(ngram, kAnyToken).hash(); }, "ngram"_a,
      "The hash count tables use for `ngram` (for tests that need colliding keys).");

  m.def(
      "build_static_from_tokens",
      [](nb::list streams, const Path& path, int64_t vocab_size, int ngram_size, nb::bytes fingerprint, int64_t generation,
         bool corpus_index, int64_t memory_budget) {
        ngc::StaticHeader h = make_header(vocab_size, ngram_size, fingerprint, generation);
        if (memory_budget < int64_t{16} << 20) {
          invalid("memory_budget must be at least 16 MiB, got " + std::to_string(memory_budget));
        }
        std::vector<TokenView> views;
        std::vector<ngc::TokenStream> refs;
        for (size_t i = 0; i < streams.size(); ++i) views.push_back(as_tokens(streams[i], ("streams[" + std::to_string(i) + "]").c_str()));
        for (const TokenView& v : views) refs.push_back({v.data, v.size});
        Status s;
        ngc::BuildStats st;
        {
          nb::gil_scoped_release release;
          s = ngc::build_static(refs, h, path.string(), corpus_index, static_cast<uint64_t>(memory_budget), &st);
        }
        check(s);
        return build_stats(st);
      },
      nb::sig("def build_static_from_tokens(streams: list[NDArray[numpy.int32]], path: str | os.PathLike[str], vocab_size: int, "
              "ngram_size: int = 2, *, fingerprint: bytes, generation: int = 0, corpus_index: bool = False, "
              "memory_budget: int = 1 << 30) -> dict[str, int]"),
      "streams"_a, "path"_a, "vocab_size"_a, "ngram_size"_a = 2, nb::kw_only(), "fingerprint"_a, "generation"_a = 0,
      "corpus_index"_a = false, "memory_budget"_a = int64_t{1} << 30,
      "Counts the (ngram_size-gram, follower) pairs of each int32 token stream (n-grams never span\n"
      "two streams) and writes a static cache to `path` atomically (temporary file, fsync, rename).\n"
      "`fingerprint` is the tokenizer's (32 bytes), or UNTAGGED for raw tokens. With corpus_index,\n"
      "the file also indexes the streams for the match mode (format version 2), within half of\n"
      "`memory_budget` (32 bytes a token): tokens past it are counted but not indexed.\n"
      "Returns the build's statistics (n_tokens, n_keys, n_indexed, n_not_indexed, ...);\n"
      "`ngramcache.build_static_from_tokens` also warns when tokens were left out of the index.");
}
