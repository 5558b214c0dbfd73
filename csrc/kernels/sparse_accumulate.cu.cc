// CUDA kernel of HvdxSparseAccumulate: one thread per entry, atomic adds in float32.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "kernels/sparse_accumulate.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {
namespace functor {
namespace {

constexpr int kThreads = 256;

inline int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
}

template <typename Tout>
__global__ void ToFloat(const Tout* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = static_cast<float>(in[i]);
}

template <typename Tout>
__global__ void FromFloat(const float* in, Tout* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = static_cast<Tout>(in[i]);
}

template <typename T, typename Tidx>
__global__ void ScatterAdd(const T* values, const Tidx* indices, int64_t nnz, float* acc,
                           int64_t size) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < nnz;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = static_cast<int64_t>(indices[j]);
    if (i >= 0 && i < size) atomicAdd(acc + i, static_cast<float>(values[j]));
  }
}

}  // namespace

template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<Eigen::GpuDevice, T, Tidx, Tout> {
  void operator()(const Eigen::GpuDevice& d, const T* values, const Tidx* indices, int64_t nnz,
                  const Tout* dense, Tout* out, int64_t size, float* scratch) {
    if (size == 0) return;
    cudaStream_t stream = d.stream();
    float* acc;
    if constexpr (std::is_same_v<Tout, float>) {
      acc = out;
      if (dense == nullptr)
        cudaMemsetAsync(out, 0, size * sizeof(float), stream);
      else if (dense != out)
        cudaMemcpyAsync(out, dense, size * sizeof(float), cudaMemcpyDeviceToDevice, stream);
    } else {
      acc = scratch;
      if (dense == nullptr)
        cudaMemsetAsync(acc, 0, size * sizeof(float), stream);
      else
        ToFloat<<<Blocks(size), kThreads, 0, stream>>>(dense, acc, size);
    }
    if (nnz > 0) ScatterAdd<<<Blocks(nnz), kThreads, 0, stream>>>(values, indices, nnz, acc, size);
    if constexpr (!std::is_same_v<Tout, float>) {
      FromFloat<<<Blocks(size), kThreads, 0, stream>>>(acc, out, size);
    }
  }
};

#define HVDX_INSTANTIATE_OUT(T, TIDX)                                   \
  template struct SparseAccumulate<Eigen::GpuDevice, T, TIDX, float>;       \
  template struct SparseAccumulate<Eigen::GpuDevice, T, TIDX, Eigen::half>; \
  template struct SparseAccumulate<Eigen::GpuDevice, T, TIDX, Eigen::bfloat16>;
#define HVDX_INSTANTIATE_IDX(T)      \
  HVDX_INSTANTIATE_OUT(T, int32_t) \
  HVDX_INSTANTIATE_OUT(T, int64_t)
HVDX_INSTANTIATE_IDX(float)
HVDX_INSTANTIATE_IDX(Eigen::half)
HVDX_INSTANTIATE_IDX(Eigen::bfloat16)

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
