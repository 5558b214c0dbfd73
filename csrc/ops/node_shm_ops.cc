// Registrations of the node-local shared-memory collectives (csrc/kernels/node_shm.h): an
// all-to-all with equal splits on every rank and an all-gather of per-rank row counts, over
// the ranks of one node, through a segment hvdx/node/shm_engine.py maps in each of them.
#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

#define HVDX_NODE_SHM_TYPES "T: {float, double, half, bfloat16, int32, int64, uint8, int8, int16, uint16, bool}"

REGISTER_OP("HvdxNodeAlltoall")
    .Input("tensor: T")
    .Input("splits: int64")
    .Output("received: T")
    .Attr(HVDX_NODE_SHM_TYPES)
    .Attr("address: int")
    .Attr("channel: int = 0")
    .Attr("rank: int")
    .Attr("collective_name: string")
    .Attr("timeout_s: float = 300")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle s;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &s));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &s));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
Node-local all-to-all through shared memory: slice j of `tensor` (splits[j] elements, the
same splits on every rank of the node) goes to local rank j; `received` holds every rank's
slice `rank`, in rank order (as hvd.alltoall over the node's process set).
address: the mapped segment (hvdx.node.shm_engine); channel: its communicator; rank: this
process's local rank; collective_name: checked against the other ranks' at each call.
)doc");

REGISTER_OP("HvdxNodeAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr(HVDX_NODE_SHM_TYPES)
    .Attr("address: int")
    .Attr("channel: int = 1")
    .Attr("rank: int")
    .Attr("collective_name: string")
    .Attr("timeout_s: float = 300")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle in = c->input(0);
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(in, 1, &in));
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
Node-local all-gather through shared memory: every rank's rows (dimension 0, counts may
differ per rank; the other dimensions the same), concatenated in rank order (as
hvd.allgather over the node's process set).
)doc");

#undef HVDX_NODE_SHM_TYPES

}  // namespace hvdx
