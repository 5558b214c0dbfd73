// CUDA kernel of HvdxSparseAccumulate / HvdxSparseScatter, deterministic: the entries are
// sorted by index (a stable radix sort of (index, j) pairs, so equal indices keep
// ascending j), and one thread per distinct index adds its entries in that order onto
// dense[i] in float32, as the CPU kernel does. No atomics: the bits of the result are the
// same on every run, every rank and the CPU.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "kernels/gpu_launch.h"
#include "kernels/sparse_accumulate.h"

namespace hvdx {
namespace functor {
namespace {

constexpr int kThreads = 256;

inline int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
}

inline int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }

__global__ void Iota(int64_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = i;
}

// One thread per run of equal indices in the sorted keys: out[i] = Tout(float(out[i]) +
// values[j1] + values[j2] + ...) with j1 < j2 < ... (out[i] holds dense[i] already).
template <typename T, typename Tidx, typename Tout>
__global__ void AddRuns(const T* values, const Tidx* keys, const int64_t* order, int64_t nnz, Tout* out,
                        int64_t size) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < nnz; p += int64_t(gridDim.x) * blockDim.x) {
    const Tidx key = keys[p];
    if ((p > 0 && keys[p - 1] == key) || key < 0 || static_cast<int64_t>(key) >= size) continue;
    const int64_t i = static_cast<int64_t>(key);
    float acc = static_cast<float>(out[i]);
    for (int64_t q = p; q < nnz && keys[q] == key; ++q) acc = __fadd_rn(acc, static_cast<float>(values[order[q]]));
    out[i] = static_cast<Tout>(acc);
  }
}

// Bytes of cub's radix sort of nnz (Tidx, int64) pairs.
template <typename Tidx>
int64_t SortBytes(int64_t nnz) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const Tidx*>(nullptr), static_cast<Tidx*>(nullptr),
                                  static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                  static_cast<int>(std::min<int64_t>(nnz, INT32_MAX)));
  return static_cast<int64_t>(bytes);
}

}  // namespace

template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<GpuDevice, T, Tidx, Tout> {
  // sorted keys, positions (in, sorted), cub's temporary storage
  static int64_t WorkspaceBytes(int64_t nnz, int64_t) {
    if (nnz == 0) return 0;
    return Align(nnz * sizeof(Tidx)) + 2 * Align(nnz * sizeof(int64_t)) + Align(SortBytes<Tidx>(nnz));
  }

  Status operator()(const GpuDevice& d, const T* values, const Tidx* indices, int64_t nnz,
                    const Tout* dense, Tout* out, int64_t size, void* workspace) {
    if (size == 0) return OkStatus();
    if (nnz > INT32_MAX)
      return errors::InvalidArgument("sparse_accumulate on the GPU takes at most 2^31 - 1 entries, got ", nnz);
    cudaStream_t stream = d.stream();
    if (dense == nullptr) {
      HVDX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, size * sizeof(Tout), stream), "cudaMemsetAsync");
    } else if (dense != out) {
      HVDX_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, dense, size * sizeof(Tout), cudaMemcpyDeviceToDevice, stream),
                                "cudaMemcpyAsync");
    }
    if (nnz == 0) return OkStatus();
    char* bytes = static_cast<char*>(workspace);
    Tidx* keys = reinterpret_cast<Tidx*>(bytes);
    bytes += Align(nnz * sizeof(Tidx));
    int64_t* positions = reinterpret_cast<int64_t*>(bytes);
    bytes += Align(nnz * sizeof(int64_t));
    int64_t* order = reinterpret_cast<int64_t*>(bytes);
    bytes += Align(nnz * sizeof(int64_t));
    size_t sort_bytes = static_cast<size_t>(SortBytes<Tidx>(nnz));
    HVDX_RETURN_IF_ERROR(Launch("Iota", Iota, Blocks(nnz), kThreads, 0, stream, positions, nnz));
    // Radix sort is stable: equal indices keep ascending positions.
    HVDX_CUDA_RETURN_IF_ERROR(
        cub::DeviceRadixSort::SortPairs(bytes, sort_bytes, indices, keys, positions, order, static_cast<int>(nnz), 0,
                                        static_cast<int>(sizeof(Tidx) * 8), stream),
        "cub::DeviceRadixSort::SortPairs");
    return Launch("AddRuns", AddRuns<T, Tidx, Tout>, Blocks(nnz), kThreads, 0, stream, values, keys, order, nnz, out,
                  size);
  }
};

#define HVDX_INSTANTIATE(Tout, T, Tidx) template struct SparseAccumulate<GpuDevice, T, Tidx, Tout>;
#define HVDX_INSTANTIATE_IDX(T)                             \
  HVDX_KERNEL_TYPES_WITH(HVDX_INSTANTIATE, T, int32_t) \
  HVDX_KERNEL_TYPES_WITH(HVDX_INSTANTIATE, T, int64_t)
HVDX_KERNEL_TYPES(HVDX_INSTANTIATE_IDX)
#undef HVDX_INSTANTIATE_IDX
#undef HVDX_INSTANTIATE

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
