// CUDA kernels of HvdxQuantize / HvdxDequantize (kernels/quantize.h): a block per chunk for
// the codes (the chunk's max |x| reduced in the block, then each thread a pair of values),
// a thread per value to decode. Every quotient and product is rounded as written (__fdiv_rn,
// __fmul_rn, rintf: round half to even), so the bytes and values equal the CPU kernel's bit
// for bit. The scales follow the codes at any byte offset: they are written and read a byte
// at a time.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gpu_launch.h"
#include "kernels/quantize.h"

namespace hvdx {
namespace functor {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxBlocks = 65535LL * 8;

__device__ __forceinline__ uint32_t AbsBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The chunk's largest |x| as bits (its order is the values' for non-negative floats, NaNs
// above +inf), reduced over the block; every thread gets it.
__device__ uint32_t BlockMaxAbsBits(const float* xc, int chunk, uint32_t* warp_max) {
  uint32_t high = 0;
  for (int i = threadIdx.x; i < chunk; i += blockDim.x) high = max(high, AbsBits(xc[i]));
  for (int offset = kWarp / 2; offset > 0; offset /= 2) high = max(high, __shfl_xor_sync(0xffffffffu, high, offset));
  const int warp = threadIdx.x / kWarp;
  if (threadIdx.x % kWarp == 0) warp_max[warp] = high;
  __syncthreads();
  high = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) high = max(high, warp_max[w]);
  __syncthreads();  // warp_max is written again for the next chunk
  return high;
}

// q of one value (kernels/quantize.h): clip(round_half_even(x / s), -level, level), 0 where
// the chunk's scale is 0 or not finite.
__device__ __forceinline__ float Code(float x, float s, float level, bool zero) {
  if (zero) return 0.0f;
  return fminf(fmaxf(rintf(__fdiv_rn(x, s)), -level), level);
}

__global__ void QuantizeKernel(const float* x, int64_t chunks, int chunk, int bits, uint8_t* codes, uint8_t* scales,
                               float* dequantized) {
  __shared__ uint32_t warp_max[kMaxThreads / kWarp];
  const float level = static_cast<float>((1 << (bits - 1)) - 1);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const float* xc = x + c * chunk;
    const uint32_t high = BlockMaxAbsBits(xc, chunk, warp_max);
    const float s = high > 0x7f800000u ? __uint_as_float(0x7fc00000u) : __fdiv_rn(__uint_as_float(high), level);
    const bool zero = s == 0.0f || !isfinite(s);
    if (threadIdx.x < 4) scales[4 * c + threadIdx.x] = static_cast<uint8_t>(__float_as_uint(s) >> (8 * threadIdx.x));
    float* dc = dequantized + c * chunk;
    for (int j = threadIdx.x; j < chunk / 2; j += blockDim.x) {
      const float q0 = Code(xc[2 * j], s, level, zero);
      const float q1 = Code(xc[2 * j + 1], s, level, zero);
      dc[2 * j] = __fmul_rn(q0, s);
      dc[2 * j + 1] = __fmul_rn(q1, s);
      if (bits == 8) {
        uint8_t* out = codes + c * chunk + 2 * j;
        out[0] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q0)));
        out[1] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q1)));
      } else {
        codes[c * chunk / 2 + j] = static_cast<uint8_t>((static_cast<int>(q0) + 8) * 16 + static_cast<int>(q1) + 8);
      }
    }
  }
}

__global__ void DequantizeKernel(const uint8_t* codes, const uint8_t* scales, int64_t n, int chunk, int bits,
                                 float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t* sb = scales + 4 * (i / chunk);
    const float s = __uint_as_float(static_cast<uint32_t>(sb[0]) | static_cast<uint32_t>(sb[1]) << 8 |
                                    static_cast<uint32_t>(sb[2]) << 16 | static_cast<uint32_t>(sb[3]) << 24);
    float q;
    if (bits == 8) {
      q = static_cast<float>(static_cast<int8_t>(codes[i]));
    } else {
      const uint8_t byte = codes[i / 2];
      q = __fsub_rn(static_cast<float>(i % 2 == 0 ? byte >> 4 : byte & 15), 8.0f);
    }
    out[i] = __fmul_rn(q, s);
  }
}

}  // namespace

template <>
Status Quantize<GpuDevice>::operator()(const GpuDevice& d, const float* x, int64_t n, int bits, int chunk,
                                       uint8_t* packed, float* dequantized) {
  HVDX_RETURN_IF_ERROR(CheckQuantized(n, bits, chunk));
  if (n == 0) return OkStatus();
  const int64_t chunks = n / chunk;
  // Threads: one per pair of the chunk's values, whole warps, at most kMaxThreads.
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (chunk / 2 + kWarp - 1) / kWarp * kWarp));
  const int blocks = static_cast<int>(std::min<int64_t>(chunks, kMaxBlocks));
  return Launch("QuantizeKernel", QuantizeKernel, dim3(blocks), dim3(threads), 0, d.stream(), x, chunks, chunk, bits,
                packed, packed + n * bits / 8, dequantized);
}

template <>
Status Dequantize<GpuDevice>::operator()(const GpuDevice& d, const uint8_t* packed, int64_t n, int bits, int chunk,
                                         float* out) {
  HVDX_RETURN_IF_ERROR(CheckQuantized(n, bits, chunk));
  if (n == 0) return OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((n + kMaxThreads - 1) / kMaxThreads, kMaxBlocks));
  return Launch("DequantizeKernel", DequantizeKernel, dim3(blocks), dim3(kMaxThreads), 0, d.stream(), packed,
                packed + n * bits / 8, n, chunk, bits, out);
}

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
