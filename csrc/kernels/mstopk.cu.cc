// CUDA kernel of HvdxMstopk (shi2021, Algorithm 1), same semantics as the CPU kernel.
//
// Everything stays on the device; the host only enqueues kernels on the stream it is given
// (TensorFlow's, or the harness's: csrc/harness), and checks every launch (kernels/gpu_launch.h).
// x is read 4 times for N = 30 (once for the statistics, once per 15 rounds, once to select):
//   stats   one thread per (sum block, lane): the fixed-order sum of BlockStats (mstopk.cc),
//           max and non-finite count; the 16 lanes of a block folded in order in shared
//           memory; the block sums added pairwise by a parallel tree (mstopk::PairwiseSum's
//           order), 512 per thread block and level;
//   rounds  up to 15 rounds of the bisection per pass over x: the next m rounds can only
//           visit the 2^m - 1 ratios lo + j (hi - lo) / 2^m (dyadic, exact in float64), so
//           one pass histograms which of their thresholds f[j] each element reaches (2^m
//           bins in shared memory; the bin from the element's distance to f[1] in float,
//           checked against the exact thresholds where the float estimate is within its
//           error bound of a boundary), and one thread block then runs the m rounds of
//           Bisection::Update on those exact counts (suffix sums of the bins). The same
//           counts as one pass per round, so the same bits;
//   select  the bisection's own counts give the size of the above set (k1, or the
//           non-finite count when no round qualified) and of the band (k2 - that), so the
//           window is placed before x is read again; one pass then writes every selected
//           element in index order: per tile of 16,384 ranks from warp ballots, chained
//           across tiles by a decoupled look-back (tiles taken in launch order by a counter).
//           For d >= 2^31 the counts do not fit the look-back's packed word: two passes
//           (count per tile, device-wide scans, write) instead; -DHVDX_MSTOPK_TWO_PASS_SELECT
//           takes them at every d (scripts/gpu_harness.sh checks that build too).
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <type_traits>

#include "kernels/gpu_launch.h"
#include "kernels/mstopk.h"

namespace hvdx {
namespace functor {
namespace {

using mstopk::GpuState;
using mstopk::kSumBlock;
using mstopk::kSumLanes;

constexpr int kThreads = 256;
constexpr int kTree = 2 * kThreads;               // block sums added per thread block and level
constexpr int kMaxRounds = 15;                    // bisection rounds counted per pass over x (at most)
constexpr int kMaxBins = 1 << kMaxRounds;         // histogram bins: thresholds 1 .. 2^m - 1 (0: below all)
constexpr int kCountThreads = 1024;               // threads of CountHist and ApplyHist
constexpr int64_t kOnePassLimit = INT32_MAX;      // d below this: the one-pass select
static_assert(kThreads % kSumLanes == 0, "a thread block holds whole sum blocks");

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ inline float Mag(float v) {
  const float a = fabsf(v);
  return a <= FLT_MAX ? a : INFINITY;
}

inline int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }
inline int64_t Chunks(int64_t d) { return (d + kSumBlock - 1) / kSumBlock; }

// The float estimate of an element's bin (see CountHist): bin ~ (a - base) * inv_width,
// certain when its fractional part is within [eps, 1 - eps] (eps >= 0.5: never certain).
struct BinGuess {
  float base, inv_width, eps;
};

// Scratch layout, in 256-byte aligned pieces.
struct Scratch {
  GpuState* st;
  BinGuess* guess;
  unsigned int* tile_counter;
  double *block_sums, *tree;
  unsigned long long* tile_status;   // one per chunk (one-pass select)
  int64_t *above, *band, *above_start, *band_start;  // per chunk (two-pass select)
  float* thresholds_f;               // kMaxBins thresholds of the current pass
  unsigned long long* bin_counts;    // kMaxBins counts
  void* scan;
  size_t scan_bytes;
};

size_t ScanBytes(int64_t chunks) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                static_cast<int>(chunks));
  return bytes;
}

