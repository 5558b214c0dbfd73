// The OpKernels of HvdxMstopk and HvdxStatelessMstopk (shi2021, Algorithm 1): check the
// inputs, allocate the outputs and the GPU's scratch, draw the window's random word (from a
// per-kernel generator, or as a pure function of the `seed` input) and call the functor of
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

// SplitMix64's finaliser: a bijective mix of a 64-bit word.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The stateless op's random word: a pure function of its seed pair (as tf.random.stateless_*).
inline uint64_t StatelessWord(int64_t seed0, int64_t seed1) {
  return Mix64(Mix64(static_cast<uint64_t>(seed0) + 0x9e3779b97f4a7c15ULL) ^ static_cast<uint64_t>(seed1));
}

template <typename Device, typename T, typename Tidx, bool kStateless>
class MsTopKOp : public OpKernel {
 public:
  explicit MsTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_samplings", &num_samplings_));
    if (kStateless) return;
    int64_t seed, seed2;
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
    const int64_t k_requested = k_tensor.scalar<int64_t>()();
    OP_REQUIRES(ctx, k_requested >= 0, errors::InvalidArgument("mstopk: k must be >= 0, got ", k_requested));
    OP_REQUIRES(ctx, (std::is_same_v<Tidx, int64_t> || d <= std::numeric_limits<int32_t>::max()),
                errors::InvalidArgument("mstopk: int32 indices cannot address ", d, " elements; use int64"));
    const int64_t k = std::min(k_requested, d);
    Tensor *values, *indices, *thresholds;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({2}), &thresholds));
    uint64_t random;
    if (kStateless) {
      const Tensor& seed = ctx->input(2);
      OP_REQUIRES(ctx, seed.dims() == 1 && seed.NumElements() == 2,
                  errors::InvalidArgument("stateless_mstopk: seed must have shape [2], got ",
                                          seed.shape().DebugString()));
      const auto pair = seed.flat<int64_t>();
      random = StatelessWord(pair(0), pair(1));
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      random = rng_();
    }
    using Functor = functor::MsTopK<Device, T, Tidx>;
    void* scratch_ptr = nullptr;
    Tensor scratch;
    const int64_t scratch_bytes = Functor::ScratchBytes(d);
    if (scratch_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8, TensorShape({scratch_bytes}), &scratch));
      scratch_ptr = scratch.flat<int8_t>().data();
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
                          MsTopKOp<DEVICE, T, TIDX, false>);                            \
  REGISTER_KERNEL_BUILDER(Name("HvdxStatelessMstopk")                                   \
                              .Device(::tensorflow::DEVICE_##DEV)                       \
                              .HostMemory("k")                                          \
                              .HostMemory("seed")                                       \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<TIDX>("Tidx"),                            \
                          MsTopKOp<DEVICE, T, TIDX, true>);
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
