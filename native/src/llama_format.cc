#include "ngc/llama_format.h"

#include <functional>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "ngc/file_util.h"

namespace ngc {
namespace {

std::string str(uint64_t v) { return std::to_string(v); }

// Sequential reads through a buffer, tracking the byte offset.
class Reader {
 public:
  explicit Reader(int fd) : fd_(fd), buf_(1 << 20) {}
  // Reads exactly n bytes; returns 1, 0 at a clean end of file, -1 on a short read, -2 on error.
  int read(void* out, size_t n) {
    auto* p = static_cast<uint8_t*>(out);
    size_t got = 0;
    while (got < n) {
      if (pos_ == len_) {
        const ssize_t r = ::read(fd_, buf_.data(), buf_.size());
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -2;
        if (r == 0) return got == 0 ? 0 : -1;
        len_ = static_cast<size_t>(r);
        pos_ = 0;
      }
      const size_t take = std::min(n - got, len_ - pos_);
      std::memcpy(p + got, buf_.data() + pos_, take);
      pos_ += take;
      got += take;
      offset_ += take;
    }
    return 1;
  }
  uint64_t offset() const { return offset_; }

 private:
  int fd_;
  std::vector<uint8_t> buf_;
  size_t pos_ = 0, len_ = 0;
  uint64_t offset_ = 0;
};

}  // namespace

Status read_llama_file(const std::string& path, uint32_t vocab_size, const LlamaEntryFn& fn) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  Reader in(fd);
  Status s;
  auto fail = [&](uint64_t at, const std::string& what) {
    return Status::FormatError(path + ": byte " + str(at) + ": " + what);
  };
  auto token_ok = [&](int32_t t) { return t >= 0 && static_cast<uint32_t>(t) < vocab_size; };
  for (;;) {
    const uint64_t rec_at = in.offset();
    int32_t head[5];
    const int r = in.read(head, sizeof head);
    if (r == 0) break;
    if (r == -2) {
      s = Status::IoError("cannot read " + path + ": " + std::strerror(errno));
      break;
    }
    if (r == -1) {
      s = fail(rec_at, "truncated record (the file ends inside an n-gram header)");
      break;
    }
    NGram key;
    int n = 0;
    while (n < kNgramMax && head[n] != -1) ++n;
    if (n == 0) {
      s = fail(rec_at, "empty n-gram (all four slots are -1)");
      break;
    }
    bool bad = false;
    for (int i = 0; i < kNgramMax && !bad; ++i) {
      if (i < n && !token_ok(head[i])) {
        s = fail(rec_at + 4 * i,
                 "n-gram token " + std::to_string(head[i]) + " is outside the vocabulary [0, " + str(vocab_size) + ")");
        bad = true;
      } else if (i >= n && head[i] != -1) {
        s = fail(rec_at + 4 * i, "n-gram slot after an unused (-1) slot holds " + std::to_string(head[i]));
        bad = true;
      }
      key.tokens[i] = head[i];
    }
    if (bad) break;
    if (head[4] <= 0) {
      s = fail(rec_at + 16, "follower count " + std::to_string(head[4]) + " must be > 0");
      break;
    }
    for (int32_t j = 0; j < head[4] && !bad; ++j) {
      const uint64_t at = in.offset();
      int32_t pair[2];
      const int rr = in.read(pair, sizeof pair);
      if (rr == -2) {
        s = Status::IoError("cannot read " + path + ": " + std::strerror(errno));
        bad = true;
        break;
      }
      if (rr != 1) {
        s = fail(at,
                 "truncated record (follower " + std::to_string(j) + " of " + std::to_string(head[4]) + " is missing)");
        bad = true;
        break;
      }
      if (!token_ok(pair[0])) {
        s = fail(at, "follower token " + std::to_string(pair[0]) + " is outside the vocabulary [0, " + str(vocab_size) +
                         ")");
        bad = true;
        break;
      }
      if (pair[1] <= 0) {
        s = fail(at + 4, "count " + std::to_string(pair[1]) + " must be > 0");
        bad = true;
        break;
      }
      s = fn(key, pair[0], static_cast<uint32_t>(pair[1]));
      if (!s.ok()) {
        s = Status(s.code(), path + ": byte " + str(rec_at) + ": " + s.message());
        bad = true;
      }
    }
    if (bad) break;
  }
  ::close(fd);
  return s;
}

Status write_llama_file(const StaticCache& cache, const std::string& path, const std::function<bool()>& interrupted) {
  std::unique_ptr<AtomicFile> out;
  NGC_RETURN_IF_ERROR(AtomicFile::create(path, &out));
  std::vector<int32_t> buf;
  buf.reserve(1 << 18);
  for (uint64_t i = 0; i < cache.info().n_keys; ++i) {
    NGram key;
    StaticPart part;
    NGC_RETURN_IF_ERROR(cache.key_at(i, &key, &part));
    buf.insert(buf.end(), key.tokens, key.tokens + kNgramMax);
    buf.push_back(static_cast<int32_t>(part.size));
    for (uint32_t j = 0; j < part.size; ++j) {
      buf.push_back(cache.token_at(part, j));
      buf.push_back(static_cast<int32_t>(std::min<uint32_t>(cache.count_at(part, j), INT32_MAX)));
    }
    if (buf.size() >= (1 << 18)) {
      NGC_RETURN_IF_ERROR(out->write(buf.data(), buf.size() * 4));
      buf.clear();
      if (interrupted && interrupted()) return Status::Cancelled("interrupted; " + path + " was not written");
    }
  }
  NGC_RETURN_IF_ERROR(out->write(buf.data(), buf.size() * 4));
  return out->commit();
}

Status load_llama_counts(const std::string& path, int64_t vocab_size, SharedCountTable* table) {
  NGC_RETURN_IF_ERROR(check_vocab_size(vocab_size));
  CountTable staged;
  NGC_RETURN_IF_ERROR(
      read_llama_file(path, static_cast<uint32_t>(vocab_size), [&](const NGram& key, Token follower, uint32_t count) {
        staged.add(key, follower, count);
        return Status::Ok();
      }));
  table->merge(staged);
  return Status::Ok();
}

}  // namespace ngc