Scratch Layout(void* base, int64_t d) {
  const int64_t chunks = Chunks(d);
  char* p = static_cast<char*>(base);
  Scratch s;
  s.st = reinterpret_cast<GpuState*>(p);
  p += Align(sizeof(GpuState));
  s.guess = reinterpret_cast<BinGuess*>(p);
  p += Align(sizeof(BinGuess));
  s.tile_counter = reinterpret_cast<unsigned int*>(p);
  p += Align(sizeof(unsigned int));
  s.block_sums = reinterpret_cast<double*>(p);
  p += Align(chunks * 8);
  s.tree = reinterpret_cast<double*>(p);
  p += Align(((chunks + kTree - 1) / kTree) * 8);
  s.tile_status = reinterpret_cast<unsigned long long*>(p);
  p += Align(chunks * 8);
  int64_t** counts[] = {&s.above, &s.band, &s.above_start, &s.band_start};
  for (int64_t** c : counts) {
    *c = reinterpret_cast<int64_t*>(p);
    p += Align(chunks * 8);
  }
  s.thresholds_f = reinterpret_cast<float*>(p);
  p += Align(kMaxBins * 4);
  s.bin_counts = reinterpret_cast<unsigned long long*>(p);
  p += Align(kMaxBins * 8);
  s.scan = p;
  s.scan_bytes = ScanBytes(chunks);
  return s;
}

int64_t LayoutBytes(int64_t d) {
  const int64_t chunks = Chunks(d);
  return Align(sizeof(GpuState)) + Align(sizeof(BinGuess)) + Align(sizeof(unsigned int)) + Align(chunks * 8) +
         Align(((chunks + kTree - 1) / kTree) * 8) + Align(chunks * 8) + 4 * Align(chunks * 8) + Align(kMaxBins * 4) +
         Align(kMaxBins * 8) + Align(static_cast<int64_t>(ScanBytes(chunks)));
}

// The state reset, the select's chunk statuses zeroed and its chunk counter reset.
__global__ void Prepare(GpuState* st, unsigned long long* tile_status, int64_t chunks, unsigned int* tile_counter) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t == 0) {
    st->max_bits = 0;
    st->nonfinite = 0;
    *tile_counter = 0;
  }
  for (int64_t i = t; i < chunks; i += static_cast<int64_t>(gridDim.x) * blockDim.x) tile_status[i] = 0;
}

// One thread per (sum block, lane); the lanes of each sum block are folded in order.
template <typename T>
__global__ void LaneStats(const T* x, int64_t d, int64_t lanes, double* block_sums, GpuState* st) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  float sum = 0;
  float max = 0;
  unsigned long long bad = 0;
  if (t < lanes) {
    const int64_t block = t / kSumLanes, start = block * kSumBlock;
    const int64_t end = min(d, start + kSumBlock);
#pragma unroll 8
    for (int64_t i = start + t % kSumLanes; i < end; i += kSumLanes) {
      const float a = fabsf(static_cast<float>(x[i]));
      const bool finite = a <= FLT_MAX;
      const float m = finite ? a : 0.0f;
      sum = __fadd_rn(sum, m);
      max = fmaxf(max, m);
      bad += finite ? 0 : 1;
    }
  }
  __shared__ double lane_sums[kThreads];
  lane_sums[threadIdx.x] = static_cast<double>(sum);
  using ReduceF = cub::BlockReduce<float, kThreads>;
  using ReduceU = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename ReduceF::TempStorage tf;
  __shared__ typename ReduceU::TempStorage tu;
  const float block_max = ReduceF(tf).Reduce(max, MaxOp());
  const unsigned long long block_bad = ReduceU(tu).Sum(bad);
  __syncthreads();
  if (t < lanes && t % kSumLanes == 0) {
    double folded = 0;
    for (int l = 0; l < kSumLanes; ++l) folded = __dadd_rn(folded, lane_sums[threadIdx.x + l]);
    block_sums[t / kSumLanes] = folded;
  }
  if (threadIdx.x == 0) {
    atomicMax(&st->max_bits, __float_as_uint(block_max));  // non-negative floats order as uints
    atomicAdd(&st->nonfinite, block_bad);
  }
}

