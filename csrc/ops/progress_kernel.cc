// The OpKernel of HvdxProgressMark (csrc/ops/progress_ops.cc): forwards its inputs and records
// the mark in the progress table of csrc/kernels/progress.{h,cc}. The same kernel on the CPU
// and the GPU: it never touches the tensors' data.
#include <string>

#include "kernels/progress.h"
#include "kernels/status.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvdx {

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;

class ProgressMarkOp : public OpKernel {
 public:
  explicit ProgressMarkOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string label, detail, phase;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("detail", &detail));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("phase", &phase));
    OP_REQUIRES(ctx, progress::ParsePhase(phase, &phase_),
                errors::InvalidArgument("unknown progress phase '", phase, "'"));
    counter_ = progress::Find(label, detail);
  }

  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < ctx->num_outputs(); ++i) ctx->set_output(i, ctx->input(i));
    progress::Record(counter_, phase_);
  }

  bool IsExpensive() override { return false; }  // run inline, on the thread that made the inputs

 private:
  progress::Counter* counter_ = nullptr;
  progress::Phase phase_ = progress::Phase::kEnter;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("HvdxProgressMark").Device(::tensorflow::DEVICE_CPU), ProgressMarkOp);
#if GOOGLE_CUDA
REGISTER_KERNEL_BUILDER(Name("HvdxProgressMark").Device(::tensorflow::DEVICE_GPU).HostMemory("token"), ProgressMarkOp);
#endif

}  // namespace hvdx
