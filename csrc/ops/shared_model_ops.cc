// Registrations of the shared model ops: one node's float32 model in a shared-memory segment
// (hvdx/asynchronous/shared.py), read and updated concurrently by the node's processes
// (gimpel2010 Algorithm 1; kungurtsev2021 Algorithm 1, ASSM and PASSM).
#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvdxSharedRead")
    .Input("address: int64")
    .Output("values: float")
    .Output("version: int64")
    .Attr("mode: {'none', 'block', 'whole'} = 'none'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle address;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &address));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Scalar());
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
values = the shared model; version = the number of updates applied to it before the copy.

mode 'none' copies without locks (an inconsistent read, kungurtsev2021 sec. 2: blocks may
come from different versions), 'block' each block under its lock, 'whole' under the lock on
the whole vector.
address: the segment's address in this process (SharedModel.address).
)doc");

REGISTER_OP("HvdxSharedUpdate")
    .Input("address: int64")
    .Input("delta: float")
    .Input("offset: int64")
    .Output("version: int64")
    .Output("values: float")
    .Attr("mode: {'atomic', 'block', 'whole'} = 'atomic'")
    .Attr("read_back: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle s;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &s));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &s));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &s));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
shared[offset, offset + len(delta)) += delta; version = the updates applied before this one.

Every element is added by a word-sized atomic fetch-and-add (a compare-and-swap loop), so no
concurrent update is lost whatever the mode; 'block' also holds each touched block's lock
while writing it (ASSM), 'whole' the lock on the whole vector (gimpel2010 Algorithm 1).
values: with read_back, the whole model right after this update (under the whole lock in
'whole' mode), else empty.
)doc");

}  // namespace hvdx
