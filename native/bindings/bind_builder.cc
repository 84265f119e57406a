// StaticBuilder: a core Builder fed tokens, count rows and other static caches
// (builder_inputs.h checks them), with the GIL released while it counts and writes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>

#include <filesystem>
#include <memory>
#include <string>

#include "bindings.h"
#include "ngc/builder_inputs.h"

namespace ngc::py {

using namespace nb::literals;

void bind_builder(nb::module_& m) {
  nb::class_<PyStaticBuilder>(m, "StaticBuilder",
                              "Counts (ngram_size-gram, follower) pairs of token streams within a memory budget\n"
                              "(sorted runs spill to scratch files) and writes a static cache atomically.\n"
                              "Not thread-safe: use one builder from one thread; it sorts on `threads` threads.")
      .def(
          "__init__",
          [](PyStaticBuilder* self, const std::filesystem::path& path, int64_t vocab_size, int ngram_size,
             nb::bytes fingerprint, int64_t generation, int64_t memory_budget, const std::filesystem::path& scratch_dir,
             int threads, int max_fan_in, bool corpus_index, int index_depth) {
            BuilderOptions o;
            check(check_index_depth(index_depth));
            o.corpus_index = corpus_index;
            o.index_depth = static_cast<uint32_t>(index_depth);
            check(make_static_header(vocab_size, ngram_size, bytes_data(fingerprint), fingerprint.size(), generation,
                                     &o.header));
            check(check_memory_budget(memory_budget));
            o.memory_budget = static_cast<uint64_t>(memory_budget);
            o.scratch_dir = scratch_dir.string();
            o.threads = threads;
            o.max_fan_in = max_fan_in;
            std::unique_ptr<Builder> b;
            check(Builder::create(o, path.string(), &b));
            new (self) PyStaticBuilder{std::move(b), false};
          },
          nb::sig(
              "def __init__(self, path: str | os.PathLike[str], vocab_size: int, ngram_size: int = 2, *, fingerprint: bytes, "
              "generation: int = 0, memory_budget: int = 1 << 30, scratch_dir: str | os.PathLike[str] = '', threads: int = 0, "
              "max_fan_in: int = 64, corpus_index: bool = False, index_depth: int = 32) -> None"),
          "path"_a, "vocab_size"_a, "ngram_size"_a = 2, nb::kw_only(), "fingerprint"_a, "generation"_a = 0,
          "memory_budget"_a = uint64_t{1} << 30, "scratch_dir"_a = "", "threads"_a = 0, "max_fan_in"_a = 64,
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
      .def(
          "begin_stream", [](PyStaticBuilder& b) { b.get().begin_stream(); },
          "Starts a new stream (an input file): n-grams never span two streams.")
      .def(
          "add_tokens",
          [](PyStaticBuilder& b, nb::handle tokens) {
            Builder& builder = b.get();
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
          "add_index_tokens",
          [](PyStaticBuilder& b, nb::handle tokens) {
            Builder& builder = b.get();
            TokenView v = as_tokens(tokens, "tokens");
            Status s;
            {
              nb::gil_scoped_release release;
              s = builder.add_index_tokens(v.data, v.size);
            }
            check(s);
          },
          nb::sig("def add_index_tokens(self, tokens: NDArray[numpy.int32]) -> None"), "tokens"_a,
          "Adds int32 tokens to the corpus index only, as a text of their own (no n-gram is counted):\n"
          "for texts whose counts arrive otherwise, such as the fleet history. A no-op without\n"
          "corpus_index.")
      .def(
          "add_rows",
          [](PyStaticBuilder& b, nb::handle rows) {
            Builder& builder = b.get();
            RowsView<int32_t> v = as_rows<int32_t>(rows);
            Status s;
            {
              nb::gil_scoped_release release;
              s = add_count_rows(&builder, v.data, v.n);
            }
            check(s);
          },
          nb::sig("def add_rows(self, rows: NDArray[numpy.int32]) -> None"), "rows"_a,
          "Adds weighted rows (n, t0, t1, t2, t3, follower, count) whose n is the builder's ngram_size.")
      .def(
          "add_static",
          [](PyStaticBuilder& b, const PyStaticCache& c) {
            Builder& builder = b.get();
            Status s;
            {
              nb::gil_scoped_release release;
              s = add_static_counts(&builder, *c.cache, c.path);
            }
            check(s);
          },
          "cache"_a,
          "Adds every count of static cache `cache` (same n-gram size) to the build, and its\n"
          "n_tokens to the header's (when `cache` does not know its own, neither does the result).")
      .def(
          "finish",
          [](PyStaticBuilder& b) {
            Builder& builder = b.get();
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
      .def_prop_ro(
          "stats", [](PyStaticBuilder& b) { return build_stats(b.builder->stats()); },
          nb::sig("def stats(self) -> dict[str, int]"), "Counters so far: tokens, streams, pairs, runs.");
}

}  // namespace ngc::py
