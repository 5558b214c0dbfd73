// Registration of HvdxProgressMark: the watchdog's mark on a collective call's tensors
// (csrc/kernels/progress.h, hvdx/progress.py).
#include "absl/status/status.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("HvdxProgressMark")
    .Input("inputs: T")
    .Input("token: int32")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    .Attr("label: string")
    .Attr("detail: string = ''")
    .Attr("phase: {'enter', 'leave', 'begin', 'end'}")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
outputs = inputs (the same buffers), once all of them exist; counts `phase` of the counter
(label, detail): 'enter' before a collective call, 'leave' after it (hvdx's watchdog);
'begin' / 'end' count nothing and bound a span of the timeline (hvdx/timeline.py). Every mark
is recorded with its time while the timeline records (hvdx_timeline_record).

Not stateful on purpose: a stateful op without resource inputs is ordered after every other
one of the function (automatic control dependencies), which would serialize the buckets'
collectives. It runs because its outputs are used in place of its inputs. token: any int32
scalar that is not a constant (in a graph, the read of a variable), so that constant folding
never runs the mark once, ahead of time, when the inputs are constants; ignored.
)doc");

}  // namespace hvdx
