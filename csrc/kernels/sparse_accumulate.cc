// CPU kernel of HvdxSparseAccumulate, and the OpKernel shared by CPU and GPU.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/sparse_accumulate.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {

using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace errors = ::tensorflow::errors;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

namespace functor {

// The entries are first grouped by the output shard their index falls in, keeping their
// order (a stable counting sort, in parallel over chunks of entries); then each shard
// copies `dense` into its range of the output and adds its entries in ascending j. No two
// threads write the same element, every element adds its entries in input order, and the
// work is O(nnz + size), whatever the number of threads.
template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<CPUDevice, T, Tidx, Tout> {
  static int64_t WorkspaceBytes(int64_t, int64_t size) {
    return std::is_same_v<Tout, float> ? 0 : size * static_cast<int64_t>(sizeof(float));
  }

  ::tensorflow::Status operator()(const CPUDevice& d, const T* values, const Tidx* indices, int64_t nnz,
                                  const Tout* dense, Tout* out, int64_t size, void* workspace) {
    if (size == 0) return ::tensorflow::OkStatus();
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
    const Eigen::TensorOpCost count_cost(static_cast<double>(nnz) / chunks * sizeof(Tidx), 0,
                                         static_cast<double>(nnz) / chunks * 4);
    d.parallelFor(chunks, count_cost, [&](Eigen::Index first, Eigen::Index last) {
      for (Eigen::Index c = first; c < last; ++c) {
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
    d.parallelFor(chunks, count_cost, [&](Eigen::Index first, Eigen::Index last) {
      for (Eigen::Index c = first; c < last; ++c) {
        int64_t* next = start.data() + c * shards;
        for (int64_t j = chunk_begin(c); j < chunk_begin(c + 1); ++j) order[next[shard_of(j)]++] = j;
      }
    });
    // After placing, start[c * shards + s] is where chunk c's entries of shard s end, so
    // shard s's entries are order[end of (s - 1)'s last chunk .. end of its own last chunk).
    auto shard_end = [&](int64_t s) { return s < 0 ? 0 : start[(chunks - 1) * shards + s]; };
    float* acc = static_cast<float*>(workspace);
    const Eigen::TensorOpCost cost(static_cast<double>(nnz) / shards * (sizeof(T) + 8) +
                                       static_cast<double>(size) / shards * sizeof(Tout),
                                   static_cast<double>(size) / shards * sizeof(Tout),
                                   static_cast<double>(nnz + size) / shards);
    d.parallelFor(shards, cost, [&](Eigen::Index first, Eigen::Index last) {
      for (Eigen::Index s = first; s < last; ++s) {
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
    return ::tensorflow::OkStatus();
  }
};

}  // namespace functor

// kHasDense: HvdxSparseAccumulate (input 2 is the dense vector); otherwise
// HvdxSparseScatter (input 2 is the size, the dense vector is zeros).
template <typename Device, typename T, typename Tidx, typename Tout, bool kHasDense>
class SparseAccumulateOp : public OpKernel {
 public:
  explicit SparseAccumulateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    TensorShape dense_shape;
    if constexpr (kHasDense) {
      dense_shape = ctx->input(2).shape();
    } else {
      const Tensor& size = ctx->input(2);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(size.shape()),
                  errors::InvalidArgument("size must be a scalar, got shape ", size.shape().DebugString()));
      const int64_t n = size.scalar<::tensorflow::int64>()();
      OP_REQUIRES(ctx, n >= 0, errors::InvalidArgument("size must be >= 0, got ", n));
      dense_shape = TensorShape({n});
    }
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                errors::InvalidArgument("values must be 1-D, got shape ", values.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument("indices must be 1-D, got shape ", indices.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(dense_shape),
                errors::InvalidArgument("dense must be 1-D, got shape ", dense_shape.DebugString()));
    const int64_t nnz = values.NumElements();
    const int64_t size = dense_shape.num_elements();
    OP_REQUIRES(ctx, indices.NumElements() == nnz,
                errors::InvalidArgument("values and indices must have the same length, got ", nnz,
                                        " and ", indices.NumElements()));
    const Tidx* idx = indices.flat<Tidx>().data();
    if constexpr (std::is_same_v<Device, CPUDevice>) {  // GPU: see the functor header
      for (int64_t j = 0; j < nnz; ++j) {
        OP_REQUIRES(ctx, idx[j] >= 0 && static_cast<int64_t>(idx[j]) < size,
                    errors::InvalidArgument("indices[", j, "] = ", static_cast<int64_t>(idx[j]),
                                            " is out of range [0, ", size, ")"));
      }
    }
    Tensor* output = nullptr;
    if constexpr (kHasDense) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({2}, 0, dense_shape, &output));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, dense_shape, &output));
    }
    using Functor = functor::SparseAccumulate<Device, T, Tidx, Tout>;
    Tensor workspace;
    void* workspace_ptr = nullptr;
    const int64_t workspace_bytes = Functor::WorkspaceBytes(nnz, size);
    if (workspace_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8, TensorShape({workspace_bytes}), &workspace));
      workspace_ptr = workspace.flat<::tensorflow::int8>().data();
    }
    const Tout* dense = kHasDense ? ctx->input(2).flat<Tout>().data() : nullptr;
    OP_REQUIRES_OK(ctx, Functor()(ctx->eigen_device<Device>(), values.flat<T>().data(), idx, nnz, dense,
                                  output->flat<Tout>().data(), size, workspace_ptr));
  }
};

