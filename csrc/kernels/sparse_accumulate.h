// Functor shared by the CPU (sparse_accumulate.cc) and CUDA (sparse_accumulate.cu.cc)
// kernels of HvdxSparseAccumulate.
#ifndef HVDX_KERNELS_SPARSE_ACCUMULATE_H_
#define HVDX_KERNELS_SPARSE_ACCUMULATE_H_

#include <cstdint>

namespace hvdx {
namespace functor {

// out = dense + values[j] added at indices[j] for j < nnz. `dense` may alias `out` (the
// input buffer was forwarded), is copied first otherwise, and means zeros when nullptr. When Tout is a 16-bit type, `scratch` is a float32 buffer of `size` elements used to
// accumulate before rounding once; it is nullptr when Tout is float.
// Entries whose index is outside [0, size) are skipped: the CPU kernel rejects them
// before calling the functor; on the GPU they are ignored, as TensorFlow's GPU scatters do.
template <typename Device, typename T, typename Tidx, typename Tout>
struct SparseAccumulate {
  void operator()(const Device& d, const T* values, const Tidx* indices, int64_t nnz,
                  const Tout* dense, Tout* out, int64_t size, float* scratch);
};

}  // namespace functor
}  // namespace hvdx

#endif  // HVDX_KERNELS_SPARSE_ACCUMULATE_H_
