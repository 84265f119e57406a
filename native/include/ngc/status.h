// Status: the error type of the ngc core. Nothing below the bindings throws; every
// fallible function returns a Status (or fills an out-parameter and returns one).
#pragma once

#include <string>
#include <utility>

namespace ngc {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // the caller passed a value outside its documented range
  kFormatError,        // a static cache file is truncated, corrupt or hostile
  kIoError,            // the operating system refused a read, write, map or rename
  kOutOfRange,         // a count or size does not fit the file format's fields
  kTokenizerMismatch,  // data of one tokenizer offered to a drafter or cache of another
  kCancelled,          // the caller asked a long operation to stop (Ctrl-C); nothing was published
};

// [[nodiscard]]: an ignored Status is an ignored error. A caller that means to drop one
// says so with a (void) cast and a comment why.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status FormatError(std::string m) { return {StatusCode::kFormatError, std::move(m)}; }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
  static Status TokenizerMismatch(std::string m) { return {StatusCode::kTokenizerMismatch, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // This status with "`where`: " before its message (ok stays ok): names the file or item
  // an error is about, for a caller that knows it.
  Status annotate(const std::string& where) const { return ok() ? *this : Status(code_, where + ": " + message_); }

 private:
  StatusCode code_ = StatusCode::kOk;  // kOk means success; message_ is then empty
  std::string message_;                // human-readable, names what is wrong and where
};

// Returns from the enclosing function when `expr` yields a non-ok Status.
#define NGC_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ngc::Status ngc_status_ = (expr);        \
    if (!ngc_status_.ok()) return ngc_status_; \
  } while (0)

}  // namespace ngc