// One level of mstopk::PairwiseSum for kTree sums per thread block: out[b] = the pairwise
// tree of in[b * kTree, (b + 1) * kTree), missing sums being zeros (x + 0 = x exactly).
__global__ void PairwiseLevel(const double* in, int64_t n, double* out) {
  __shared__ double s[kTree];
  const int64_t base = blockIdx.x * static_cast<int64_t>(kTree);
  for (int j = threadIdx.x; j < kTree; j += blockDim.x) s[j] = base + j < n ? in[base + j] : 0.0;
  __syncthreads();
  for (int width = kTree; width > 1; width /= 2) {
    double v = 0;
    const int half = width / 2;
    if (threadIdx.x < half) v = __dadd_rn(s[2 * threadIdx.x], s[2 * threadIdx.x + 1]);
    __syncthreads();
    if (threadIdx.x < half) s[threadIdx.x] = v;
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

__device__ inline mstopk::Bisection StartBisection(const double* sum, int64_t d, int64_t k, const GpuState* st) {
  const double max = static_cast<double>(__uint_as_float(st->max_bits));
  const int64_t finite = d - static_cast<int64_t>(st->nonfinite);
  const double mean = finite > 0 ? fmin(__ddiv_rn(*sum, static_cast<double>(finite)), max) : 0.0;
  return mstopk::Bisection(mean, max, k, d);
}

// The thresholds of the next m rounds: f[j] = FloatCeil(ThresholdAt(lo + j (hi - lo) / 2^m))
// for j = 1 .. 2^m - 1, non-decreasing in j; their counts zeroed; the bin estimate. On the
// first pass (sum != nullptr) the bisection starts from the statistics (Algorithm 1, lines
// 1-3): every thread computes the same state, thread 0 stores it.
__global__ void PlanPass(GpuState* st, const double* sum, int64_t d, int64_t k, int m, float* f,
                         unsigned long long* counts, BinGuess* guess) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = 1 << m;
  const mstopk::Bisection bis = sum != nullptr ? StartBisection(sum, d, k, st) : st->bis;
  if (j < n) counts[j] = 0;
  const double step = (bis.hi - bis.lo) / n;  // a power of two: exact, as is lo + j * step
  if (j >= 1 && j < n) f[j] = mstopk::FloatCeil(bis.ThresholdAt(bis.lo + j * step));
  if (j == 0) {
    if (sum != nullptr) st->bis = bis;
    // |estimate - true bin| <= (3 ulp(the largest threshold) + the float products' 2^-23
    // relative error) in bins; width = step * span.
    const double width = step * bis.span;
    const double top = fabs(bis.ThresholdAt(bis.hi)) + fabs(bis.ThresholdAt(bis.lo));
    const double ulp = fmax(top * 1.1920928955078125e-07, 1.4012984643248171e-45);
    double eps = width > 0 ? 3 * ulp / width + n * 2.384185791015625e-07 + 1e-6 : 1.0;
    guess->base = static_cast<float>(bis.ThresholdAt(bis.lo));
    guess->inv_width = width > 0 ? static_cast<float>(1.0 / width) : 0.0f;
    guess->eps = static_cast<float>(fmin(eps, 1.0));
  }
}

// The largest b in [1, n - 2] with f[b] <= a, given f[1] <= a < f[n - 1] (f non-decreasing).
__device__ inline int SearchBin(const float* f, int n, float a, int hint) {
  hint = min(max(hint, 1), n - 2);
  if (f[hint] <= a && a < __ldg(f + hint + 1)) return hint;
  int lo = 1, hi = n - 1;  // f[lo] <= a < f[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(f + mid) <= a) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Calls fn(magnitude) for this thread's elements of x (grid-stride; float x 16-byte aligned:
// float4 loads, four in flight per thread). The order does not matter to integer counts.
template <typename T, typename Fn>
__device__ inline void ForEachMagnitude(const T* x, int64_t d, Fn fn) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t tail = 0;
  if constexpr (std::is_same<T, float>::value) {
    if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
      const float4* x4 = reinterpret_cast<const float4*>(x);
      const int64_t d4 = d / 4;
      int64_t i = tid;
      constexpr int kU = 4;
      for (; i + (kU - 1) * stride < d4; i += kU * stride) {
        float4 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) v[u] = __ldcs(x4 + i + u * stride);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          fn(Mag(v[u].x));
          fn(Mag(v[u].y));
          fn(Mag(v[u].z));
          fn(Mag(v[u].w));
        }
      }
      for (; i < d4; i += stride) {
        const float4 v = __ldcs(x4 + i);
        fn(Mag(v.x));
        fn(Mag(v.y));
        fn(Mag(v.z));
        fn(Mag(v.w));
      }
      tail = 4 * d4;
    }
  }
