// libFuzzer target: ngc::read_llama_file on arbitrary bytes, for a few vocabulary sizes.
//
// Besides "never crash", the reader is compared with the small reference parser below,
// written from the format comment in llama_format.h: the same entries in the same order,
// success on the same inputs, and an error naming the same byte offset.

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "ngc/llama_format.h"

// --- one reusable read buffer ------------------------------------------------------------
//
// read_llama_file allocates a 1 MiB read buffer per call. Under ASan that is a fresh mmap
// whose 256 pages fault in as the buffer is zeroed: ~0.5 ms a call, 90% of the run time.
// The target is linked with -Wl,--wrap=_Znwm,--wrap=_ZdlPv: while a read is under way, a
// 1 MiB allocation gets one buffer allocated once by ASan's own operator new (so reads
// and writes past its end are still caught); everything else goes to ASan unchanged.

namespace {

constexpr size_t kReaderBuffer = size_t{1} << 20;
bool g_reading = false;        // true while read_llama_file runs
void* g_buffer = nullptr;      // the reusable buffer, allocated on first use
bool g_buffer_in_use = false;  // handed out and not yet deleted

}  // namespace

extern "C" void* __real__Znwm(size_t n);
extern "C" void __real__ZdlPv(void* p);

extern "C" void* __wrap__Znwm(size_t n) {
  if (!g_reading || n != kReaderBuffer || g_buffer_in_use) return __real__Znwm(n);
  if (g_buffer == nullptr) g_buffer = __real__Znwm(n);
  g_buffer_in_use = true;
  return g_buffer;
}

extern "C" void __wrap__ZdlPv(void* p) {
  if (p != nullptr && p == g_buffer) {
    NGC_FUZZ_CHECK(g_buffer_in_use);  // a double delete of the buffer
    g_buffer_in_use = false;
    return;
  }
  __real__ZdlPv(p);
}

namespace {

// read_llama_file with the reusable buffer.
ngc::Status read_llama(const std::string& path, uint32_t V, const ngc::LlamaEntryFn& fn) {
  g_reading = true;
  ngc::Status s = ngc::read_llama_file(path, V, fn);
  g_reading = false;
  NGC_FUZZ_CHECK(!g_buffer_in_use);  // the reader freed its buffer
  return s;
}

using ngc::fuzz::le32;

struct Entry {
  ngc::NGram key;
  ngc::Token follower;
  uint32_t count;
  bool operator==(const Entry& o) const { return key == o.key && follower == o.follower && count == o.count; }
};

struct Parsed {
  std::vector<Entry> entries;  // every entry before the first problem
  bool ok = true;
  uint64_t error_at = 0;  // byte offset of the first problem when !ok
};

// The reference: records of int32 ngram[4], int32 n, n x (int32 token, int32 count).
Parsed reference_parse(const uint8_t* data, size_t size, uint32_t V) {
  Parsed p;
  auto i32 = [&](uint64_t at) { return static_cast<int32_t>(le32(data + at)); };
  auto token_ok = [&](int32_t t) { return t >= 0 && static_cast<uint32_t>(t) < V; };
  auto fail = [&](uint64_t at) {
    p.ok = false;
    p.error_at = at;
    return p;
  };
  uint64_t at = 0;
  while (at < size) {
    const uint64_t rec = at;
    if (size - at < 20) return fail(rec);
    ngc::NGram key;
    int n = 0;
    while (n < ngc::kNgramMax && i32(rec + 4 * n) != -1) ++n;
    if (n == 0) return fail(rec);
    for (int i = 0; i < ngc::kNgramMax; ++i) {
      const int32_t t = i32(rec + 4 * i);
      if (i < n ? !token_ok(t) : t != -1) return fail(rec + 4 * i);
      key.tokens[i] = t;
    }
    const int32_t n_followers = i32(rec + 16);
    if (n_followers <= 0) return fail(rec + 16);
    at = rec + 20;
    for (int32_t j = 0; j < n_followers; ++j, at += 8) {
      if (size - at < 8) return fail(at);
      const int32_t t = i32(at), c = i32(at + 4);
      if (!token_ok(t)) return fail(at);
      if (c <= 0) return fail(at + 4);
      p.entries.push_back({key, t, static_cast<uint32_t>(c)});
    }
  }
  return p;
}

void check(const std::string& path, const uint8_t* data, size_t size, uint32_t V) {
  std::vector<Entry> got;
  const ngc::Status s = read_llama(path, V, [&](const ngc::NGram& key, ngc::Token f, uint32_t c) {
    got.push_back({key, f, c});
    return ngc::Status::Ok();
  });
  const Parsed want = reference_parse(data, size, V);
  NGC_FUZZ_CHECK(s.ok() == want.ok);
  NGC_FUZZ_CHECK(got == want.entries);
  if (!s.ok()) {
    NGC_FUZZ_CHECK(s.code() == ngc::StatusCode::kFormatError);
    NGC_FUZZ_CHECK(s.message().find(": byte " + std::to_string(want.error_at) + ": ") != std::string::npos);
  }
}

// A callback error stops the read at once and comes back with the record's offset.
void check_callback_error(const std::string& path, size_t stop_after) {
  size_t calls = 0;
  const ngc::Status s = read_llama(path, ngc::format::kMaxVocab, [&](const ngc::NGram&, ngc::Token, uint32_t) {
    return ++calls > stop_after ? ngc::Status::InvalidArgument("stop") : ngc::Status::Ok();
  });
  NGC_FUZZ_CHECK(calls <= stop_after + 1);
  if (calls == stop_after + 1) {
    NGC_FUZZ_CHECK(s.code() == ngc::StatusCode::kInvalidArgument);
    NGC_FUZZ_CHECK(s.message().find(": byte ") != std::string::npos);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ngc::fuzz::MemFile file("ngc-llama");
  const std::string& path = file.write(data, size);
  for (uint32_t V : {1u, 64u, ngc::format::kMaxVocab}) check(path, data, size, V);
  check_callback_error(path, size % 5);
  return 0;
}
