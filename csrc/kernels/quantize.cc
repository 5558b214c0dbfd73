// CPU kernels of HvdxQuantize / HvdxDequantize (the OpKernels are csrc/ops/quantize_kernel.cc;
// this file builds without TensorFlow too, for the harness in csrc/harness).
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

// Products and quotients are rounded as written: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace hvdx {
namespace functor {
namespace {

float Level(int bits) { return static_cast<float>((1 << (bits - 1)) - 1); }

// 1.5 * 2^23: (v + kMagic) - kMagic is v rounded half to even for |v| < 2^22 (the default
// rounding mode), without a libm call, so the loops vectorize on baseline x86-64.
constexpr float kMagic = 12582912.0f;

// The scale of one chunk: max |x| / level; NaN where a value is NaN (inf where one is inf).
// |x|'s bits compared as integers: for non-negative floats their order is the values', NaNs
// above +inf.
float ChunkScale(const float* x, int chunk, float level) {
  uint32_t high = 0;
  for (int i = 0; i < chunk; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits &= 0x7fffffffu;
    high = bits > high ? bits : high;
  }
  if (high > 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  float value;
  std::memcpy(&value, &high, sizeof(value));
  return value / level;
}

// Chunks [lo, hi): q into a buffer, a block at a time, then the codes and the decoded values.
void QuantizeChunks(const float* x, int bits, int chunk, uint8_t* codes, uint8_t* scales, float* dequantized,
                    int64_t lo, int64_t hi) {
  const float level = Level(bits);
  constexpr int kBlock = 1024;
  alignas(64) float q[kBlock];
  for (int64_t c = lo; c < hi; ++c) {
    const float* xc = x + c * chunk;
    float* dc = dequantized + c * chunk;
    const float s = ChunkScale(xc, chunk, level);
    std::memcpy(scales + 4 * c, &s, sizeof(float));
    const bool zero = s == 0.0f || !std::isfinite(s);
    for (int b = 0; b < chunk; b += kBlock) {
      const int m = std::min(kBlock, chunk - b);
      const float* xb = xc + b;
      if (zero) {
        for (int i = 0; i < m; ++i) q[i] = 0.0f;
      } else {
        for (int i = 0; i < m; ++i) {
          const float v = xb[i] / s;  // |v| <= level (1 + 2^-23): rounds to at most level
          q[i] = std::min(std::max(std::copysign((v + kMagic) - kMagic, v), -level), level);
        }
      }
      float* db = dc + b;
      for (int i = 0; i < m; ++i) db[i] = q[i] * s;
      if (bits == 8) {
        uint8_t* out = codes + c * chunk + b;
        for (int i = 0; i < m; ++i) out[i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q[i])));
      } else {
        uint8_t* out = codes + (c * chunk + b) / 2;
        for (int i = 0; i < m / 2; ++i) {
          out[i] = static_cast<uint8_t>(static_cast<int>(q[2 * i] + 8.0f) * 16 + static_cast<int>(q[2 * i + 1] + 8.0f));
        }
      }
    }
  }
}

void DequantizeChunks(const uint8_t* codes, const uint8_t* scales, int bits, int chunk, float* out, int64_t lo,
                      int64_t hi) {
  for (int64_t c = lo; c < hi; ++c) {
    float s;
    std::memcpy(&s, scales + 4 * c, sizeof(float));
    float* oc = out + c * chunk;
    if (bits == 8) {
      const uint8_t* in = codes + c * chunk;
      for (int i = 0; i < chunk; ++i) oc[i] = static_cast<float>(static_cast<int8_t>(in[i])) * s;
    } else {
      const uint8_t* in = codes + c * chunk / 2;
      for (int i = 0; i < chunk; i += 2) {
        oc[i] = (static_cast<float>(in[i / 2] >> 4) - 8.0f) * s;
        oc[i + 1] = (static_cast<float>(in[i / 2] & 15) - 8.0f) * s;
      }
    }
  }
}

}  // namespace

template <>
Status Quantize<CpuDevice>::operator()(const CpuDevice& d, const float* x, int64_t n, int bits, int chunk,
                                       uint8_t* packed, float* dequantized) {
  HVDX_RETURN_IF_ERROR(CheckQuantized(n, bits, chunk));
  if (n == 0) return OkStatus();
  uint8_t* scales = packed + n * bits / 8;
  const OpCost cost(chunk * 4.0, chunk * (4.0 + bits / 8.0) + 4.0, chunk * 12.0);
  d.parallelFor(n / chunk, cost, [&](Index lo, Index hi) {
    QuantizeChunks(x, bits, chunk, packed, scales, dequantized, lo, hi);
  });
  return OkStatus();
}

template <>
Status Dequantize<CpuDevice>::operator()(const CpuDevice& d, const uint8_t* packed, int64_t n, int bits, int chunk,
                                         float* out) {
  HVDX_RETURN_IF_ERROR(CheckQuantized(n, bits, chunk));
  if (n == 0) return OkStatus();
  const uint8_t* scales = packed + n * bits / 8;
  const OpCost cost(chunk * bits / 8.0 + 4.0, chunk * 4.0, chunk * 2.0);
  d.parallelFor(n / chunk, cost, [&](Index lo, Index hi) { DequantizeChunks(packed, scales, bits, chunk, out, lo, hi); });
  return OkStatus();
}

}  // namespace functor
}  // namespace hvdx
