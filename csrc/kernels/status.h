// The status the kernels and the ops return, in both builds of the same sources:
//   - the TensorFlow op library (the default): hvdx::Status *is* tensorflow::Status (which
//     is absl::Status from TensorFlow 2.13 on), and hvdx::errors builds it as
//     tensorflow::errors' factories did, absl::StrCat of the arguments under the code
//     (those factories are deprecated from TensorFlow 2.18 on, in favour of absl's);
//   - the TensorFlow-free harness (csrc/harness, HVDX_WITHOUT_TENSORFLOW defined): a small
//     standalone Status with the same codes (InvalidArgument = 3, Internal = 13) and the
//     message concatenated from the same arguments.
// Kernel code uses only: hvdx::Status, hvdx::OkStatus(), hvdx::errors::InvalidArgument /
// Internal(args...), status.ok(), and HVDX_RETURN_IF_ERROR(expr).
#ifndef HVDX_KERNELS_STATUS_H_
#define HVDX_KERNELS_STATUS_H_

#if defined(HVDX_WITHOUT_TENSORFLOW)

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace hvdx {

// The subset of absl's status codes the kernels raise (the numbers are absl's).
enum class Code : int { kOk = 0, kInvalidArgument = 3, kInternal = 13 };

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }

namespace errors {

// StrCat's pieces: text as it is, numbers in decimal (as absl::StrCat writes integers).
// No iostreams: a message is built without the locale machinery, which crashed the
// harness on a machine whose compiler and loaded libstdc++ differed (docs/gpu.md).
inline void Append(std::string* out, std::string_view text) { out->append(text.data(), text.size()); }
inline void Append(std::string* out, const char* text) { out->append(text != nullptr ? text : "(null)"); }
inline void Append(std::string* out, char c) { out->push_back(c); }
template <typename T, typename std::enable_if<std::is_arithmetic<T>::value && !std::is_same<T, char>::value &&
                                                  !std::is_same<T, bool>::value,
                                              int>::type = 0>
void Append(std::string* out, T number) {
  out->append(std::to_string(number));
}

// args... written one after another (text, or integers in decimal, as StrCat).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (Append(&out, args), ...);
  return out;
}
template <typename... Args>
Status InvalidArgument(const Args&... args) {
  return Status(Code::kInvalidArgument, StrCat(args...));
}
template <typename... Args>
Status Internal(const Args&... args) {
  return Status(Code::kInternal, StrCat(args...));
}

}  // namespace errors
}  // namespace hvdx

#define HVDX_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::hvdx::Status _hvdx_status = (expr);        \
    if (!_hvdx_status.ok()) return _hvdx_status; \
  } while (0)

#else  // the TensorFlow op library

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"

namespace hvdx {
using Status = ::absl::Status;  // what TensorFlow's Status is (an alias, deprecated from 2.18 on)
using ::absl::OkStatus;

namespace errors {

template <typename... Args>
Status InvalidArgument(const Args&... args) {
  return ::absl::InvalidArgumentError(::absl::StrCat(args...));
}
template <typename... Args>
Status Internal(const Args&... args) {
  return ::absl::InternalError(::absl::StrCat(args...));
}

}  // namespace errors
}  // namespace hvdx

#define HVDX_RETURN_IF_ERROR(expr) TF_RETURN_IF_ERROR(expr)

#endif  // HVDX_WITHOUT_TENSORFLOW
#endif  // HVDX_KERNELS_STATUS_H_