#pragma unroll 4
  for (int64_t i = tail + tid; i < d; i += stride) fn(Mag(static_cast<float>(x[i])));
}

// counts[b] += the number of elements that reach exactly b of the thresholds f[1 .. n - 1]
// (b >= 1; b = 0, below every threshold, is not counted): a histogram of n bins per thread
// block in shared memory, added into counts at the end (nonzero bins only, each block
// starting at its own bin). Integer sums: any order gives the same counts.
template <typename T>
__global__ void __launch_bounds__(kCountThreads) CountHist(const T* x, int64_t d, int m, const float* f,
                                                           const BinGuess* guess, unsigned long long* counts) {
  extern __shared__ unsigned int hist[];
  const int n = 1 << m;
  for (int j = threadIdx.x; j < n; j += blockDim.x) hist[j] = 0;
  const float lowest = f[1], highest = f[n - 1];
  const BinGuess g = *guess;
  const bool estimate = g.eps < 0.5f;
  __syncthreads();
  ForEachMagnitude(x, d, [&](float a) {
    if (!(a >= lowest)) return;  // below every threshold (and the padding's -1)
    int b = n - 1;
    if (a < highest) {
      const float e = (a - g.base) * g.inv_width;
      const int whole = static_cast<int>(fminf(fmaxf(e, 0.0f), static_cast<float>(n)));
      const float frac = e - static_cast<float>(whole);
      if (estimate && whole >= 1 && whole <= n - 2 && frac >= g.eps && frac <= 1.0f - g.eps) b = whole;
      else b = SearchBin(f, n, a, whole);
    }
    atomicAdd(&hist[b], 1u);
  });
  __syncthreads();
  const int first = static_cast<int>((static_cast<int64_t>(blockIdx.x) * n) / gridDim.x);
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const int j = (first + t) % n;
    const unsigned int c = hist[j];
    if (c > 0) atomicAdd(&counts[j], static_cast<unsigned long long>(c));
  }
}

// One thread block of kCountThreads: the m rounds of Algorithm 1 (lines 10-23) on the
// counts of CountHist, count(|x| >= f[j]) being the suffix sum of counts[b] for b >= j.
// The bins are cut into segments of 32 whose sums (one coalesced warp load each) are
// suffix-scanned block-wide into shared memory; the rounds then run in warp 0 (every lane
// the same updates): while j is a multiple of 32 the count is a segment suffix; after that
// the interval lies inside one segment, whose bins the warp loads once. Round r's ratio is
// lo + j * step. On the last pass the selection's window is placed (Algorithm 1, lines
// 25-31) from the bisection's own counts, and the thresholds are written.
__global__ void __launch_bounds__(kCountThreads) ApplyHist(GpuState* st, int m, const unsigned long long* counts,
                                                           bool last, int64_t k, uint64_t random, double* thresholds) {
  constexpr int per = 32;  // bins per segment: a warp's coalesced load
  const int n = 1 << m;
  const int segments = (n + per - 1) / per;  // at most kCountThreads
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  __shared__ unsigned long long seg_sum[kCountThreads];
  __shared__ unsigned long long seg_suffix[kCountThreads + 1];
  // Warp w sums segments w * 32 .. w * 32 + 31, one coalesced load of 32 bins each.
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    const int sg = warp * 32 + i;
    const int b = sg * per + lane;
    unsigned long long v = sg < segments && b >= 1 && b < n ? counts[b] : 0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if (lane == 0) seg_sum[sg] = v;
  }
  __syncthreads();
  // Thread i scans segment kCountThreads - 1 - i: inclusive sums are suffix sums.
  using Scan = cub::BlockScan<unsigned long long, kCountThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int seg = kCountThreads - 1 - t;
  unsigned long long inclusive;
  Scan(temp).InclusiveSum(seg_sum[seg], inclusive);
  seg_suffix[seg] = inclusive;  // the sum of segments seg .. kCountThreads - 1
  if (t == 0) seg_suffix[kCountThreads] = 0;
  __syncthreads();
  if (t >= 32) return;
  mstopk::Bisection bis = st->bis;
  const double lo = bis.lo, step = (bis.hi - bis.lo) / n;
  int loaded = -1;              // the segment whose bins the lanes hold
  unsigned long long bin = 0;   // lane's bin of that segment
  for (int r = 0; r < m; ++r) {
    const int j = static_cast<int>((bis.Ratio() - lo) / step);  // exact: 1 .. n - 1
    const int s = j / per;
    unsigned long long c = seg_suffix[s];
    if (j % per != 0) {
      if (s != loaded) {
        bin = s * per + lane < n ? counts[s * per + lane] : 0;
        loaded = s;
      }
      unsigned long long part = s * per + lane >= j ? bin : 0;
      for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(0xFFFFFFFFu, part, o);
      c = seg_suffix[s + 1] + part;
    }
    bis.Update(static_cast<int64_t>(c));
  }
  if (lane != 0) return;
  st->bis = bis;
  if (last) {
    // count(|x| >= f1) is k1 when a round qualified, else the non-finite count (f1 = inf);
    // count(|x| >= f2) is k2 (d when no round did: f2 = 0).
    const int64_t above = bis.has_thres1 ? bis.k1 : static_cast<int64_t>(st->nonfinite);
    st->window = mstopk::Window::Place(above, bis.k2 - above, k, random);
    thresholds[0] = bis.thres1;
    thresholds[1] = bis.thres2;
  }
}

