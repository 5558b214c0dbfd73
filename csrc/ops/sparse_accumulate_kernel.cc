// The OpKernel of HvdxSparseAccumulate and HvdxSparseScatter, shared by CPU and GPU: checks
// the inputs, allocates the output and the workspace, and calls the functor of
// csrc/kernels/sparse_accumulate.{h,cc,cu.cc}.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <cstdint>
#include <type_traits>

#include "kernels/sparse_accumulate.h"
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
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

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
      const int64_t n = size.scalar<int64_t>()();
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
      workspace_ptr = workspace.flat<int8_t>().data();
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
  HVDX_REGISTER_FOR_OUT(DEV, DEVICE, T, int32_t) \
  HVDX_REGISTER_FOR_OUT(DEV, DEVICE, T, int64_t)
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
