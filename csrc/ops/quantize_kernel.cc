// The OpKernels of HvdxQuantize / HvdxDequantize, shared by CPU and GPU: check the inputs,
// allocate the outputs and call the functors of csrc/kernels/quantize.{h,cc,cu.cc}.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <cstdint>

#include "kernels/quantize.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

template <typename Device>
class QuantizeOp : public OpKernel {
 public:
  explicit QuantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk_));
    OP_REQUIRES_OK(ctx, functor::CheckQuantized(0, bits_, chunk_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(x.shape()),
                errors::InvalidArgument("x must be 1-D, got shape ", x.shape().DebugString()));
    const int64_t n = x.NumElements();
    OP_REQUIRES_OK(ctx, functor::CheckQuantized(n, bits_, chunk_));
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({functor::QuantizedBytes(n, bits_, chunk_)}), &packed));
    Tensor* dequantized = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, x.shape(), &dequantized));
    OP_REQUIRES_OK(ctx, functor::Quantize<Device>()(ctx->eigen_device<Device>(), x.flat<float>().data(), n,
                                                       bits_, chunk_, packed->flat<uint8_t>().data(),
                                                       dequantized->flat<float>().data()));
  }

 private:
  int bits_ = 8;
  int chunk_ = 1024;
};

template <typename Device>
class DequantizeOp : public OpKernel {
 public:
  explicit DequantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk_));
    OP_REQUIRES_OK(ctx, functor::CheckQuantized(0, bits_, chunk_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(packed.shape()),
                errors::InvalidArgument("packed must be 1-D, got shape ", packed.shape().DebugString()));
    const int64_t per_chunk = static_cast<int64_t>(chunk_) * bits_ / 8 + 4;
    const int64_t bytes = packed.NumElements();
    OP_REQUIRES(ctx, bytes % per_chunk == 0,
                errors::InvalidArgument("packed has ", bytes, " bytes, not a whole number of ", per_chunk,
                                        "-byte chunks (", chunk_, " values of ", bits_, " bits and a float32 scale)"));
    const int64_t n = bytes / per_chunk * chunk_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    OP_REQUIRES_OK(ctx, functor::Dequantize<Device>()(ctx->eigen_device<Device>(),
                                                         packed.flat<uint8_t>().data(), n, bits_, chunk_,
                                                         out->flat<float>().data()));
  }

 private:
  int bits_ = 8;
  int chunk_ = 1024;
};

REGISTER_KERNEL_BUILDER(Name("HvdxQuantize").Device(::tensorflow::DEVICE_CPU), QuantizeOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HvdxDequantize").Device(::tensorflow::DEVICE_CPU), DequantizeOp<CPUDevice>);
#if GOOGLE_CUDA
// The GPU functors are explicitly specialized in quantize.cu.cc.
REGISTER_KERNEL_BUILDER(Name("HvdxQuantize").Device(::tensorflow::DEVICE_GPU), QuantizeOp<GPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HvdxDequantize").Device(::tensorflow::DEVICE_GPU), DequantizeOp<GPUDevice>);
#endif

}  // namespace hvdx
