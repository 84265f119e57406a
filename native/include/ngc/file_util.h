// Small POSIX file helpers shared by the writers: whole writes, scratch files, atomic
// publication (temporary name, fsync, rename, fsync of the directory).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "ngc/status.h"

namespace ngc {

// The directory part of `path` ("." when it has none).
std::string dir_of(const std::string& path);

// Writes all `n` bytes to `fd`, retrying short writes and EINTR; `what` names the file in
// the error.
Status write_all(int fd, const void* data, size_t n, const std::string& what);

// Creates a scratch file in `dir` and unlinks it at once, so the system removes it when
// `*fd` is closed, even after a crash. The caller owns `*fd`.
Status open_scratch_file(const std::string& dir, int* fd);

// A fresh temporary name beside `path` (same directory, so a rename onto `path` is atomic).
std::string temporary_name_for(const std::string& path);

// fsyncs the directory of `path`, after a rename onto it, so the rename survives a crash
// (best effort: a failure is ignored).
void sync_directory_of(const std::string& path);

// AtomicFile: the one way ngramcache publishes a file (static caches, llama.cpp exports,
// counts-store snapshots): it appears at `path` whole or not at all. Bytes go to a fresh
// temporary file beside `path`; commit() fsyncs it, renames it onto `path` and fsyncs the
// directory so the rename survives a crash. Destroyed before commit() succeeds (an error,
// an interrupt), it removes the temporary file and leaves `path` as it was.
class AtomicFile {
 public:
  static Status create(const std::string& path, std::unique_ptr<AtomicFile>* out);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // The temporary file's descriptor, for writers that stream (owned by this object).
  int fd() const { return fd_; }
  const std::string& temp_path() const { return tmp_; }
  Status write(const void* data, size_t n) { return write_all(fd_, data, n, tmp_); }
  Status commit();

 private:
  AtomicFile(std::string path, std::string tmp, int fd) : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  std::string path_;  // where the file appears
  std::string tmp_;   // the temporary file; empty once renamed
  int fd_;            // open on tmp_ until commit(); -1 after
};

// Writes data[0..n) to `path` through an AtomicFile: whole or not at all.
Status write_file_atomic(const std::string& path, const void* data, size_t n);

}  // namespace ngc
