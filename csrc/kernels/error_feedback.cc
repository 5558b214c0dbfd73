// CPU kernel of HvdxErrorFeedback (the OpKernel is csrc/ops/error_feedback_kernel.cc; this
// file builds without TensorFlow too, for the harness in csrc/harness).
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/error_feedback.h"

#include <algorithm>

// Products and sums are rounded as written: no fused multiply-add (aarch64's GCC contracts by
// default), as on the GPU.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace hvdx {
namespace functor {
namespace {

constexpr int64_t kBlock = 1024;  // elements summed into a local buffer at a time (4 KiB: L1)

// One contiguous range [lo, hi), a block at a time: g is summed into a local buffer first, so
// every loop reads and writes whole arrays (vectorized) and `acc` may alias grads[0] and
// `velocity_out` `velocity`. Every input is read once and every output written once.
template <bool kVelocity, bool kDecay>
void Range(const GradientList& grads, const float* residual, const float* velocity, float momentum, float decay,
           float* acc, float* velocity_out, int64_t lo, int64_t hi) {
  alignas(64) float g[kBlock];
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t m = std::min(kBlock, hi - b);
    const float* g0 = grads.data[0] + b;
    if (grads.count == 1) {
      for (int64_t i = 0; i < m; ++i) g[i] = g0[i];
    } else {
      const float* g1 = grads.data[1] + b;
      for (int64_t i = 0; i < m; ++i) g[i] = g0[i] + g1[i];
      for (int j = 2; j < grads.count; ++j) {
        const float* gj = grads.data[j] + b;
        for (int64_t i = 0; i < m; ++i) g[i] += gj[i];
      }
    }
    if constexpr (kVelocity) {
      const float* u = velocity + b;
      for (int64_t i = 0; i < m; ++i) g[i] = momentum * u[i] + g[i];
      float* out = velocity_out + b;
      for (int64_t i = 0; i < m; ++i) out[i] = g[i];
    }
    const float* r = residual + b;
    float* a = acc + b;
    if constexpr (kDecay) {
      for (int64_t i = 0; i < m; ++i) a[i] = decay * r[i] + g[i];
    } else {
      for (int64_t i = 0; i < m; ++i) a[i] = r[i] + g[i];
    }
  }
}

}  // namespace

template <>
Status ErrorFeedback<CpuDevice>::operator()(const CpuDevice& d, const GradientList& grads, const float* residual,
                                             const float* velocity, float momentum, float decay, float* acc,
                                             float* velocity_out, int64_t n) {
  if (n == 0) return OkStatus();
  HVDX_RETURN_IF_ERROR(CheckGradientList(grads));
  const bool has_velocity = velocity != nullptr, has_decay = decay != 1.0f;
  const double streams = grads.count + 1 + (has_velocity ? 1 : 0);
  const OpCost cost(streams * sizeof(float), (has_velocity ? 2 : 1) * sizeof(float), streams + 2);
  d.parallelFor(n, cost, [&](Index lo, Index hi) {
    if (has_velocity) {
      if (has_decay) Range<true, true>(grads, residual, velocity, momentum, decay, acc, velocity_out, lo, hi);
      else Range<true, false>(grads, residual, velocity, momentum, decay, acc, velocity_out, lo, hi);
    } else {
      if (has_decay) Range<false, true>(grads, residual, velocity, momentum, decay, acc, velocity_out, lo, hi);
      else Range<false, false>(grads, residual, velocity, momentum, decay, acc, velocity_out, lo, hi);
    }
  });
  return OkStatus();
}

}  // namespace functor
}  // namespace hvdx
