#include "convert.h"

#include <nanobind/stl/string.h>

#include <string>

namespace ngc::py {

void raise_status(const Status& s) {
  if (s.code() == StatusCode::kCancelled) {
    if (PyErr_Occurred()) throw nb::python_error();  // the KeyboardInterrupt that stopped it
    PyErr_SetString(PyExc_KeyboardInterrupt, s.message().c_str());
    throw nb::python_error();
  }
  const char* cls = nullptr;
  switch (s.code()) {
    case StatusCode::kFormatError:
      cls = "CacheFormatError";
      break;
    case StatusCode::kTokenizerMismatch:
      cls = "TokenizerMismatchError";
      break;
    case StatusCode::kIoError:
      PyErr_SetString(PyExc_OSError, s.message().c_str());
      throw nb::python_error();
    default:
      cls = "InvalidArgumentError";
      break;
  }
  nb::object type = nb::module_::import_("ngramcache.client.kernel.errors").attr(cls);
  PyErr_SetString(type.ptr(), s.message().c_str());
  throw nb::python_error();
}

namespace {

[[noreturn]] void invalid(const std::string& msg) { raise_status(Status::InvalidArgument(msg)); }

std::string str_of(nb::handle obj) {
  nb::object s = nb::steal(PyObject_Str(obj.ptr()));
  if (!s.is_valid()) {
    PyErr_Clear();
    return "?";
  }
  return nb::cast<std::string>(s);
}

}  // namespace

TokenView as_tokens(nb::handle h, const char* what) {
  TokenView v;
  if (!nb::try_cast(h, v.array, false)) {
    invalid(std::string(what) + " must be a 1-D numpy array of int32, got " + std::string(Py_TYPE(h.ptr())->tp_name) +
            "; use numpy.asarray(x, dtype=numpy.int32)");
  }
  if (v.array.dtype() != nb::dtype<int32_t>()) {
    invalid(std::string(what) + " must have dtype int32, got " + str_of(h.attr("dtype")) +
            "; use numpy.asarray(x, dtype=numpy.int32)");
  }
  if (v.array.ndim() != 1) {
    invalid(std::string(what) + " must be 1-D, got " + std::to_string(v.array.ndim()) + " dimensions");
  }
  if (v.array.shape(0) > 1 && v.array.stride(0) != 1) invalid(std::string(what) + " must be contiguous");
  v.data = static_cast<const Token*>(v.array.data());
  v.size = v.array.shape(0);
  return v;
}

template <typename T>
RowsView<T> as_rows(nb::handle h) {
  RowsView<T> v;
  const char* type = sizeof(T) == 4 ? "int32" : "int64";
  if (!nb::try_cast(h, v.array, false) || v.array.dtype() != nb::dtype<T>() || v.array.ndim() != 2 ||
      v.array.shape(1) != rows::kWidth ||
      (v.array.shape(0) > 0 && (v.array.stride(1) != 1 || v.array.stride(0) != rows::kWidth))) {
    invalid(std::string("rows must be a C-contiguous ") + type + " numpy array of shape (m, " +
            std::to_string(rows::kWidth) + ") (see ngramcache.client.kernel.rows)");
  }
  v.data = static_cast<const T*>(v.array.data());
  v.n = v.array.shape(0);
  return v;
}

template RowsView<int32_t> as_rows<int32_t>(nb::handle h);
template RowsView<int64_t> as_rows<int64_t>(nb::handle h);

NGram as_ngram(const std::vector<int64_t>& tokens, uint32_t vocab_limit) {
  NGram g;
  check(make_ngram(tokens.data(), tokens.size(), vocab_limit, &g));
  return g;
}

nb::ndarray<nb::numpy, int32_t> rows_to_numpy(std::vector<int32_t>&& rows) {
  const size_t m = rows.size() / rows::kWidth;
  return to_numpy(std::move(rows), {m, static_cast<size_t>(rows::kWidth)});
}

nb::tuple followers_to_numpy(std::vector<Token>&& tokens, std::vector<int64_t>&& counts) {
  const size_t n = tokens.size();
  return nb::make_tuple(to_numpy(std::move(tokens), {n}), to_numpy(std::move(counts), {n}));
}

nb::bytes fingerprint_bytes(const uint8_t* fingerprint) {
  return nb::bytes(reinterpret_cast<const char*>(fingerprint), kFingerprintSize);
}

nb::dict build_stats(const BuildStats& st) {
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

bool python_interrupted() {
  nb::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

}  // namespace ngc::py
