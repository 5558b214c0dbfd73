// The OpKernels of HvdxSharedRead and HvdxSharedUpdate (csrc/ops/shared_model_ops.cc): check
// the inputs, allocate the outputs and call the CPU kernels of csrc/kernels/shared_model.{h,cc}.
#define EIGEN_USE_THREADS

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/shared_model.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using CPUDevice = Eigen::ThreadPoolDevice;

::absl::Status ParseMode(const std::string& name, bool allow_none, shared::Mode* mode) {
  if (name == "atomic") *mode = shared::Mode::kAtomic;
  else if (name == "block") *mode = shared::Mode::kBlock;
  else if (name == "whole") *mode = shared::Mode::kWhole;
  else if (name == "none" && allow_none) *mode = shared::Mode::kNone;
  else return errors::InvalidArgument("unknown shared model mode '", name, "'");
  return ::absl::OkStatus();
}

::absl::Status OpenInput(OpKernelContext* ctx, shared::View* view) {
  const Tensor& address = ctx->input(0);
  if (!TensorShapeUtils::IsScalar(address.shape())) {
    return errors::InvalidArgument("address must be a scalar, got shape ", address.shape().DebugString());
  }
  return shared::Open(static_cast<uint64_t>(address.scalar<int64_t>()()), view);
}

class SharedReadOp : public OpKernel {
 public:
  explicit SharedReadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    OP_REQUIRES_OK(ctx, ParseMode(mode, /*allow_none=*/true, &mode_));
    OP_REQUIRES(ctx, mode_ != shared::Mode::kAtomic,
                errors::InvalidArgument("a read is 'none', 'block' or 'whole', not 'atomic'"));
  }

  void Compute(OpKernelContext* ctx) override {
    shared::View view;
    OP_REQUIRES_OK(ctx, OpenInput(ctx, &view));
    Tensor* values = nullptr;
    Tensor* version = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(view.header->size)}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &version));
    const uint64_t v = shared::Read<CPUDevice>()(ctx->eigen_device<CPUDevice>(), view, mode_,
                                                 values->flat<float>().data());
    version->scalar<int64_t>()() = static_cast<int64_t>(v);
  }

 private:
  shared::Mode mode_;
};

class SharedUpdateOp : public OpKernel {
 public:
  explicit SharedUpdateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    OP_REQUIRES_OK(ctx, ParseMode(mode, /*allow_none=*/false, &mode_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("read_back", &read_back_));
  }

  void Compute(OpKernelContext* ctx) override {
    shared::View view;
    OP_REQUIRES_OK(ctx, OpenInput(ctx, &view));
    const Tensor& delta = ctx->input(1);
    const Tensor& offset = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(delta.shape()),
                errors::InvalidArgument("delta must be 1-D, got shape ", delta.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(offset.shape()),
                errors::InvalidArgument("offset must be a scalar, got shape ", offset.shape().DebugString()));
    const int64_t off = offset.scalar<int64_t>()();
    const int64_t m = delta.NumElements();
    const int64_t n = static_cast<int64_t>(view.header->size);
    OP_REQUIRES(ctx, off >= 0 && off + m <= n,
                errors::InvalidArgument("update [", off, ", ", off + m, ") is outside the shared model's ", n,
                                        " elements"));
    Tensor* version = nullptr;
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &version));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({read_back_ ? n : 0}), &values));
    const uint64_t v = shared::Update<CPUDevice>()(ctx->eigen_device<CPUDevice>(), view, mode_,
                                                   delta.flat<float>().data(), static_cast<uint64_t>(off),
                                                   static_cast<uint64_t>(m),
                                                   read_back_ ? values->flat<float>().data() : nullptr);
    version->scalar<int64_t>()() = static_cast<int64_t>(v);
  }

 private:
  shared::Mode mode_;
  bool read_back_;
};

// No CUDA kernels: the ops are registered for the CPU only, so TensorFlow places them there
// (a GPU variable is copied through the host).
REGISTER_KERNEL_BUILDER(Name("HvdxSharedRead").Device(::tensorflow::DEVICE_CPU), SharedReadOp);
REGISTER_KERNEL_BUILDER(Name("HvdxSharedUpdate").Device(::tensorflow::DEVICE_CPU), SharedUpdateOp);

}  // namespace
}  // namespace hvdx
