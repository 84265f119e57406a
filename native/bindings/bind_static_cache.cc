// StaticCache: a mapped static file, its header fields and its checked reads (static_reads.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "ngc/static_format.h"
#include "ngc/static_reads.h"

namespace ngc::py {

using namespace nb::literals;

PyStaticCache* as_static_cache(nb::handle obj, const char* what) {
  if (obj.is_none()) return nullptr;
  if (!nb::isinstance<PyStaticCache>(obj)) {
    std::string msg = std::string(what) + " must be a StaticCache or None, got " + Py_TYPE(obj.ptr())->tp_name;
    if (PyUnicode_Check(obj.ptr()) || PyObject_HasAttrString(obj.ptr(), "__fspath__")) {
      msg += "; open the file first: StaticCache.open(path)";
    }
    throw nb::type_error(msg.c_str());
  }
  return &nb::cast<PyStaticCache&>(obj);
}

void bind_static_cache(nb::module_& m) {
  nb::class_<PyStaticCache>(m, "StaticCache",
                            "A read-only, memory-mapped static cache file. Opening costs O(1) in its size.\n"
                            "Thread-safe: every method may be called from any thread.")
      .def_static(
          "open",
          [](const std::filesystem::path& path) {
            std::unique_ptr<StaticCache> cache;
            check(StaticCache::open(path.string(), &cache));
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
      .def_prop_ro("fingerprint", [](const PyStaticCache& c) { return fingerprint_bytes(c.cache->info().fingerprint); })
      .def_prop_ro("generation", [](const PyStaticCache& c) { return c.cache->info().generation; })
      .def_prop_ro("n_keys", [](const PyStaticCache& c) { return c.cache->info().n_keys; })
      .def_prop_ro("n_followers", [](const PyStaticCache& c) { return c.cache->info().n_followers; })
      .def_prop_ro("n_tokens", [](const PyStaticCache& c) { return c.cache->info().n_tokens; })
      .def_prop_ro("n_overflow", [](const PyStaticCache& c) { return c.cache->info().n_overflow; })
      .def_prop_ro("file_size", [](const PyStaticCache& c) { return c.cache->info().file_size; })
      .def_prop_ro(
          "index_depth", [](const PyStaticCache& c) { return c.cache->info().index_depth; },
          "The corpus index's depth (the longest match it finds); 0: the file has no corpus index.")
      .def_prop_ro(
          "n_indexed", [](const PyStaticCache& c) { return c.cache->info().n_suffixes; },
          "Corpus tokens in the corpus index (0: none).")
      .def(
          "corpus_match",
          [](const PyStaticCache& c, nb::handle tokens) {
            TokenView v = as_tokens(tokens, "tokens");
            CorpusMatch match;
            check(static_corpus_match(*c.cache, v.data, v.size, &match));
            return nb::make_tuple(match.length, match.hi - match.lo);
          },
          nb::sig("def corpus_match(self, tokens: NDArray[numpy.int32]) -> tuple[int, int]"), "tokens"_a,
          "The longest suffix of `tokens` (at most index_depth tokens) that the corpus index holds:\n"
          "(its length, how many times it occurs). (0, 0) when none, or without a corpus index.")
      .def_prop_ro(
          "sections",
          [](const PyStaticCache& c) {
            nb::list out;
            const StaticInfo& info = c.cache->info();
            for (uint32_t i = 0; i < info.n_sections; ++i) {
              const SectionInfo& s = info.sections[i];
              nb::dict d;
              d["name"] = format::section_name(s.id);
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
            std::vector<Token> tokens;
            std::vector<int64_t> counts;
            check(static_followers(*c.cache, c.path, ngram.data(), ngram.size(), &tokens, &counts));
            return followers_to_numpy(std::move(tokens), std::move(counts));
          },
          nb::sig("def lookup(self, ngram: Sequence[int]) -> tuple[NDArray[numpy.int32], NDArray[numpy.int64]]"),
          "ngram"_a,
          "The followers of `ngram` (exactly ngram_size tokens) as (tokens int32, counts int64),\n"
          "sorted by token; empty arrays when the n-gram is absent.")
      .def(
          "best",
          [](const PyStaticCache& c,
             const std::vector<int64_t>& ngram) -> std::optional<std::tuple<int, int64_t, int64_t>> {
            StaticPart part;
            bool found = false;
            check(static_find(*c.cache, c.path, ngram.data(), ngram.size(), &part, &found));
            if (!found) return std::nullopt;
            return std::make_tuple(c.cache->token_at(part, 0), int64_t{c.cache->count_at(part, 0)},
                                   int64_t{part.total});
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
            check(s.annotate(c.path));
          },
          "Checks every section checksum and structural invariant (O(file size)).\n\n"
          "Raises:\n    CacheFormatError: naming the first problem found.")
      .def(
          "to_rows",
          [](const PyStaticCache& c) {
            std::vector<int32_t> out;
            check(static_to_rows(*c.cache, &out));
            return rows_to_numpy(std::move(out));
          },
          "Every (key, follower, count) as an int32 array of rows (n, t0, t1, t2, t3, follower, count),\n"
          "keys in lexicographic order, followers by token.")
      .def(
          "follower_histogram",
          [](const PyStaticCache& c) {
            nb::gil_scoped_release release;
            return follower_histogram(*c.cache);
          },
          nb::sig("def follower_histogram(self) -> list[int]"),
          "Keys by follower count: element b counts the keys with 2^b .. 2^(b+1)-1 followers.")
      .def_prop_ro(
          "open_mode", [](const PyStaticCache& c) { return std::string(c.cache->open_mode()); },
          "How the file is held: \"mmap\" (a shared read-only mapping), or \"heap\" (a private copy of\n"
          "exactly its size: a core built with NGC_HEAP_FILES, as the sanitizer builds are, so\n"
          "AddressSanitizer checks every read of it).")
      .def(
          "memory_bytes", [](const PyStaticCache& c) { return c.cache->mapped_bytes(); },
          "Bytes mapped (the file size); shared with every other process mapping the file.")
      .def("__repr__", [](const PyStaticCache& c) {
        const auto& i = c.cache->info();
        return "StaticCache(path=" + std::string(nb::repr(nb::str(c.path.c_str())).c_str()) +
               ", generation=" + std::to_string(i.generation) + ", ngram_size=" + std::to_string(i.ngram_size) +
               ", vocab_size=" + std::to_string(i.vocab_size) + ", n_keys=" + std::to_string(i.n_keys) + ")";
      });
}

}  // namespace ngc::py
