// CUDA kernel of HvdxErrorFeedback: one thread per element (grid-stride), each product and
// sum rounded as written (__fmul_rn / __fadd_rn: no contraction into a fused multiply-add),
// so that the result equals the CPU kernel's bit for bit.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/error_feedback.h"
#include "kernels/gpu_launch.h"

namespace hvdx {
namespace functor {
namespace {

constexpr int kThreads = 256;

__global__ void ErrorFeedbackKernel(GradientList grads, const float* residual, const float* velocity,
                                    float momentum, float decay, bool has_decay, float* acc, float* velocity_out,
                                    int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float g = grads.data[0][i];
    for (int j = 1; j < grads.count; ++j) g = __fadd_rn(g, grads.data[j][i]);
    if (velocity != nullptr) {
      g = __fadd_rn(__fmul_rn(momentum, velocity[i]), g);
      velocity_out[i] = g;
    }
    const float r = has_decay ? __fmul_rn(decay, residual[i]) : residual[i];
    acc[i] = __fadd_rn(r, g);
  }
}

}  // namespace

template <>
Status ErrorFeedback<GpuDevice>::operator()(const GpuDevice& d, const GradientList& grads, const float* residual,
                                             const float* velocity, float momentum, float decay, float* acc,
                                             float* velocity_out, int64_t n) {
  if (n == 0) return OkStatus();
  HVDX_RETURN_IF_ERROR(CheckGradientList(grads));
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
  return Launch("ErrorFeedbackKernel", ErrorFeedbackKernel, dim3(blocks), dim3(kThreads), 0, d.stream(), grads,
                residual, velocity, momentum, decay, decay != 1.0f, acc, velocity_out, n);
}

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
