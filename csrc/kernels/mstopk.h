// MSTopK (shi2021, Algorithm 1): approximate top-k by bisection on a threshold ratio.
// Shared by the CPU (mstopk.cc) and CUDA (mstopk.cu.cc) kernels. The semantics, with the
// fixes to Algorithm 1's edge cases, are specified by tests/mstopk_reference.py.
#ifndef HVDX_KERNELS_MSTOPK_H_
#define HVDX_KERNELS_MSTOPK_H_

#include <cmath>
#include <cstdint>

#include "kernels/device.h"
#include "kernels/status.h"

#if defined(__CUDACC__)
#define HVDX_HOST_DEVICE __host__ __device__
#else
#define HVDX_HOST_DEVICE
#endif

namespace hvdx {
namespace mstopk {

// Algorithm 1, lines 4-24, one round at a time: the caller counts nnz(|x| >= Threshold())
// however it likes (one pass per round, or many rounds from one histogram) and reports it.
// Thresholds are computed in float64 as mean + ratio * (max - mean) with plain adds and
// multiplies, so every implementation gets bit-identical thresholds for the same stats.
struct Bisection {
  double mean = 0, span = 0;  // span = max - mean >= 0
  double lo = 0.0, hi = 1.0;  // the ratio interval [l, r]
  int64_t k = 0, k1 = 0, k2 = 0;
  double thres1 = HUGE_VAL, thres2 = 0.0;  // thres1 = +inf while no round qualified
  bool has_thres1 = false, has_thres2 = false;

  Bisection() = default;
  HVDX_HOST_DEVICE Bisection(double mean_, double max_, int64_t k_, int64_t d)
      : mean(mean_), span(max_ - mean_), k(k_), k2(d), thres1(HUGE_VAL) {}

  HVDX_HOST_DEVICE double Ratio() const { return lo + (hi - lo) / 2; }
  HVDX_HOST_DEVICE double ThresholdAt(double ratio) const { return Add(mean, Mul(ratio, span)); }
  HVDX_HOST_DEVICE double Threshold() const { return ThresholdAt(Ratio()); }

  // Lines 10-23 for the current round, given nnz = count(|x| >= Threshold()).
  HVDX_HOST_DEVICE void Update(int64_t nnz) {
    const double ratio = Ratio(), thres = ThresholdAt(ratio);
    if (nnz <= k) {
      hi = ratio;
      if (nnz > k1) { k1 = nnz; thres1 = thres; has_thres1 = true; }
    } else {
      lo = ratio;
      if (nnz < k2) { k2 = nnz; thres2 = thres; has_thres2 = true; }
    }
  }

 private:
  // No fused multiply-add: the thresholds must equal the reference's bit for bit.
#if defined(__CUDA_ARCH__)
  __device__ static double Add(double a, double b) { return __dadd_rn(a, b); }
  __device__ static double Mul(double a, double b) { return __dmul_rn(a, b); }
#else
  static double Add(double a, double b) { volatile double s = a + b; return s; }
  static double Mul(double a, double b) { volatile double p = a * b; return p; }
#endif
};

// The smallest float f with f >= t, so that for every float a: a >= t  <=>  a >= f.
HVDX_HOST_DEVICE inline float FloatCeil(double t) {
  if (!(t <= 3.4028234663852886e38)) return INFINITY;
  float f = static_cast<float>(t);
  if (static_cast<double>(f) < t) f = nextafterf(f, INFINITY);
  return f;
}

// Where a window of `need` elements starts among `count`: uniform over 0..count-need
// (multiply-shift of a 64-bit random word; the bias is below 2^-40 for any real size).
HVDX_HOST_DEVICE inline int64_t WindowOffset(uint64_t random, int64_t count, int64_t need) {
  const uint64_t starts = static_cast<uint64_t>(count - need) + 1;
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(__umul64hi(random, starts));
#else
  return static_cast<int64_t>((static_cast<unsigned __int128>(random) * starts) >> 64);
#endif
}

// Algorithm 1's selection of exactly k (lines 25-31, with its ties): every one of the k1
// elements above thres1 (|x| >= f1) in index order, then a window of k - k1 consecutive band
// elements (f2 <= |x| < f1, ranked in index order) placed by a random word; if more than k
// are above (only non-finite magnitudes can be), a window of k of the above set instead.
struct Window {
  bool above_is_band;  // more than k above: the window is taken from the above set
  int64_t k1, need, offset;

  // The window for k1 elements above and `band` in the band.
  HVDX_HOST_DEVICE static Window Place(int64_t k1, int64_t band, int64_t k, uint64_t random) {
    Window w;
    w.above_is_band = k1 > k;
    w.k1 = k1;
    w.need = w.above_is_band ? k : k - k1;
    w.offset = w.need > 0 ? WindowOffset(random, w.above_is_band ? k1 : band, w.need) : 0;
    return w;
  }
  // The output position of the element of rank `rank` (in index order) among the above set
  // (`above`) or the band; -1 if it is not selected.
  HVDX_HOST_DEVICE int64_t Slot(bool above, int64_t rank) const {
    const bool in_window = rank >= offset && rank < offset + need;
    if (above) return !above_is_band ? rank : (in_window ? rank - offset : -1);
    return !above_is_band && in_window ? k1 + rank - offset : -1;
  }
};

// Blocks of the fixed-order sum of |x| (see BlockStats in mstopk.cc): kSumBlock elements
// in kSumLanes interleaved float32 lanes, folded in float64. The CUDA kernel does the same.
constexpr int64_t kSumBlock = 4096;
constexpr int kSumLanes = 16;

// The block sums are added pairwise, level by level (s[i] = s[2i] + s[2i+1], an odd last
// element carried up), which is the same as a binary tree over the sums padded with zeros
// to a power of two: aligned groups of 2^j sums are subtrees, so the GPU reduces them in
// parallel and gets the same bits. Overwrites s.
inline double PairwiseSum(double* s, int64_t n) {
  if (n == 0) return 0.0;
  while (n > 1) {
    for (int64_t i = 0; i < n / 2; ++i) s[i] = s[2 * i] + s[2 * i + 1];
    if (n % 2) s[n / 2] = s[n - 1];
    n = (n + 1) / 2;
  }
  return s[0];
}

// Device-side state of the CUDA kernel, at the start of its scratch buffer.
struct GpuState {
  Bisection bis;
  unsigned long long nonfinite;
  unsigned int max_bits;
  Window window;
};

}  // namespace mstopk

namespace functor {

// Selects exactly min(k, d) of the d elements of x: writes values, indices (above set in
// index order, then the band window; everything in index order when k >= d) and
// thresholds[2] = {thres1, thres2}. `random` is a uniform 64-bit word that places the
// window. `scratch` holds ScratchBytes(d) bytes (the GPU's; the CPU needs none). A failed
// CUDA launch or call is returned, never left as uninitialised outputs.
template <typename Device, typename T, typename Tidx>
struct MsTopK {
  static int64_t ScratchBytes(int64_t d);
  Status operator()(const Device& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                    uint64_t random, T* values, Tidx* indices, double* thresholds, void* scratch);
};

}  // namespace functor
}  // namespace hvdx

#endif  // HVDX_KERNELS_MSTOPK_H_
