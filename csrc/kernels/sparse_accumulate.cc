// CPU kernel of HvdxSparseAccumulate / HvdxSparseScatter. (The OpKernel shared by CPU and
// GPU is csrc/ops/sparse_accumulate_kernel.cc; this file builds without TensorFlow too, for
// the harness in csrc/harness.)
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/sparse_accumulate.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace hvdx {

namespace functor {

// The entries are first grouped by the output shard their index falls in, keeping their
// order (a stable counting sort, in parallel over chunks of entries); then each shard
// copies `dense` into its range of the output and adds its entries in ascending j. No two
// threads write the same element, every element adds its entries in input order, and the
// work is O(nnz + size), whatever the number of threads.
template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<CpuDevice, T, Tidx, Tout> {
  static int64_t WorkspaceBytes(int64_t, int64_t size) {
    return std::is_same_v<Tout, float> ? 0 : size * static_cast<int64_t>(sizeof(float));
  }

  Status operator()(const CpuDevice& d, const T* values, const Tidx* indices, int64_t nnz,
                    const Tout* dense, Tout* out, int64_t size, void* workspace) {
    if (size == 0) return OkStatus();
    // Shards of 2^shift elements (a shift, not a division, per entry), about 4 per thread.
    const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(4 * d.numThreads(), size / 4096));
    int shift = 0;
    while ((int64_t{1} << shift) * wanted < size) ++shift;
    const int64_t shards = ((size - 1) >> shift) + 1;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(d.numThreads(), nnz / 16384));
    auto shard_of = [&](int64_t j) { return static_cast<int64_t>(indices[j]) >> shift; };
    auto chunk_begin = [&](int64_t c) { return nnz * c / chunks; };
    // start[c * shards + s]: where chunk c's entries of shard s go in `order`.
    std::vector<int64_t> start(chunks * shards + 1, 0);
    const OpCost count_cost(static_cast<double>(nnz) / chunks * sizeof(Tidx), 0,
                            static_cast<double>(nnz) / chunks * 4);
    d.parallelFor(chunks, count_cost, [&](Index first, Index last) {
      for (Index c = first; c < last; ++c) {
        int64_t* count = start.data() + c * shards;
        for (int64_t j = chunk_begin(c); j < chunk_begin(c + 1); ++j) ++count[shard_of(j)];
      }
    });
    int64_t total = 0;  // exclusive prefix sum in (shard, chunk) order
    for (int64_t s = 0; s < shards; ++s) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n = start[c * shards + s];
        start[c * shards + s] = total;
        total += n;
      }
    }
    std::vector<int64_t> order(nnz);
    d.parallelFor(chunks, count_cost, [&](Index first, Index last) {
      for (Index c = first; c < last; ++c) {
        int64_t* next = start.data() + c * shards;
        for (int64_t j = chunk_begin(c); j < chunk_begin(c + 1); ++j) order[next[shard_of(j)]++] = j;
      }
    });
    // After placing, start[c * shards + s] is where chunk c's entries of shard s end, so
    // shard s's entries are order[end of (s - 1)'s last chunk .. end of its own last chunk).
    auto shard_end = [&](int64_t s) { return s < 0 ? 0 : start[(chunks - 1) * shards + s]; };
    float* acc = static_cast<float*>(workspace);
    const OpCost cost(static_cast<double>(nnz) / shards * (sizeof(T) + 8) +
                          static_cast<double>(size) / shards * sizeof(Tout),
                      static_cast<double>(size) / shards * sizeof(Tout),
                      static_cast<double>(nnz + size) / shards);
    d.parallelFor(shards, cost, [&](Index first, Index last) {
      for (Index s = first; s < last; ++s) {
        const int64_t lo = s << shift, hi = std::min(size, (s + 1) << shift);
        const int64_t* entry = order.data() + shard_end(s - 1);
        const int64_t n = shard_end(s) - shard_end(s - 1);
        if constexpr (std::is_same_v<Tout, float>) {
          if (dense == nullptr) std::fill(out + lo, out + hi, 0.0f);
          else if (dense != out) std::copy(dense + lo, dense + hi, out + lo);
          for (int64_t e = 0; e < n; ++e) {
            const int64_t j = entry[e];
            out[static_cast<int64_t>(indices[j])] += static_cast<float>(values[j]);
          }
        } else {
          for (int64_t i = lo; i < hi; ++i) acc[i] = dense ? static_cast<float>(dense[i]) : 0.0f;
          for (int64_t e = 0; e < n; ++e) {
            const int64_t j = entry[e];
            acc[static_cast<int64_t>(indices[j])] += static_cast<float>(values[j]);
          }
          for (int64_t i = lo; i < hi; ++i) out[i] = static_cast<Tout>(acc[i]);
        }
      }
    });
    return OkStatus();
  }
};

#define HVDX_INSTANTIATE(Tout, T, Tidx) template struct SparseAccumulate<CpuDevice, T, Tidx, Tout>;
#define HVDX_INSTANTIATE_IDX(T)                        \
  HVDX_KERNEL_TYPES_WITH(HVDX_INSTANTIATE, T, int32_t) \
  HVDX_KERNEL_TYPES_WITH(HVDX_INSTANTIATE, T, int64_t)
HVDX_KERNEL_TYPES(HVDX_INSTANTIATE_IDX)
#undef HVDX_INSTANTIATE_IDX
#undef HVDX_INSTANTIATE

}  // namespace functor
}  // namespace hvdx
