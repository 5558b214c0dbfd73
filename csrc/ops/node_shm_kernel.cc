// The OpKernels of HvdxNodeAlltoall and HvdxNodeAllgather (csrc/ops/node_shm_ops.cc): async
// kernels that check the inputs and hand the collective to the channel's worker thread
// (csrc/kernels/node_shm.h), so that a wait for the other ranks never holds TensorFlow's
// inter-op threads, and the node's collectives run in the order they were issued.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/node_shm.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

namespace hvdx {

namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;

class NodeCollectiveOp : public AsyncOpKernel {
 public:
  explicit NodeCollectiveOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    int64_t address = 0, channel = 0, rank = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("address", &address));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channel", &channel));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rank", &rank));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("collective_name", &name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout_s", &timeout_s_));
    OP_REQUIRES(ctx, address > 0 && channel >= 0 && rank >= 0,
                errors::InvalidArgument("node collective: bad address, channel or rank"));
    address_ = static_cast<uint64_t>(address);
    channel_ = static_cast<uint32_t>(channel);
    rank_ = static_cast<uint32_t>(rank);
  }

 protected:
  ::absl::Status OpenChannel(node_shm::Channel* channel) const {
    return node_shm::Open(address_, channel_, rank_, channel);
  }
  node_shm::Call BaseCall(const Tensor& input) const {
    node_shm::Call call;
    call.name = name_;
    call.dtype = static_cast<uint32_t>(input.dtype());
    call.element_bytes = static_cast<uint32_t>(::tensorflow::DataTypeSize(input.dtype()));
    call.input = static_cast<const char*>(input.tensor_data().data());
    call.timeout_s = timeout_s_;
    return call;
  }
  node_shm::Worker* worker() const { return node_shm::Worker::For(address_, channel_); }

  uint64_t address_ = 0;
  uint32_t channel_ = 0, rank_ = 0;
  std::string name_;
  float timeout_s_ = 300;
};

class NodeAlltoallOp : public NodeCollectiveOp {
 public:
  using NodeCollectiveOp::NodeCollectiveOp;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    node_shm::Channel channel;
    OP_REQUIRES_OK_ASYNC(ctx, OpenChannel(&channel), done);
    OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsVector(input.shape()),
                      errors::InvalidArgument("node_alltoall '", name_, "' takes a 1-D tensor, got shape ",
                                              input.shape().DebugString()), done);
    OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsVector(splits.shape()) && splits.NumElements() == channel.size,
                      errors::InvalidArgument("node_alltoall '", name_, "' needs one split per local rank (",
                                              channel.size, "), got shape ", splits.shape().DebugString()),
                      done);
    auto s = splits.flat<int64_t>();
    std::vector<uint64_t> sizes(channel.size);
    for (uint32_t j = 0; j < channel.size; ++j) {
      OP_REQUIRES_ASYNC(ctx, s(j) >= 0, errors::InvalidArgument("node_alltoall '", name_, "': negative split"), done);
      sizes[j] = static_cast<uint64_t>(s(j));
    }
    node_shm::Call call = BaseCall(input);
    call.kind = node_shm::kAllToAll;
    call.elements = static_cast<uint64_t>(input.NumElements());
    worker()->Enqueue([ctx, done, channel, call, sizes = std::move(sizes)]() mutable {
      call.splits = sizes.data();
      Tensor* output = nullptr;
      ::absl::Status status = node_shm::Run(&channel, call, [&](uint64_t elements, ::absl::Status* st) {
        *st = ctx->allocate_output(0, TensorShape({static_cast<int64_t>(elements)}), &output);
        return st->ok() ? const_cast<char*>(output->tensor_data().data()) : nullptr;
      });
      ctx->SetStatus(status);
      done();
    });
  }
};

class NodeAllgatherOp : public NodeCollectiveOp {
 public:
  using NodeCollectiveOp::NodeCollectiveOp;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    node_shm::Channel channel;
    OP_REQUIRES_OK_ASYNC(ctx, OpenChannel(&channel), done);
    OP_REQUIRES_ASYNC(ctx, input.dims() >= 1,
                      errors::InvalidArgument("node_allgather '", name_, "' takes a tensor of rank >= 1"), done);
    TensorShape row = input.shape();
    row.RemoveDim(0);
    node_shm::Call call = BaseCall(input);
    call.kind = node_shm::kAllGather;
    call.rows = static_cast<uint64_t>(input.dim_size(0));
    call.row_elements = static_cast<uint64_t>(row.num_elements());
    worker()->Enqueue([ctx, done, channel, call, row]() mutable {
      Tensor* output = nullptr;
      ::absl::Status status = node_shm::Run(&channel, call, [&](uint64_t elements, ::absl::Status* st) {
        TensorShape shape = row;
        shape.InsertDim(0, static_cast<int64_t>(elements));  // rows
        *st = ctx->allocate_output(0, shape, &output);
        return st->ok() ? const_cast<char*>(output->tensor_data().data()) : nullptr;
      });
      ctx->SetStatus(status);
      done();
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("HvdxNodeAlltoall").Device(::tensorflow::DEVICE_CPU), NodeAlltoallOp);
REGISTER_KERNEL_BUILDER(Name("HvdxNodeAllgather").Device(::tensorflow::DEVICE_CPU), NodeAllgatherOp);

}  // namespace
}  // namespace hvdx
