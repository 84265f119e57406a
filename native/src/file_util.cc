#include "ngc/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

namespace ngc {

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status write_all(int fd, const void* data, size_t n, const std::string& what) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::IoError("cannot write " + what + ": " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status open_scratch_file(const std::string& dir, int* fd) {
  std::string tmpl = dir + "/.ngramcache-scratch-XXXXXX";
  *fd = ::mkstemp(tmpl.data());
  if (*fd < 0) return Status::IoError("cannot create a scratch file in " + dir + ": " + std::strerror(errno));
  ::unlink(tmpl.c_str());
  return Status::Ok();
}

std::string temporary_name_for(const std::string& path) {
  std::random_device rd;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, ".tmp.%d.%08x", static_cast<int>(::getpid()), rd());
  return path + suffix;
}

void sync_directory_of(const std::string& path) {
  const int dfd = ::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

Status AtomicFile::create(const std::string& path, std::unique_ptr<AtomicFile>* out) {
  std::string tmp = temporary_name_for(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IoError("cannot create " + tmp + ": " + std::strerror(errno));
  out->reset(new AtomicFile(path, std::move(tmp), fd));
  return Status::Ok();
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

Status AtomicFile::commit() {
  if (fd_ < 0) return Status::InvalidArgument("AtomicFile::commit called twice for " + path_);
  Status s;
  if (::fsync(fd_) != 0) s = Status::IoError("cannot fsync " + tmp_ + ": " + std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (!s.ok()) return s;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return Status::IoError("cannot rename " + tmp_ + " to " + path_ + ": " + std::strerror(errno));
  tmp_.clear();
  sync_directory_of(path_);
  return Status::Ok();
}

Status write_file_atomic(const std::string& path, const void* data, size_t n) {
  std::unique_ptr<AtomicFile> f;
  NGC_RETURN_IF_ERROR(AtomicFile::create(path, &f));
  NGC_RETURN_IF_ERROR(f->write(data, n));
  return f->commit();
}

}  // namespace ngc
