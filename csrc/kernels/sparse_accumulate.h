// Functor shared by the CPU (sparse_accumulate.cc) and CUDA (sparse_accumulate.cu.cc)
// kernels of HvdxSparseAccumulate and HvdxSparseScatter.
#ifndef HVDX_KERNELS_SPARSE_ACCUMULATE_H_
#define HVDX_KERNELS_SPARSE_ACCUMULATE_H_

#include <cstdint>

#include "kernels/device.h"
#include "kernels/status.h"

namespace hvdx {
namespace functor {

// out = dense + values[j] added at indices[j] for j < nnz, deterministically: each output
// element starts from dense[i] (zeros when `dense` is nullptr) as float32 and adds its
// entries one by one in ascending j, then is rounded once to Tout. The CPU and the GPU
// kernels add in exactly this order, so their results are equal bit for bit, on every run
// and every rank. `dense` may alias `out` (the input buffer was forwarded).
// `workspace` holds WorkspaceBytes(nnz, size) bytes: on the CPU a float32 accumulator of
// `size` elements when Tout is 16-bit; on the GPU the entries sorted by index.
// Entries whose index is outside [0, size) are skipped: the CPU op rejects them before
// calling the functor; on the GPU they are ignored, as TensorFlow's GPU scatters do.
template <typename Device, typename T, typename Tidx, typename Tout>
struct SparseAccumulate {
  static int64_t WorkspaceBytes(int64_t nnz, int64_t size);
  Status operator()(const Device& d, const T* values, const Tidx* indices, int64_t nnz,
                    const Tout* dense, Tout* out, int64_t size, void* workspace);
};

}  // namespace functor
}  // namespace hvdx

#endif  // HVDX_KERNELS_SPARSE_ACCUMULATE_H_
