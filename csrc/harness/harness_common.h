// Shared by the harness's C ABI files: hvdx::Status to (code, message) across the ABI, and
// the argument checks the ops make before they call a functor (csrc/ops/*_kernel.cc).
#ifndef HVDX_HARNESS_COMMON_H_
#define HVDX_HARNESS_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/error_feedback.h"
#include "kernels/status.h"

namespace hvdx {
namespace harness {

inline int Report(const Status& status, char* msg, size_t msg_size) {
  if (msg != nullptr && msg_size > 0) {
    const std::string& text = status.message();
    const size_t n = std::min(text.size(), msg_size - 1);
    std::memcpy(msg, text.data(), n);
    msg[n] = '\0';
  }
  return static_cast<int>(status.code());
}

// Unimplemented (12): what a CPU-only harness answers to a GPU call.
inline int NoCuda(char* msg, size_t msg_size) {
  Report(Status(static_cast<Code>(12), "hvdx harness: built without CUDA (configure csrc/harness with "
                                       "-DHVDX_HARNESS_CUDA=ON on a machine with nvcc)"),
         msg, msg_size);
  return 12;
}

// MsTopKOp's checks; *k_out = min(k, d).
inline Status CheckMsTopK(int64_t d, int64_t k, int num_samplings, int index_bits, int64_t* k_out) {
  if (d < 0) return errors::InvalidArgument("mstopk: d must be >= 0, got ", d);
  if (k < 0) return errors::InvalidArgument("mstopk: k must be >= 0, got ", k);
  if (num_samplings < 1) return errors::InvalidArgument("mstopk: num_samplings must be >= 1, got ", num_samplings);
  if (index_bits != 32 && index_bits != 64)
    return errors::InvalidArgument("mstopk: index_bits must be 32 or 64, got ", index_bits);
  if (index_bits == 32 && d > std::numeric_limits<int32_t>::max())
    return errors::InvalidArgument("mstopk: int32 indices cannot address ", d, " elements; use int64");
  *k_out = std::min(k, d);
  return OkStatus();
}

inline Status CheckSparse(int64_t nnz, int64_t size, int index_bits) {
  if (nnz < 0) return errors::InvalidArgument("sparse_accumulate: nnz must be >= 0, got ", nnz);
  if (size < 0) return errors::InvalidArgument("sparse_accumulate: size must be >= 0, got ", size);
  if (index_bits != 32 && index_bits != 64)
    return errors::InvalidArgument("sparse_accumulate: index_bits must be 32 or 64, got ", index_bits);
  return OkStatus();
}

// ErrorFeedbackOp's checks, and the functor's list of gradients.
inline Status GradientList(const float* const* grads, int count, int64_t n, functor::GradientList* list) {
  if (n < 0) return errors::InvalidArgument("error_feedback: n must be >= 0, got ", n);
  list->count = count;
  HVDX_RETURN_IF_ERROR(functor::CheckGradientList(*list));
  for (int j = 0; j < count; ++j) list->data[j] = grads[j];
  return OkStatus();
}

}  // namespace harness
}  // namespace hvdx

#endif  // HVDX_HARNESS_COMMON_H_