// The one-pass select's chunk status: a flag (2 bits) and the counts of the above set and
// the band (31 bits each) of the chunk alone (kAggregate) or of chunks 0 .. it (kInclusive).
constexpr unsigned long long kAggregate = 1ull << 62, kInclusive = 2ull << 62, kFlags = 3ull << 62;
constexpr int kBandBits = 31;

__device__ inline unsigned long long LoadStatus(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
__device__ inline void StoreStatus(unsigned long long* p, unsigned long long v) {
  __threadfence();
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

// Warp 0: the counts of chunks 0 .. chunk - 1 (packed), by looking back over the chunks'
// statuses (decoupled look-back); publishes this chunk's aggregate first, its inclusive
// counts last. Chunks before this one were taken earlier, so they are running or done.
__device__ unsigned long long LookBack(unsigned long long* status, int64_t chunk, unsigned long long aggregate) {
  const int lane = threadIdx.x % 32;
  if (chunk == 0) {
    if (lane == 0) StoreStatus(&status[0], kInclusive | aggregate);
    return 0;
  }
  if (lane == 0) StoreStatus(&status[chunk], kAggregate | aggregate);
  unsigned long long exclusive = 0;
  for (int64_t top = chunk - 1;; top -= 32) {
    const int64_t p = top - lane;
    unsigned long long s = kInclusive;  // before chunk 0: nothing
    if (p >= 0) {
      do {
        s = LoadStatus(&status[p]);
      } while ((s & kFlags) == 0);
    }
    const unsigned inclusive = __ballot_sync(0xFFFFFFFFu, (s & kFlags) == kInclusive);
    const int stop = inclusive ? __ffs(inclusive) - 1 : 31;  // the nearest inclusive one ends the sum
    unsigned long long v = lane <= stop ? (s & ~kFlags) : 0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    exclusive += v;
    if (inclusive) break;
  }
  if (lane == 0) StoreStatus(&status[chunk], kInclusive | (exclusive + aggregate));
  __threadfence();
  return exclusive;
}

constexpr int kSelectWarps = 8;                     // warps of SelectTile
constexpr int kSelectRows = 16;                     // rows of 128 elements (4 per lane) per warp
constexpr int64_t kSelectTile = kSelectWarps * kSelectRows * 128;  // elements per thread block

// SelectTile holds float elements themselves in registers (and writes the selected ones from
// there: a reload from x, evicted by the streaming loads, stalls each row on memory latency);
// other types as magnitudes (their values are reloaded: a float holds neither a double nor,
// bit for bit, every NaN of a half).
template <typename T>
constexpr bool kHoldsValues = std::is_same<T, float>::value;

// 4 consecutive elements of a row from element i on: the values (kHoldsValues; past d: 0, see
// SelectTile's `valid`) or their magnitudes (past d: -1, never selected).
template <typename T>
__device__ inline void LoadRow(const T* x, int64_t d, int64_t i, bool vector, float (&v)[4]) {
  if constexpr (kHoldsValues<T>) {
    if (vector) {
      const float4 q = __ldcs(reinterpret_cast<const float4*>(x + i));
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
      return;
    }
    for (int c = 0; c < 4; ++c) v[c] = i + c < d ? x[i + c] : 0.0f;
  } else {
    for (int c = 0; c < 4; ++c) v[c] = i + c < d ? Mag(static_cast<float>(x[i + c])) : -1.0f;
  }
}

// How SelectTile finds where its tile's selected elements go.
enum SelectMode : int {
  kLookBack = 0,  // one pass: the prefix of earlier tiles by decoupled look-back (d < 2^31)
  kCountOnly = 1, // first of two passes: the tile's counts
  kWriteScanned = 2,  // second of two passes: the prefix from the scanned counts
};

// The select over a tile of kSelectTile elements per thread block, each warp a contiguous
// part of it in rows of 128 (lane l holds elements 4l .. 4l + 3 of a row, so index order is
// row, lane, element). Ranks come from warp ballots; the warps' counts are scanned in shared
// memory; the tile's prefix (counts of the above set and the band before it) by look-back
// over earlier tiles (taken in launch order by a counter) or from the scanned counts of a
// first pass; then every selected element is written.
template <typename T, typename Tidx, int kMode>
__global__ void __launch_bounds__(kSelectWarps * 32) SelectTile(const T* x, int64_t d, const GpuState* st,
                                                              unsigned long long* status, unsigned int* tile_counter,
                                                              int64_t* above, int64_t* band, T* values,
                                                              Tidx* indices) {
  __shared__ unsigned int s_tile;
  __shared__ int64_t s_prefix_a, s_prefix_b;
  __shared__ int warp_a[kSelectWarps], warp_b[kSelectWarps];
  if (kMode == kLookBack) {
    if (threadIdx.x == 0) s_tile = atomicAdd(tile_counter, 1u);
    __syncthreads();
  }
  const int64_t tile = kMode == kLookBack ? static_cast<int64_t>(s_tile) : static_cast<int64_t>(blockIdx.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = tile * kSelectTile + warp * int64_t{kSelectRows * 128} + 4 * lane;
  bool vector = false;
  if constexpr (std::is_same<T, float>::value)
    vector = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (tile + 1) * kSelectTile <= d;
  float v[kSelectRows][4];  // LoadRow: values or magnitudes
#pragma unroll
  for (int r = 0; r < kSelectRows; ++r) LoadRow(x, d, base + r * 128, vector, v[r]);
  const bool full = (tile + 1) * kSelectTile <= d;
  const int64_t left = d - base;  // this lane's element r * 128 + c exists when below `left`
  // The magnitude of element (r, c); past d: -1, neither above nor in the band (f2 >= 0).
  auto mag = [&](int r, int c) -> float {
    if constexpr (kHoldsValues<T>) return full || r * 128 + c < left ? Mag(v[r][c]) : -1.0f;
    else return v[r][c];
  };
  const float f1 = mstopk::FloatCeil(st->bis.thres1), f2 = mstopk::FloatCeil(st->bis.thres2);
  // Above: |x| >= f1; band: f2 <= |x| < f1.
  int na = 0, nb = 0;
#pragma unroll
  for (int r = 0; r < kSelectRows; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float a = mag(r, c);
      na += a >= f1;
      nb += a >= f2 && a < f1;
    }
  for (int o = 16; o > 0; o /= 2) {
    na += __shfl_xor_sync(0xFFFFFFFFu, na, o);
    nb += __shfl_xor_sync(0xFFFFFFFFu, nb, o);
  }
  if (lane == 0) warp_a[warp] = na, warp_b[warp] = nb;
  if (kMode == kWriteScanned) {
    if (threadIdx.x == 0) {
      s_prefix_a = above[tile];
      s_prefix_b = band[tile];
    }
  } else {
    __syncthreads();
    if (kMode == kCountOnly) {
      if (threadIdx.x == 0) {
        int64_t ta = 0, tb = 0;
        for (int w = 0; w < kSelectWarps; ++w) ta += warp_a[w], tb += warp_b[w];
        above[tile] = ta;
        band[tile] = tb;
      }
      return;
    }
    if (warp == 0) {
      unsigned long long ta = 0, tb = 0;
      for (int w = 0; w < kSelectWarps; ++w) ta += warp_a[w], tb += warp_b[w];
      const unsigned long long prefix = LookBack(status, tile, (ta << kBandBits) | tb);
      if (lane == 0) {
        s_prefix_a = static_cast<int64_t>(prefix >> kBandBits);
        s_prefix_b = static_cast<int64_t>(prefix & ((1ull << kBandBits) - 1));
      }
    }
  }
  __syncthreads();
  int64_t rank_a = s_prefix_a, rank_b = s_prefix_b;
  for (int w = 0; w < warp; ++w) rank_a += warp_a[w], rank_b += warp_b[w];
  const mstopk::Window window = st->window;
  const unsigned before = (1u << lane) - 1u;  // lanes before this one
#pragma unroll
  for (int r = 0; r < kSelectRows; ++r) {
    unsigned ba[4], bb[4], any = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float a = mag(r, c);
      ba[c] = __ballot_sync(0xFFFFFFFFu, a >= f1);
      bb[c] = __ballot_sync(0xFFFFFFFFu, a >= f2 && a < f1);
      any |= ba[c] | bb[c];
    }
    if (any == 0) continue;  // the same for the whole warp
    int64_t my_a = rank_a, my_b = rank_b;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      my_a += __popc(ba[c] & before);
      my_b += __popc(bb[c] & before);
      rank_a += __popc(ba[c]);
      rank_b += __popc(bb[c]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int64_t pos = -1;
      if ((ba[c] >> lane) & 1u) pos = window.Slot(true, my_a++);
      else if ((bb[c] >> lane) & 1u) pos = window.Slot(false, my_b++);
      if (pos >= 0) {
        const int64_t i = base + r * 128 + c;
        indices[pos] = static_cast<Tidx>(i);
        if constexpr (kHoldsValues<T>) values[pos] = v[r][c];
        else values[pos] = x[i];
      }
    }
  }
}

template <typename T, typename Tidx>
__global__ void SelectAll(const T* x, int64_t d, T* values, Tidx* indices, double* thresholds) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < d;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    indices[i] = static_cast<Tidx>(i);
    values[i] = x[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    thresholds[0] = HUGE_VAL;
    thresholds[1] = 0.0;
  }
}

inline int GridFor(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)));
}

