// The OpKernel of HvdxErrorFeedback, shared by CPU and GPU: checks the inputs, forwards or
// allocates the outputs, and calls the functor of csrc/kernels/error_feedback.{h,cc,cu.cc}.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <cstdint>

#include "kernels/error_feedback.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {

using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShapeUtils;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

template <typename Device>
class ErrorFeedbackOp : public OpKernel {
 public:
  explicit ErrorFeedbackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    const int count = grads.size();
    OP_REQUIRES(ctx, count >= 1 && count <= functor::GradientList::kMax,
                errors::InvalidArgument("HvdxErrorFeedback takes 1 to ", functor::GradientList::kMax,
                                        " gradients, got ", count, " (hvdx.ops.error_feedback sums longer lists first)"));
    const Tensor& residual = ctx->input(count);
    const Tensor& velocity = ctx->input(count + 1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(residual.shape()),
                errors::InvalidArgument("residual must be 1-D, got shape ", residual.shape().DebugString()));
    const int64_t n = residual.NumElements();
    functor::GradientList list;
    list.count = count;
    for (int j = 0; j < count; ++j) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(grads[j].shape()) && grads[j].NumElements() == n,
                  errors::InvalidArgument("grads[", j, "] has shape ", grads[j].shape().DebugString(),
                                          ", the residual ", residual.shape().DebugString(), ": they must be equal"));
      list.data[j] = grads[j].flat<float>().data();
    }
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(velocity.shape()) &&
                         (velocity.NumElements() == 0 || velocity.NumElements() == n),
                errors::InvalidArgument("velocity must be empty or have the residual's ", n, " elements, got shape ",
                                        velocity.shape().DebugString()));
    const bool has_velocity = velocity.NumElements() == n && n > 0;
    Tensor* accumulated = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, residual.shape(), &accumulated));
    Tensor* velocity_out = nullptr;
    if (has_velocity) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({count + 1}, 1, velocity.shape(), &velocity_out));
    } else {
      ctx->set_output(1, velocity);
    }
    OP_REQUIRES_OK(ctx, functor::ErrorFeedback<Device>()(
                            ctx->eigen_device<Device>(), list, residual.flat<float>().data(),
                            has_velocity ? velocity.flat<float>().data() : nullptr, momentum_, decay_,
                            accumulated->flat<float>().data(),
                            has_velocity ? velocity_out->flat<float>().data() : nullptr, n));
  }

 private:
  float momentum_ = 0.0f;
  float decay_ = 1.0f;
};

REGISTER_KERNEL_BUILDER(Name("HvdxErrorFeedback").Device(::tensorflow::DEVICE_CPU), ErrorFeedbackOp<CPUDevice>);
#if GOOGLE_CUDA
// The GPU functor is explicitly specialized in error_feedback.cu.cc.
REGISTER_KERNEL_BUILDER(Name("HvdxErrorFeedback").Device(::tensorflow::DEVICE_GPU), ErrorFeedbackOp<GPUDevice>);
#endif

}  // namespace hvdx
