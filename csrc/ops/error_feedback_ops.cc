// Registration and shape function of HvdxErrorFeedback: what top-k selects from, with error
// feedback and DGC's momentum correction (Lin et al. 2018, sec. 3.2), in one pass.
#include "absl/status/status.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvdxErrorFeedback")
    .Input("grads: N * float")
    .Input("residual: float")
    .Input("velocity: float")
    .Output("accumulated: float")
    .Output("velocity_out: float")
    .Attr("N: int >= 1")
    .Attr("momentum: float = 0.0")
    .Attr("decay: float = 1.0")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() - 2;
      ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &shape));
      for (int j = 1; j <= n; ++j) TF_RETURN_IF_ERROR(c->Merge(shape, c->input(j), &shape));
      ShapeHandle velocity;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n + 1), 1, &velocity));
      c->set_output(0, shape);
      c->set_output(1, velocity);
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
Error feedback's accumulation, one pass: with g = grads[0] + grads[1] + ... (in order),
u = momentum * velocity + g and accumulated = decay * residual + u, velocity_out = u when
velocity has the grads' length (momentum correction); accumulated = decay * residual + g
and velocity_out = velocity when velocity is empty (shape [0]). float32, rounded as written.
grads: 1-D, this step's gradients (e.g. a node's parts after its reduce-scatter), same length.
residual: 1-D, what earlier steps did not send.
velocity: 1-D, DGC's local velocity, or empty for plain error feedback.
)doc");

}  // namespace hvdx