// What this device allows CountHist: the most rounds per pass (2^m bins of shared memory)
// and its grid (one thread block per multiprocessor: the bins take its shared memory).
struct CountPlan {
  int max_rounds, sms;
};

Status PlanCount(CountPlan* plan) {
  int device = 0, optin = 0, sms = 0;
  HVDX_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  HVDX_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                            "cudaDeviceGetAttribute");
  HVDX_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                            "cudaDeviceGetAttribute");
  int m = kMaxRounds;
  while (m > 8 && (4 << m) > optin) --m;
  plan->max_rounds = m;
  plan->sms = std::max(1, sms);
  return OkStatus();
}

}  // namespace

template <typename T, typename Tidx>
struct MsTopK<GpuDevice, T, Tidx> {
  static int64_t ScratchBytes(int64_t d) { return LayoutBytes(d); }

  Status operator()(const GpuDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                    uint64_t random, T* values, Tidx* indices, double* thresholds, void* scratch) {
    cudaStream_t stream = dev.stream();
    if (k >= d || k == 0) {  // everything in index order (nothing when d == 0), or nothing
      return Launch("SelectAll", SelectAll<T, Tidx>, GridFor(k), kThreads, 0, stream, x, k, values, indices,
                    thresholds);
    }
    const int64_t chunks = Chunks(d), lanes = chunks * kSumLanes;
    if (chunks > INT32_MAX) return errors::InvalidArgument("mstopk: x is too large for the GPU kernel");
    CountPlan plan;
    HVDX_RETURN_IF_ERROR(PlanCount(&plan));
    Scratch s = Layout(scratch, d);
    HVDX_RETURN_IF_ERROR(Launch("Prepare", Prepare, GridFor(chunks), kThreads, 0, stream, s.st, s.tile_status, chunks,
                              s.tile_counter));
    HVDX_RETURN_IF_ERROR(Launch("LaneStats", LaneStats<T>, static_cast<int>((lanes + kThreads - 1) / kThreads),
                              kThreads, 0, stream, x, d, lanes, s.block_sums, s.st));
    double *in = s.block_sums, *out = s.tree;
    for (int64_t n = chunks; n > 1; n = (n + kTree - 1) / kTree) {
      HVDX_RETURN_IF_ERROR(Launch("PairwiseLevel", PairwiseLevel, static_cast<int>((n + kTree - 1) / kTree), kThreads,
                                0, stream, in, n, out));
      std::swap(in, out);
    }
    const int64_t per_block = int64_t{kCountThreads} * 16;  // elements worth a thread block
    const int count_grid =
        static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(plan.sms, (d + per_block - 1) / per_block)));
    const int rounds = std::max(num_samplings, 0);
    for (int done = 0; done < rounds;) {
      const int m = std::min(plan.max_rounds, rounds - done);
      const int n = 1 << m;
      const bool first = done == 0;
      done += m;
      HVDX_RETURN_IF_ERROR(Launch("PlanPass", PlanPass, (n + kThreads - 1) / kThreads, kThreads, 0, stream, s.st,
                                first ? in : static_cast<const double*>(nullptr), d, k, m, s.thresholds_f,
                                s.bin_counts, s.guess));
      const size_t shared = static_cast<size_t>(n) * sizeof(unsigned int);
      HVDX_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(CountHist<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(shared)),
                                "cudaFuncSetAttribute");
      HVDX_RETURN_IF_ERROR(Launch("CountHist", CountHist<T>, count_grid, kCountThreads, shared, stream, x, d, m,
                                s.thresholds_f, s.guess, s.bin_counts));
      HVDX_RETURN_IF_ERROR(Launch("ApplyHist", ApplyHist, 1, kCountThreads, 0, stream, s.st, m, s.bin_counts,
                                done >= rounds, k, random, thresholds));
    }
    if (rounds == 0) {  // no round: the statistics alone, and the window from them
      HVDX_RETURN_IF_ERROR(Launch("PlanPass", PlanPass, 1, kThreads, 0, stream, s.st, in, d, k, 1, s.thresholds_f,
                                s.bin_counts, s.guess));
      HVDX_RETURN_IF_ERROR(Launch("ApplyHist", ApplyHist, 1, kCountThreads, 0, stream, s.st, 0, s.bin_counts, true, k,
                                random, thresholds));
    }
    const int tiles = static_cast<int>((d + kSelectTile - 1) / kSelectTile);
