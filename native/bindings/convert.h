// Conversions between Python objects and the ngc core's types: numpy arrays <-> borrowed
// spans, Python sequences -> n-grams, vectors -> owned numpy arrays, and raise_status(), the
// one place a Status becomes a Python exception.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ngc/builder.h"
#include "ngc/ngram.h"
#include "ngc/rows.h"
#include "ngc/status.h"

namespace ngc::py {

namespace nb = nanobind;

// Raises the Python exception of `s` (which MUST NOT be ok): kCancelled -> KeyboardInterrupt
// (the pending one when Python's signal handler raised it), kFormatError ->
// CacheFormatError, kTokenizerMismatch -> TokenizerMismatchError, kIoError -> OSError,
// anything else -> InvalidArgumentError (ngramcache.client.kernel.errors).
[[noreturn]] void raise_status(const Status& s);

// Raises when `s` is not ok.
inline void check(const Status& s) {
  if (!s.ok()) raise_status(s);
}

// A borrowed view of a 1-D C-contiguous int32 numpy array (no copy). The view holds a
// reference to the array, so the buffer lives as long as the view.
struct TokenView {
  nb::ndarray<nb::ro, nb::device::cpu> array;
  const Token* data = nullptr;
  size_t size = 0;
};

// `h` as a TokenView, or an InvalidArgumentError naming `what` and how to fix it.
TokenView as_tokens(nb::handle h, const char* what);

// Count rows (rows.h) as a checked, borrowed view: a C-contiguous (m, 7) array of T.
template <typename T>
struct RowsView {
  nb::ndarray<nb::ro, nb::device::cpu> array;  // holds a reference to the buffer
  const T* data = nullptr;
  size_t n = 0;
};

// `h` as int32 or int64 count rows, or an InvalidArgumentError.
template <typename T>
RowsView<T> as_rows(nb::handle h);

// A Python sequence of ints as a checked n-gram (make_ngram()).
NGram as_ngram(const std::vector<int64_t>& tokens, uint32_t vocab_limit);

// A numpy array owning `values` (moved onto the heap, freed with the array).
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

// int32 count rows as an (m, 7) numpy array.
nb::ndarray<nb::numpy, int32_t> rows_to_numpy(std::vector<int32_t>&& rows);

// (tokens int32, counts int64) as a tuple of two 1-D numpy arrays.
nb::tuple followers_to_numpy(std::vector<Token>&& tokens, std::vector<int64_t>&& counts);

// A tokenizer fingerprint (kFingerprintSize bytes) as Python bytes.
nb::bytes fingerprint_bytes(const uint8_t* fingerprint);

// The bytes of `b` as the core takes a fingerprint.
inline const uint8_t* bytes_data(const nb::bytes& b) { return reinterpret_cast<const uint8_t*>(b.c_str()); }

// A build's statistics as a dict of ints.
nb::dict build_stats(const BuildStats& st);

// For long native calls made with the GIL released: runs Python's signal handlers, so a
// Ctrl-C stops the call (true) with its KeyboardInterrupt pending for raise_status.
bool python_interrupted();

// Count tables carry no vocabulary of their own: their tokens are bounded by the one limit.
constexpr uint32_t kAnyToken = kMaxVocab;

}  // namespace ngc::py
