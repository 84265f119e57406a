// The module's functions: llama.cpp files, replay, atomic writes, checksums and the one-call
// static build.
#include <nanobind/nanobind.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <string>
#include <vector>

#include "bindings.h"
#include "ngc/builder_inputs.h"
#include "ngc/checksum.h"
#include "ngc/file_util.h"
#include "ngc/llama_format.h"
#include "ngc/replay.h"

namespace ngc::py {

using namespace nb::literals;

void bind_functions(nb::module_& m) {
  using Path = std::filesystem::path;
  m.def(
      "import_llama",
      [](const Path& in_path_arg, PyStaticBuilder& b) {
        const std::string in_path = in_path_arg.string();
        Builder& builder = b.get();
        Status s;
        {
          nb::gil_scoped_release release;
          s = import_llama_counts(&builder, in_path);
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
        Status s;
        {
          nb::gil_scoped_release release;
          s = load_llama_counts(in_path, vocab_size, table.shared.get());
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
          s = write_llama_file(*c.cache, out_path, python_interrupted);
        }
        check(s);
      },
      "cache"_a, "path"_a, "Writes `cache` in llama.cpp's format (loadable with llama-lookup's -lcs), atomically.");

  m.def(
      "replay",
      [](nb::handle tokens, int64_t n_ctx, int n_draft, int ngram_min, int ngram_max, nb::object static_cache,
         PyCountTable& dynamic, bool dump_drafts, const std::string& mode, int tree_budget, nb::object match_params) {
        ReplayOptions o;
        o.n_ctx = n_ctx;
        check(parse_draft_mode(mode, &o.mode));
        o.draft.n_draft = n_draft;
        o.draft.ngram_min = ngram_min;
        o.draft.ngram_max = ngram_max;
        o.match = match_params_from(match_params);
        o.tree_budget = tree_budget;
        TokenView v = as_tokens(tokens, "tokens");
        PyStaticCache* sc = as_static_cache(static_cache, "static");
        std::vector<Token> drafts;
        ReplayStats r;
        Status s;
        {
          nb::gil_scoped_release release;
          s = run_replay(v.data, v.size, o, sc ? sc->cache.get() : nullptr, dynamic.shared.get(),
                         dump_drafts ? &drafts : nullptr, &r);
        }
        check(s);
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
      "tokens"_a, "n_ctx"_a, "n_draft"_a, "ngram_min"_a, "ngram_max"_a, "static"_a.none(), "dynamic"_a,
      "dump_drafts"_a = false, "mode"_a = "compatible", "tree_budget"_a = 0, "match_params"_a = nb::none(),
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
        std::string copy(data.c_str(), data.size());  // the bytes object may not be read without the GIL
        Status s;
        {
          nb::gil_scoped_release release;
          s = write_file_atomic(p, copy.data(), copy.size());
        }
        check(s);
      },
      nb::sig("def write_file_atomic(path: str | os.PathLike[str], data: bytes) -> None"), "path"_a, "data"_a,
      "Writes `data` to `path` whole or not at all (temporary file beside it, fsync, rename,\n"
      "fsync of the directory): the helper every writer of ngramcache publishes files with.");
  m.def(
      "checksum64", [](nb::bytes data, uint64_t seed) { return checksum64(data.c_str(), data.size(), seed); }, "data"_a,
      "seed"_a = 0, "The 64-bit checksum used by static cache headers and sections.");
  m.def(
      "ngram_hash", [](const std::vector<int64_t>& ngram) { return as_ngram(ngram, kAnyToken).hash(); }, "ngram"_a,
      "The hash count tables use for `ngram` (for tests that need colliding keys).");

  m.def(
      "build_static_from_tokens",
      [](nb::list streams, const Path& path, int64_t vocab_size, int ngram_size, nb::bytes fingerprint,
         int64_t generation, bool corpus_index, int64_t memory_budget) {
        StaticHeader h;
        check(make_static_header(vocab_size, ngram_size, bytes_data(fingerprint), fingerprint.size(), generation, &h));
        check(check_min_budget(memory_budget));
        std::vector<TokenView> views;
        std::vector<TokenStream> refs;
        for (size_t i = 0; i < streams.size(); ++i)
          views.push_back(as_tokens(streams[i], ("streams[" + std::to_string(i) + "]").c_str()));
        for (const TokenView& v : views) refs.push_back({v.data, v.size});
        Status s;
        BuildStats st;
        {
          nb::gil_scoped_release release;
          s = build_static(refs, h, path.string(), corpus_index, static_cast<uint64_t>(memory_budget), &st);
        }
        check(s);
        return build_stats(st);
      },
      nb::sig(
          "def build_static_from_tokens(streams: list[NDArray[numpy.int32]], path: str | os.PathLike[str], vocab_size: int, "
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

}  // namespace ngc::py
