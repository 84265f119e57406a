// CountTable: a SharedCountTable, which checks its arguments and locks itself.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"

namespace ngc::py {

using namespace nb::literals;

PyCountTable* as_count_table(nb::handle obj, const char* what) {
  if (obj.is_none()) return nullptr;
  if (!nb::isinstance<PyCountTable>(obj)) {
    throw nb::type_error(
        (std::string(what) + " must be a CountTable or None, got " + Py_TYPE(obj.ptr())->tp_name).c_str());
  }
  return &nb::cast<PyCountTable&>(obj);
}

void bind_count_table(nb::module_& m) {
  nb::class_<PyCountTable>(m, "CountTable",
                           "n-gram (1..4 tokens) -> follower counts, for context and dynamic tables; tokens are\n"
                           "below MAX_VOCAB. Thread-safe: drafts read it from any thread while writers change it\n"
                           "(change sets are applied in short chunks, so a draft waits microseconds at most).")
      .def(nb::init<>())
      .def(
          "update",
          [](PyCountTable& t, nb::handle tokens, std::optional<int64_t> n_new, int ngram_min, int ngram_max) {
            TokenView v = as_tokens(tokens, "tokens");
            const int64_t nn = n_new ? *n_new : static_cast<int64_t>(v.size);
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.shared->update(v.data, v.size, nn, ngram_min, ngram_max, kAnyToken);
            }
            check(s);
          },
          nb::sig(
              "def update(self, tokens: NDArray[numpy.int32], n_new: int | None = None, ngram_min: int = 1, ngram_max: int = 4) -> None"),
          "tokens"_a, "n_new"_a = nb::none(), "ngram_min"_a = 1, "ngram_max"_a = 4,
          "llama.cpp's common_ngram_cache_update: counts, for each n-gram size n and each of the last\n"
          "`n_new` positions i >= n (default: all), follower tokens[i] of key tokens[i-n:i].")
      .def(
          "add",
          [](PyCountTable& t, const std::vector<int64_t>& ngram, int64_t token, int64_t count) {
            check(t.shared->add(as_ngram(ngram, kAnyToken), token, count));
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
            if (min_total.size() != static_cast<size_t>(kNgramMax)) {
              raise_status(Status::InvalidArgument("min_total needs " + std::to_string(kNgramMax) +
                                                   " values (one per n-gram size)"));
            }
            ViewPolicy policy;
            policy.top_k = top_k;
            policy.min_change_pct = min_change_pct;
            for (int k = 0; k < kNgramMax; ++k) {
              // Negative values wrap to huge ones; clamped to 0 they fail validate() as they should.
              policy.min_total[k] = min_total[k] < 1 ? 0 : static_cast<uint64_t>(min_total[k]);
            }
            std::optional<RowsView<int64_t>> changed;
            if (!changed_obj.is_none()) changed = as_rows<int64_t>(changed_obj);
            std::vector<int64_t> out;
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.shared->view_diff(*published.shared, changed ? changed->data : nullptr, changed ? changed->n : 0,
                                      policy, &out);
            }
            check(s);
            const size_t m = out.size() / rows::kWidth;
            return to_numpy(std::move(out), {m, static_cast<size_t>(rows::kWidth)});
          },
          nb::sig(
              "def view_diff(self, published: CountTable, changed: NDArray[numpy.int64] | None = None, *, "
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
            std::vector<int32_t> out;
            t.shared->to_rows(&out);
            return rows_to_numpy(std::move(out));
          },
          "Every count as int32 rows (n, t0, t1, t2, t3, follower, count), shape (m, 7).")
      .def(
          "lookup",
          [](const PyCountTable& t, const std::vector<int64_t>& ngram) {
            std::vector<Token> tokens;
            std::vector<int64_t> counts;
            t.shared->lookup(as_ngram(ngram, kAnyToken), &tokens, &counts);
            return followers_to_numpy(std::move(tokens), std::move(counts));
          },
          nb::sig("def lookup(self, ngram: Sequence[int]) -> tuple[NDArray[numpy.int32], NDArray[numpy.int64]]"),
          "ngram"_a, "The followers of `ngram` as (tokens int32, counts int64), sorted by token.")
      .def(
          "merge",
          [](PyCountTable& t, const PyCountTable& other) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.shared->merge(*other.shared);
            }
            check(s);
          },
          "other"_a, "Adds every count of `other` to this table.")
      .def("clear", [](PyCountTable& t) { t.shared->clear(); })
      .def_prop_ro(
          "n_keys", [](const PyCountTable& t) { return t.shared->n_keys(); }, "Distinct n-grams.")
      .def_prop_ro(
          "n_entries", [](const PyCountTable& t) { return t.shared->n_entries(); },
          "Distinct (n-gram, follower) pairs.")
      .def("__len__", [](const PyCountTable& t) { return t.shared->n_keys(); })
      .def(
          "memory_bytes", [](const PyCountTable& t) { return t.shared->memory_bytes(); },
          "Heap bytes held by the table.")
      .def(
          "check_integrity", [](const PyCountTable& t) { check(t.shared->check_integrity()); },
          "Checks every invariant of the table; raises CacheFormatError naming the first broken one.");
}

}  // namespace ngc::py
