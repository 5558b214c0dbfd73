// The devices and element types the kernels are written against, in both builds of the
// same sources (see status.h):
//   - the TensorFlow op library: CpuDevice = Eigen::ThreadPoolDevice (when the source
//     defines EIGEN_USE_THREADS), GpuDevice = Eigen::GpuDevice (EIGEN_USE_GPU), OpCost =
//     Eigen::TensorOpCost, and the element types float, Eigen::half and Eigen::bfloat16;
//   - the TensorFlow-free harness (HVDX_WITHOUT_TENSORFLOW): a CpuDevice that runs
//     parallelFor on its own threads, a GpuDevice that holds a cudaStream_t, and float.
// Kernel code uses only: dev.numThreads(), dev.parallelFor(n, OpCost, f(first, last)),
// dev.stream(), hvdx::Index, and HVDX_KERNEL_TYPES(X) / HVDX_KERNEL_TYPES_WITH(X, ...) to
// instantiate its templates once per element type.
#ifndef HVDX_KERNELS_DEVICE_H_
#define HVDX_KERNELS_DEVICE_H_

#include <cstdint>

#if defined(HVDX_WITHOUT_TENSORFLOW)

#include <algorithm>
#include <functional>
#include <thread>
#include <vector>

#if GOOGLE_CUDA
#include <cuda_runtime.h>
#endif

namespace hvdx {

using Index = int64_t;

// What Eigen's cost model is told; the harness's parallelFor splits evenly and ignores it.
struct OpCost {
  OpCost(double /*bytes_loaded*/, double /*bytes_stored*/, double /*compute_cycles*/) {}
};

// parallelFor(n, cost, f): f(first, last) over contiguous pieces of [0, n), one per
// thread (at most numThreads() pieces, the calling thread running the first); returns
// when all are done. The kernels' results do not depend on the number of threads.
class CpuDevice {
 public:
  explicit CpuDevice(int threads) : threads_(std::max(1, threads)) {}
  int numThreads() const { return threads_; }
  void parallelFor(Index n, const OpCost&, const std::function<void(Index, Index)>& f) const {
    if (n <= 0) return;
    const Index pieces = std::min<Index>(n, threads_);
    if (pieces == 1) {
      f(0, n);
      return;
    }
    std::vector<std::thread> workers;
    workers.reserve(pieces - 1);
    for (Index p = 1; p < pieces; ++p) workers.emplace_back([&f, n, pieces, p] { f(n * p / pieces, n * (p + 1) / pieces); });
    f(0, n / pieces);
    for (std::thread& w : workers) w.join();
  }

 private:
  int threads_;
};

#if GOOGLE_CUDA
class GpuDevice {
 public:
  explicit GpuDevice(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
};
#endif

}  // namespace hvdx

#define HVDX_KERNEL_TYPES(X) X(float)
#define HVDX_KERNEL_TYPES_WITH(X, ...) X(float, __VA_ARGS__)

#else  // the TensorFlow op library

#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {
using Index = Eigen::Index;
using OpCost = Eigen::TensorOpCost;
#if defined(EIGEN_USE_THREADS)
using CpuDevice = Eigen::ThreadPoolDevice;
#endif
#if defined(EIGEN_USE_GPU)
using GpuDevice = Eigen::GpuDevice;
#endif
}  // namespace hvdx

#define HVDX_KERNEL_TYPES(X) X(float) X(Eigen::half) X(Eigen::bfloat16)
#define HVDX_KERNEL_TYPES_WITH(X, ...) X(float, __VA_ARGS__) X(Eigen::half, __VA_ARGS__) X(Eigen::bfloat16, __VA_ARGS__)

#endif  // HVDX_WITHOUT_TENSORFLOW
#endif  // HVDX_KERNELS_DEVICE_H_
