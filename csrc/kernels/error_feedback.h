// Functor shared by the CPU (error_feedback.cc) and CUDA (error_feedback.cu.cc) kernels of
// HvdxErrorFeedback: the one pass over a buffer that error feedback with DGC's momentum
// correction needs before top-k selects from it (hvdx/comm/dgc.py, `accumulate`).
#ifndef HVDX_KERNELS_ERROR_FEEDBACK_H_
#define HVDX_KERNELS_ERROR_FEEDBACK_H_

#include <cstdint>

#include "kernels/device.h"
#include "kernels/status.h"

namespace hvdx {
namespace functor {

// The gradients added, by value (a kernel argument on the GPU): at most kMax of them; the
// op sums longer lists in groups first.
struct GradientList {
  static constexpr int kMax = 8;
  const float* data[kMax];
  int count;
};

// The functors' one check of a list's count (the op and the harness fill `data` only after theirs).
inline Status CheckGradientList(const GradientList& grads) {
  if (grads.count < 1 || grads.count > GradientList::kMax) {
    return errors::InvalidArgument("ErrorFeedback takes 1 to ", GradientList::kMax, " gradients, got ", grads.count);
  }
  return OkStatus();
}

// For i < n, with g = ((grads[0][i] + grads[1][i]) + ...) in float32, in that order:
//   velocity given (non-null):  u = momentum * velocity[i] + g;  velocity_out[i] = u;
//                               acc[i] = decay * residual[i] + u
//   no velocity:                acc[i] = decay * residual[i] + g
// Each product and sum is rounded to float32 as written (no fused multiply-add), so the CPU
// and the GPU agree bit for bit; decay == 1 multiplies by nothing. `acc` may alias
// grads[0] and `velocity_out` may alias `velocity` (their input buffers were forwarded).
template <typename Device>
struct ErrorFeedback {
  Status operator()(const Device& d, const GradientList& grads, const float* residual, const float* velocity,
                    float momentum, float decay, float* acc, float* velocity_out, int64_t n);
};

}  // namespace functor
}  // namespace hvdx

#endif  // HVDX_KERNELS_ERROR_FEEDBACK_H_
