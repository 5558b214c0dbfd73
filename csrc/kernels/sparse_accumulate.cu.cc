// CUDA kernel of HvdxSparseAccumulate / HvdxSparseScatter, deterministic: the entries'
// (index, value) pairs are sorted by index with a stable radix sort, so equal indices keep
// ascending j, and one thread per distinct index adds its values in that order onto
// dense[i] in float32, as the CPU kernel does. No atomics: the bits of the result are the
// same on every run, every rank and the CPU. The sort moves the values themselves (no
// permutation to gather through); int64 indices into fewer than 2^32 elements are sorted
// as 32-bit keys (out-of-range ones mapped to a key past every valid one).
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
constexpr uint32_t kSkipped = 0xFFFFFFFFu;  // the 32-bit key of an index outside [0, size)

inline int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
}

inline int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }

template <typename K>
__device__ inline bool InRange(K key, int64_t size) {
  if constexpr (std::is_signed<K>::value) {
    if (key < 0) return false;
  }
  return static_cast<uint64_t>(key) < static_cast<uint64_t>(size);
}

// keys[j] = indices[j] as a 32-bit key, kSkipped when outside [0, size) (size <= kSkipped).
template <typename Tidx>
__global__ void NarrowKeys(const Tidx* indices, int64_t nnz, int64_t size, uint32_t* keys) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < nnz; j += int64_t(gridDim.x) * blockDim.x) {
    const Tidx i = indices[j];
    keys[j] = InRange(i, size) ? static_cast<uint32_t>(i) : kSkipped;
  }
}

// One thread per run of equal keys in the sorted pairs: out[i] = Tout(float(out[i]) +
// values[p] + values[p + 1] + ...) over the run, in sorted order, which is ascending j
// (out[i] holds dense[i] already).
template <typename K, typename T, typename Tout>
__global__ void AddRuns(const T* values, const K* keys, int64_t nnz, Tout* out, int64_t size) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < nnz; p += int64_t(gridDim.x) * blockDim.x) {
    const K key = keys[p];
    if ((p > 0 && keys[p - 1] == key) || !InRange(key, size)) continue;
    const int64_t i = static_cast<int64_t>(key);
    float acc = static_cast<float>(out[i]);
    for (int64_t q = p; q < nnz && keys[q] == key; ++q) acc = __fadd_rn(acc, static_cast<float>(values[q]));
    out[i] = static_cast<Tout>(acc);
  }
}

// The key type sorted: 32-bit for int64 indices into fewer than 2^32 elements.
template <typename Tidx>
bool Narrow(int64_t size) {
  return sizeof(Tidx) > 4 && size <= static_cast<int64_t>(kSkipped);
}

// Bytes of cub's radix sort of nnz (K, T) pairs.
template <typename K, typename T>
int64_t SortBytes(int64_t nnz) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const K*>(nullptr), static_cast<K*>(nullptr),
                                  static_cast<const T*>(nullptr), static_cast<T*>(nullptr),
                                  static_cast<int>(std::min<int64_t>(nnz, INT32_MAX)));
  return static_cast<int64_t>(bytes);
}

// Sorts the (key, value) pairs into the workspace and adds the runs.
template <typename K, typename T, typename Tout>
Status SortAndAdd(const K* keys_in, const T* values, int64_t nnz, Tout* out, int64_t size, char* bytes,
                  cudaStream_t stream) {
  K* keys = reinterpret_cast<K*>(bytes);
  bytes += Align(nnz * sizeof(K));
  T* sorted = reinterpret_cast<T*>(bytes);
  bytes += Align(nnz * sizeof(T));
  size_t sort_bytes = static_cast<size_t>(SortBytes<K, T>(nnz));
  // Radix sort is stable: equal keys keep ascending j.
  HVDX_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(bytes, sort_bytes, keys_in, keys, values, sorted,
                                                            static_cast<int>(nnz), 0, static_cast<int>(sizeof(K) * 8),
                                                            stream),
                            "cub::DeviceRadixSort::SortPairs");
  return Launch("AddRuns", AddRuns<K, T, Tout>, Blocks(nnz), kThreads, 0, stream, sorted, keys, nnz, out, size);
}

}  // namespace

template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<GpuDevice, T, Tidx, Tout> {
  // (narrowed keys,) sorted keys, sorted values, cub's temporary storage
  static int64_t WorkspaceBytes(int64_t nnz, int64_t size) {
    if (nnz == 0) return 0;
    if (Narrow<Tidx>(size))
      return 2 * Align(nnz * 4) + Align(nnz * sizeof(T)) + Align(SortBytes<uint32_t, T>(nnz));
    return Align(nnz * sizeof(Tidx)) + Align(nnz * sizeof(T)) + Align(SortBytes<Tidx, T>(nnz));
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
    if (Narrow<Tidx>(size)) {
      uint32_t* narrow = reinterpret_cast<uint32_t*>(bytes);
      HVDX_RETURN_IF_ERROR(
          Launch("NarrowKeys", NarrowKeys<Tidx>, Blocks(nnz), kThreads, 0, stream, indices, nnz, size, narrow));
      return SortAndAdd<uint32_t, T, Tout>(narrow, values, nnz, out, size, bytes + Align(nnz * 4), stream);
    }
    return SortAndAdd<Tidx, T, Tout>(indices, values, nnz, out, size, bytes, stream);
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
