// Registration and shape function of HvdxMstopk (shi2021, Algorithm 1).
#include "absl/status/status.h"
#include "kernels/status.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// values / indices: [min(k, d)] where k and d are known; thresholds: [2].
::absl::Status MstopkShape(InferenceContext* c) {
  ShapeHandle x, k;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &k));
  DimensionHandle selected = c->UnknownDim();
  const ::tensorflow::Tensor* k_value = c->input_tensor(1);
  const DimensionHandle d = c->Dim(x, 0);
  if (k_value != nullptr && c->ValueKnown(d)) {
    const int64_t kk = k_value->scalar<int64_t>()();
    if (kk < 0) return errors::InvalidArgument("mstopk: k must be >= 0, got ", kk);
    selected = c->MakeDim(std::min<int64_t>(kk, c->Value(d)));
  }
  c->set_output(0, c->Vector(selected));
  c->set_output(1, c->Vector(selected));
  c->set_output(2, c->Vector(2));
  return ::absl::OkStatus();
}

REGISTER_OP("HvdxMstopk")
    .Input("x: T")
    .Input("k: int64")
    .Output("values: T")
    .Output("indices: Tidx")
    .Output("thresholds: float64")
    .Attr("T: {half, bfloat16, float}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .Attr("num_samplings: int >= 1 = 30")
    .Attr("seed: int = 0")
    .Attr("seed2: int = 0")
    .SetIsStateful()  // draws the band window's offset from a per-kernel generator
    .SetShapeFn(MstopkShape)
    .Doc(R"doc(
MSTopK: exactly min(k, len(x)) elements of large magnitude, by bisection on a threshold.

values, indices: the selected elements: every one with |x| >= thresholds[0] in index order,
then a contiguous window, at a random offset, of those with thresholds[1] <= |x| < thresholds[0].
NaN and Inf rank above every finite value. tests/mstopk_reference.py is the specification.
)doc");

REGISTER_OP("HvdxStatelessMstopk")
    .Input("x: T")
    .Input("k: int64")
    .Input("seed: int64")
    .Output("values: T")
    .Output("indices: Tidx")
    .Output("thresholds: float64")
    .Attr("T: {half, bfloat16, float}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .Attr("num_samplings: int >= 1 = 30")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle seed;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &seed));
      DimensionHandle pair;
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(seed, 0), 2, &pair));
      return MstopkShape(c);
    })
    .Doc(R"doc(
HvdxMstopk whose window offset is a pure function of `seed` ([2] int64): the same inputs
select the same elements, whatever ran before (what a resumed run needs to continue exactly).
)doc");

}  // namespace hvdx
