// Functors of HvdxQuantize / HvdxDequantize: the chunked low-bit codes of hvdx's wire
// (hvdx/comm/wire.py `quantize` / `dequantize`; LowBit, top-k values as codes, streaming
// DiLoCo's outer gradients), one pass over the values where TensorFlow's element-wise ops
// take about ten. CPU: quantize.cc; CUDA: quantize.cu.cc (the same bytes; the same values,
// a NaN's payload aside).
#ifndef HVDX_KERNELS_QUANTIZE_H_
#define HVDX_KERNELS_QUANTIZE_H_

#include <cstdint>

#include "kernels/device.h"
#include "kernels/status.h"

namespace hvdx {
namespace functor {

// The bytes of n values quantized to `bits` (8 or 4) with a float32 scale per `chunk` of them:
// the codes (n bytes, or n / 2), then the scales' bytes in the host's order.
inline int64_t QuantizedBytes(int64_t n, int bits, int chunk) { return n * bits / 8 + 4 * (n / chunk); }

// The checks both functors share: bits 8 or 4, chunk >= 2 and even, n a multiple of chunk.
inline Status CheckQuantized(int64_t n, int bits, int chunk) {
  if (bits != 8 && bits != 4) return errors::InvalidArgument("bits must be 8 or 4, got ", bits);
  if (chunk < 2 || chunk % 2 != 0) return errors::InvalidArgument("chunk must be an even number >= 2, got ", chunk);
  if (n < 0 || n % chunk != 0) {
    return errors::InvalidArgument("the number of values, ", n, ", must be a multiple of chunk = ", chunk);
  }
  return OkStatus();
}

// For each chunk c of x (n values, n a multiple of chunk), with L = 2^(bits-1) - 1:
//   s = max |x_i| / L                      (NaN if the chunk holds a NaN; inf if an inf)
//   q_i = clip(round_half_even(x_i / s), -L, L)   (0 where s == 0 or s is not finite)
//   dequantized_i = q_i * s                (what the receiver decodes; its -0.0 decodes as 0.0)
//   codes: q_i as int8 (8 bits), or (q_2j + 8) * 16 + (q_2j+1 + 8) a byte (4 bits)
// packed = the codes, then the scales' bytes (QuantizedBytes(n) in all). Every product and
// quotient is float32, rounded as written: the same bits as hvdx/comm/wire.py's TensorFlow
// form for finite x; a non-finite chunk decodes to NaN everywhere (which NaN is the device's).
// Denormals are values like any other, unless the thread flushes them to zero (TensorFlow's
// CPU threads do: a chunk of denormals then has s = 0 and codes 0).
template <typename Device>
struct Quantize {
  Status operator()(const Device& d, const float* x, int64_t n, int bits, int chunk, uint8_t* packed,
                    float* dequantized);
};

// The n values of Quantize's packed bytes: q_i * s.
template <typename Device>
struct Dequantize {
  Status operator()(const Device& d, const uint8_t* packed, int64_t n, int bits, int chunk, float* out);
};

}  // namespace functor
}  // namespace hvdx

#endif  // HVDX_KERNELS_QUANTIZE_H_