#define HVDX_REGISTER_SPARSE_ACCUMULATE(DEV, DEVICE, T, TIDX, TOUT)                           \
  REGISTER_KERNEL_BUILDER(Name("HvdxSparseAccumulate")                                        \
                              .Device(::tensorflow::DEVICE_##DEV)                             \
                              .TypeConstraint<T>("T")                                         \
                              .TypeConstraint<TIDX>("Tidx")                                   \
                              .TypeConstraint<TOUT>("Tout"),                                  \
                          SparseAccumulateOp<DEVICE, T, TIDX, TOUT, true>);                   \
  REGISTER_KERNEL_BUILDER(Name("HvdxSparseScatter")                                           \
                              .Device(::tensorflow::DEVICE_##DEV)                             \
                              .HostMemory("size")                                             \
                              .TypeConstraint<T>("T")                                         \
                              .TypeConstraint<TIDX>("Tidx")                                   \
                              .TypeConstraint<TOUT>("Tout"),                                  \
                          SparseAccumulateOp<DEVICE, T, TIDX, TOUT, false>);
#define HVDX_REGISTER_FOR_OUT(DEV, DEVICE, T, TIDX)                     \
  HVDX_REGISTER_SPARSE_ACCUMULATE(DEV, DEVICE, T, TIDX, float)          \
  HVDX_REGISTER_SPARSE_ACCUMULATE(DEV, DEVICE, T, TIDX, Eigen::half)    \
  HVDX_REGISTER_SPARSE_ACCUMULATE(DEV, DEVICE, T, TIDX, Eigen::bfloat16)
#define HVDX_REGISTER_FOR_IDX(DEV, DEVICE, T)          \
  HVDX_REGISTER_FOR_OUT(DEV, DEVICE, T, ::tensorflow::int32) \
  HVDX_REGISTER_FOR_OUT(DEV, DEVICE, T, ::tensorflow::int64)
#define HVDX_REGISTER_ALL(DEV, DEVICE)                 \
  HVDX_REGISTER_FOR_IDX(DEV, DEVICE, float)            \
  HVDX_REGISTER_FOR_IDX(DEV, DEVICE, Eigen::half)      \
  HVDX_REGISTER_FOR_IDX(DEV, DEVICE, Eigen::bfloat16)

HVDX_REGISTER_ALL(CPU, CPUDevice)

#if GOOGLE_CUDA
// The GPU functors are explicitly instantiated in sparse_accumulate.cu.cc.
HVDX_REGISTER_ALL(GPU, GPUDevice)
#endif

}  // namespace hvdx
