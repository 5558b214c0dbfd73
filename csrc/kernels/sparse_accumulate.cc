// CPU kernel of HvdxSparseAccumulate, and the OpKernel shared by CPU and GPU.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/sparse_accumulate.h"

#include <algorithm>
#include <type_traits>

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

// Each shard owns a contiguous range of the output, copies `dense` into it, and scans all
// entries, keeping those that fall in its range: no two threads write the same element,
// and every element sums its entries in input order, so the result is deterministic.
template <typename T, typename Tidx, typename Tout>
struct SparseAccumulate<CPUDevice, T, Tidx, Tout> {
  void operator()(const CPUDevice& d, const T* values, const Tidx* indices, int64_t nnz,
                  const Tout* dense, Tout* out, int64_t size, float* scratch) {
    if (size == 0) return;
    const int64_t shards =
        std::max<int64_t>(1, std::min<int64_t>(d.numThreads(), size / 4096));
    const Eigen::TensorOpCost cost(nnz * (sizeof(T) + sizeof(Tidx)) + size / shards * sizeof(Tout),
                                   size / shards * sizeof(Tout), nnz);
    d.parallelFor(shards, cost, [&](Eigen::Index first, Eigen::Index last) {
      for (Eigen::Index s = first; s < last; ++s) {
        const int64_t lo = size * s / shards, hi = size * (s + 1) / shards;
        if constexpr (std::is_same_v<Tout, float>) {
          if (dense == nullptr) std::fill(out + lo, out + hi, 0.0f);
          else if (dense != out) std::copy(dense + lo, dense + hi, out + lo);
          for (int64_t j = 0; j < nnz; ++j) {
            const int64_t i = static_cast<int64_t>(indices[j]);
            if (i >= lo && i < hi) out[i] += static_cast<float>(values[j]);
          }
        } else {
          for (int64_t i = lo; i < hi; ++i) scratch[i] = dense ? static_cast<float>(dense[i]) : 0.0f;
          for (int64_t j = 0; j < nnz; ++j) {
            const int64_t i = static_cast<int64_t>(indices[j]);
            if (i >= lo && i < hi) scratch[i] += static_cast<float>(values[j]);
          }
          for (int64_t i = lo; i < hi; ++i) out[i] = static_cast<Tout>(scratch[i]);
        }
      }
    });
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
    Tensor dense;
    if constexpr (kHasDense) {
      dense = ctx->input(2);
    } else {
      const Tensor& size = ctx->input(2);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(size.shape()),
                  errors::InvalidArgument("size must be a scalar, got shape ", size.shape().DebugString()));
      const int64_t n = size.scalar<::tensorflow::int64>()();
      OP_REQUIRES(ctx, n >= 0, errors::InvalidArgument("size must be >= 0, got ", n));
      dense = Tensor(DataTypeToEnum<Tout>::value, TensorShape({n}));  // shape only: never read
    }
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                errors::InvalidArgument("values must be 1-D, got shape ", values.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument("indices must be 1-D, got shape ", indices.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(dense.shape()),
                errors::InvalidArgument("dense must be 1-D, got shape ", dense.shape().DebugString()));
    const int64_t nnz = values.NumElements();
    const int64_t size = dense.NumElements();
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
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({2}, 0, dense.shape(), &output));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, dense.shape(), &output));
    }
    Tensor scratch;
    float* scratch_ptr = nullptr;
    if (!std::is_same_v<Tout, float>) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({size}), &scratch));
      scratch_ptr = scratch.flat<float>().data();
    }
    functor::SparseAccumulate<Device, T, Tidx, Tout>()(
        ctx->eigen_device<Device>(), values.flat<T>().data(), idx, nnz,
        kHasDense ? dense.flat<Tout>().data() : nullptr, output->flat<Tout>().data(), size, scratch_ptr);
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
