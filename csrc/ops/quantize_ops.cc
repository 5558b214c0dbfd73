// Registration and shape functions of HvdxQuantize / HvdxDequantize: the chunked low-bit codes
// of hvdx's wire (hvdx/comm/wire.py), in one pass.
#include "absl/status/status.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvdx {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvdxQuantize")
    .Input("x: float")
    .Output("packed: uint8")
    .Output("dequantized: float")
    .Attr("bits: int")
    .Attr("chunk: int")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &x));
      int bits = 0, chunk = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
      TF_RETURN_IF_ERROR(c->GetAttr("chunk", &chunk));
      const DimensionHandle n = c->Dim(x, 0);
      if (c->ValueKnown(n) && chunk > 0) {
        const int64_t values = c->Value(n);
        c->set_output(0, c->Vector(values * bits / 8 + 4 * (values / chunk)));
      } else {
        c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      }
      c->set_output(1, x);
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
Quantizes x chunk by chunk: s = max|x| / L (L = 2^(bits-1) - 1), q = clip(round(x / s), -L, L)
(0 where s is 0), half to even. packed: the codes (q as int8, or two (q + 8) nibbles to a
byte, the first in the high half) then the float32 scales' bytes; dequantized: q * s.
x: 1-D float32 whose length is a multiple of chunk.
)doc");

REGISTER_OP("HvdxDequantize")
    .Input("packed: uint8")
    .Output("values: float")
    .Attr("bits: int")
    .Attr("chunk: int")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle packed;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &packed));
      int bits = 0, chunk = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
      TF_RETURN_IF_ERROR(c->GetAttr("chunk", &chunk));
      const DimensionHandle bytes = c->Dim(packed, 0);
      const int64_t per_chunk = static_cast<int64_t>(chunk) * bits / 8 + 4;
      if (c->ValueKnown(bytes) && per_chunk > 4 && c->Value(bytes) % per_chunk == 0) {
        c->set_output(0, c->Vector(c->Value(bytes) / per_chunk * chunk));
      } else {
        c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      }
      return ::absl::OkStatus();
    })
    .Doc(R"doc(
The values of HvdxQuantize's packed bytes (with the same bits and chunk): q * s.
packed: 1-D uint8, chunk * bits / 8 + 4 bytes per chunk.
)doc");

}  // namespace hvdx
