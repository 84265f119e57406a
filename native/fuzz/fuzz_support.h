// Helpers shared by the fuzz targets: the input as a file, little-endian loads, checks.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ngc::fuzz {

// The fuzz input as a file with a path, for APIs that open a path. One memfd per target,
// rewritten for every input and opened by its /proc/self/fd/N path: no temporary files,
// no disk writes, and the file has exactly the input's bytes.
class MemFile {
 public:
  explicit MemFile(const char* name) {
    fd_ = ::memfd_create(name, MFD_CLOEXEC);
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  // Replaces the file's contents with the `n` bytes at `data`; returns its path.
  const std::string& write(const uint8_t* data, size_t n) {
    if (::ftruncate(fd_, static_cast<off_t>(n)) != 0) fail("ftruncate");
    size_t done = 0;
    while (done < n) {
      const ssize_t w = ::pwrite(fd_, data + done, n - done, static_cast<off_t>(done));
      if (w <= 0) fail("pwrite");
      done += static_cast<size_t>(w);
    }
    return path_;
  }

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] static void fail(const char* what) {
    std::perror(what);
    std::abort();
  }

  int fd_ = -1;       // owned memfd
  std::string path_;  // "/proc/self/fd/<fd_>"
};

// A little-endian u32 at unaligned `p`.
inline uint32_t le32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

// Stops the run with a message: libFuzzer saves the input as a crash. NGC_FUZZ_CHECK(cond)
// calls it with the condition's text when `cond` is false.
[[noreturn]] inline void invariant_failed(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

}  // namespace ngc::fuzz

#define NGC_FUZZ_CHECK(cond)                                                                        \
  do {                                                                                              \
    if (!(cond)) ::ngc::fuzz::invariant_failed(#cond " (" __FILE__ ":" NGC_FUZZ_STR(__LINE__) ")"); \
  } while (0)
#define NGC_FUZZ_STR(x) NGC_FUZZ_STR2(x)
#define NGC_FUZZ_STR2(x) #x
