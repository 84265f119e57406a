// Small POSIX file helpers shared by the writers: whole writes, scratch files, atomic
// publication (temporary name, fsync, rename, fsync of the directory).
#pragma once

#include <cstddef>
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

}  // namespace ngc
