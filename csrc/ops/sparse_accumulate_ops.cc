// Registration and shape function of HvdxSparseAccumulate (shi2021, Alg. 2 line 9: the
// receivers add the gathered top-k values of every node into one dense vector).
#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvdxSparseAccumulate")
    .Input("values: T")
    .Input("indices: Tidx")
    .Input("dense: Tout")
    .Output("output: Tout")
    .Attr("T: {half, bfloat16, float}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .Attr("Tout: {half, bfloat16, float}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle values, indices, dense;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      TF_RETURN_IF_ERROR(c->Merge(values, indices, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &dense));
      c->set_output(0, dense);
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
output = dense + sum of values[j] at indices[j] (duplicate indices add up).

Sums are formed in float32 whatever T and Tout are, and rounded to Tout once.
values: 1-D, the sparse entries.
indices: 1-D, same length as values, each in [0, len(dense)).
dense: 1-D, the vector added onto; its buffer is reused for output when possible.
)doc");

REGISTER_OP("HvdxSparseScatter")
    .Input("values: T")
    .Input("indices: Tidx")
    .Input("size: int64")
    .Output("output: Tout")
    .Attr("T: {half, bfloat16, float}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .Attr("Tout: {half, bfloat16, float}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle values, indices, size;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      TF_RETURN_IF_ERROR(c->Merge(values, indices, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &size));
      ::tensorflow::shape_inference::DimensionHandle dim;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &dim));
      c->set_output(0, c->Vector(dim));
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
output = zeros(size) + sum of values[j] at indices[j]: HvdxSparseAccumulate onto zeros,
without materializing them first.
)doc");

}  // namespace hvdx
