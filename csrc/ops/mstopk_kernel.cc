// The OpKernel of HvdxMstopk (shi2021, Algorithm 1): checks the inputs, allocates the
// outputs and the GPU's scratch, draws the window's random word and calls the functor of
// csrc/kernels/mstopk.{h,cc,cu.cc} on the CPU or the GPU.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <type_traits>

#include "kernels/mstopk.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {

using CPUDevice = Eigen::ThreadPoolDevice;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace errors = ::tensorflow::errors;

template <typename Device, typename T, typename Tidx>
class MsTopKOp : public OpKernel {
 public:
  explicit MsTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_samplings", &num_samplings_));
    ::tensorflow::int64 seed, seed2;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed2", &seed2));
    if (seed == 0 && seed2 == 0) {
      std::random_device device;
      rng_.seed((static_cast<uint64_t>(device()) << 32) ^ device());
    } else {
      std::seed_seq seq{static_cast<uint64_t>(seed), static_cast<uint64_t>(seed2)};
      rng_.seed(seq);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& k_tensor = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(x.shape()),
                errors::InvalidArgument("mstopk: x must be 1-D, got shape ", x.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(k_tensor.shape()),
                errors::InvalidArgument("mstopk: k must be a scalar, got shape ", k_tensor.shape().DebugString()));
    const int64_t d = x.NumElements();
    const int64_t k_requested = k_tensor.scalar<::tensorflow::int64>()();
    OP_REQUIRES(ctx, k_requested >= 0, errors::InvalidArgument("mstopk: k must be >= 0, got ", k_requested));
    OP_REQUIRES(ctx, (std::is_same_v<Tidx, int64_t> || d <= std::numeric_limits<int32_t>::max()),
                errors::InvalidArgument("mstopk: int32 indices cannot address ", d, " elements; use int64"));
    const int64_t k = std::min(k_requested, d);
    Tensor *values, *indices, *thresholds;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({2}), &thresholds));
    uint64_t random;
    {
      std::lock_guard<std::mutex> lock(mu_);
      random = rng_();
    }
    using Functor = functor::MsTopK<Device, T, Tidx>;
    void* scratch_ptr = nullptr;
    Tensor scratch;
    const int64_t scratch_bytes = Functor::ScratchBytes(d);
    if (scratch_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8, TensorShape({scratch_bytes}), &scratch));
      scratch_ptr = scratch.flat<::tensorflow::int8>().data();
    }
    OP_REQUIRES_OK(ctx, Functor()(ctx->eigen_device<Device>(), x.flat<T>().data(), d, k, num_samplings_, random,
                                  values->flat<T>().data(), indices->flat<Tidx>().data(),
                                  thresholds->flat<double>().data(), scratch_ptr));
  }

 private:
  int num_samplings_;
  std::mutex mu_;
  std::mt19937_64 rng_;
};

#define HVDX_REGISTER_MSTOPK(DEV, DEVICE, T, TIDX)                                        \
  REGISTER_KERNEL_BUILDER(Name("HvdxMstopk")                                            \
                              .Device(::tensorflow::DEVICE_##DEV)                       \
                              .HostMemory("k")                                          \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<TIDX>("Tidx"),                            \
                          MsTopKOp<DEVICE, T, TIDX>);
#define HVDX_REGISTER_MSTOPK_ALL(DEV, DEVICE)                        \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, float, int32_t)                  \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, float, int64_t)                  \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::half, int32_t)            \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::half, int64_t)            \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::bfloat16, int32_t)        \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::bfloat16, int64_t)

HVDX_REGISTER_MSTOPK_ALL(CPU, CPUDevice)
#if GOOGLE_CUDA
HVDX_REGISTER_MSTOPK_ALL(GPU, Eigen::GpuDevice)
#endif

}  // namespace hvdx