#ifndef HVDX_MSTOPK_TWO_PASS_SELECT
    if (d < kOnePassLimit) {
      return Launch("SelectTile", SelectTile<T, Tidx, kLookBack>, tiles, kSelectWarps * 32, 0, stream, x, d, s.st,
                    s.tile_status, s.tile_counter, s.above, s.band, values, indices);
    }
#endif
    HVDX_RETURN_IF_ERROR(Launch("SelectTile", SelectTile<T, Tidx, kCountOnly>, tiles, kSelectWarps * 32, 0, stream, x,
                              d, s.st, s.tile_status, s.tile_counter, s.above, s.band, values, indices));
    size_t bytes = s.scan_bytes;
    HVDX_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.scan, bytes, s.above, s.above_start, tiles, stream),
                              "cub::DeviceScan::ExclusiveSum");
    bytes = s.scan_bytes;
    HVDX_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.scan, bytes, s.band, s.band_start, tiles, stream),
                              "cub::DeviceScan::ExclusiveSum");
    return Launch("SelectTile", SelectTile<T, Tidx, kWriteScanned>, tiles, kSelectWarps * 32, 0, stream, x, d, s.st,
                  s.tile_status, s.tile_counter, s.above_start, s.band_start, values, indices);
  }
};

#define HVDX_INSTANTIATE(T)                       \
  template struct MsTopK<GpuDevice, T, int32_t>; \
  template struct MsTopK<GpuDevice, T, int64_t>;
HVDX_KERNEL_TYPES(HVDX_INSTANTIATE)
#undef HVDX_INSTANTIATE

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
