// CUDA kernel of HvdxMstopk (shi2021, Algorithm 1), same semantics as the CPU kernel.
//
// Everything stays on the device; the host only enqueues kernels on the stream it is given
// (TensorFlow's, or the harness's: csrc/harness), and checks every launch (kernels/gpu_launch.h):
//   stats   one thread per (sum block, lane): the fixed-order sum of BlockStats (mstopk.cc),
//           max and non-finite count; the 16 lanes of a block folded in order in shared
//           memory; the block sums added pairwise by a parallel tree (mstopk::PairwiseSum's
//           order), 512 per thread block and level;
//   rounds  up to kBatchRounds rounds of the bisection per pass over x: the next m rounds
//           can only visit the 2^m - 1 ratios lo + j (hi - lo) / 2^m (dyadic, exact in
//           float64), so one pass counts |x| >= each of their thresholds (a histogram of
//           which thresholds each element reaches, in shared memory, warp-aggregated), and
//           one thread then runs the m rounds of Bisection::Update on those exact counts.
//           N = 30 takes 4 passes instead of 30, with the same counts, so the same bits;
//   select  per chunk of 4096 (loaded coalesced, through shared memory) the counts of the
//           above set and the band; device-wide exclusive scans of those counts; one thread
//           places the window; then a block-wide scan writes every selected element in order.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cub/block/block_load.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include "kernels/gpu_launch.h"
#include "kernels/mstopk.h"

namespace hvdx {
namespace functor {
namespace {

using mstopk::GpuState;
using mstopk::kSumBlock;
using mstopk::kSumLanes;

constexpr int kThreads = 256;
constexpr int kPerThread = kSumBlock / kThreads;  // a chunk of kSumBlock elements per thread block
constexpr int kTree = 2 * kThreads;               // block sums added per thread block and level
constexpr int kBatchRounds = 8;                   // bisection rounds counted per pass over x
constexpr int kBatch = 1 << kBatchRounds;         // slots: thresholds 1 .. kBatch - 1 (0 unused)
constexpr int kBatchGrid = 1024;                  // thread blocks of CountBatch (its atomics)
static_assert(kBatch == kThreads, "PlanBatch runs one thread per threshold slot");
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

// Scratch layout, in 256-byte aligned pieces.
struct Scratch {
  GpuState* st;
  double *block_sums, *tree;
  int64_t *above, *band, *above_start, *band_start;
  float* batch_f;                    // kBatch thresholds of the current pass
  unsigned long long* batch_counts;  // kBatch counts
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
  s.block_sums = reinterpret_cast<double*>(p);
  p += Align(chunks * 8);
  s.tree = reinterpret_cast<double*>(p);
  p += Align(((chunks + kTree - 1) / kTree) * 8);
  int64_t** counts[] = {&s.above, &s.band, &s.above_start, &s.band_start};
  for (int64_t** c : counts) {
    *c = reinterpret_cast<int64_t*>(p);
    p += Align(chunks * 8);
  }
  s.batch_f = reinterpret_cast<float*>(p);
  p += Align(kBatch * 4);
  s.batch_counts = reinterpret_cast<unsigned long long*>(p);
  p += Align(kBatch * 8);
  s.scan = p;
  s.scan_bytes = ScanBytes(chunks);
  return s;
}

__global__ void ResetState(GpuState* st) {
  st->max_bits = 0;
  st->nonfinite = 0;
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

__global__ void InitBisection(const double* sum, int64_t d, int64_t k, GpuState* st) {
  const double max = static_cast<double>(__uint_as_float(st->max_bits));
  const int64_t finite = d - static_cast<int64_t>(st->nonfinite);
  const double mean = finite > 0 ? fmin(__ddiv_rn(*sum, static_cast<double>(finite)), max) : 0.0;
  st->bis = mstopk::Bisection(mean, max, k, d);
}

// The thresholds of the next m rounds: f[j] = FloatCeil(ThresholdAt(lo + j (hi - lo) / 2^m))
// for j = 1 .. 2^m - 1, non-decreasing in j; counts zeroed. One thread block of kBatch.
__global__ void PlanBatch(const GpuState* st, int m, float* f, unsigned long long* counts) {
  const int j = threadIdx.x;
  const int n = 1 << m;
  if (j < kBatch) counts[j] = 0;
  if (j == 0 || j >= n) return;
  const double step = (st->bis.hi - st->bis.lo) / n;  // a power of two: exact, as is lo + j * step
  f[j] = mstopk::FloatCeil(st->bis.ThresholdAt(st->bis.lo + j * step));
}

// counts[b] += the number of elements that reach exactly b of the thresholds f[1 .. 2^m - 1]
// (b >= 1; b = 0, below every threshold, is not counted). Integer sums: any order gives
// the same counts.
template <typename T>
__global__ void CountBatch(const T* x, int64_t d, int m, const float* f, unsigned long long* counts) {
  __shared__ float sf[kBatch];
  __shared__ unsigned int hist[kBatch];
  const int n = 1 << m;
  for (int j = threadIdx.x; j < kBatch; j += blockDim.x) {
    sf[j] = j > 0 && j < n ? f[j] : INFINITY;
    hist[j] = 0;
  }
  __syncthreads();
  const float lowest = sf[1];
  const unsigned lane = threadIdx.x % 32;
  // base is the same for the whole block, so every warp calls __match_any_sync together.
  for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x); base < d;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const float a = i < d ? Mag(static_cast<float>(x[i])) : -1.0f;
    int b = 0;
    if (a >= lowest) {  // the largest b with f[b] <= a (f non-decreasing)
      b = 1;
      for (int s = n / 2; s >= 1; s /= 2)
        if (b + s < n && sf[b + s] <= a) b += s;
    }
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, b);
    if (b > 0 && lane == static_cast<unsigned>(__ffs(peers) - 1))
      atomicAdd(&hist[b], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  for (int j = threadIdx.x + 1; j < n; j += blockDim.x)
    if (hist[j] > 0) atomicAdd(&counts[j], static_cast<unsigned long long>(hist[j]));
}

// One thread: the m rounds of Algorithm 1 (lines 10-23) on the counts of CountBatch.
// count(|x| >= f[j]) = sum of counts[b] for b >= j; round r's ratio is lo + j * step.
__global__ void ApplyBatch(GpuState* st, int m, unsigned long long* counts) {
  const int n = 1 << m;
  for (int j = n - 2; j >= 1; --j) counts[j] += counts[j + 1];  // suffix sums
  const double lo = st->bis.lo, step = (st->bis.hi - st->bis.lo) / n;
  for (int r = 0; r < m; ++r) {
    const int j = static_cast<int>((st->bis.Ratio() - lo) / step);  // exact: 1 .. n - 1
    st->bis.Update(static_cast<int64_t>(counts[j]));
  }
}

// This thread's kPerThread consecutive elements of chunk blockIdx.x, loaded coalesced
// through shared memory (cub's transposing load), as magnitudes; past d: -1 (never counted).
template <typename T>
struct ChunkLoad {
  using Loader = cub::BlockLoad<T, kThreads, kPerThread, cub::BLOCK_LOAD_TRANSPOSE>;
  typename Loader::TempStorage temp;

  __device__ void Magnitudes(const T* x, int64_t d, float (&a)[kPerThread]) {
    const int64_t start = blockIdx.x * static_cast<int64_t>(kSumBlock);
    const int valid = static_cast<int>(d - start < kSumBlock ? d - start : kSumBlock);
    T items[kPerThread];
    Loader(temp).Load(x + start, items, valid, T(0.0f));
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = static_cast<int64_t>(threadIdx.x) * kPerThread + j;
      a[j] = i < valid ? Mag(static_cast<float>(items[j])) : -1.0f;
    }
  }
};

__device__ inline void CountMine(const float (&a)[kPerThread], float f1, float f2, int* na, int* nb) {
  *na = 0;
  *nb = 0;
  for (int j = 0; j < kPerThread; ++j) {
    *na += a[j] >= f1;
    *nb += a[j] >= f2 && a[j] < f1;
  }
}

// Per chunk of kSumBlock elements: how many are above (a >= f1) and in the band.
template <typename T>
__global__ void SelectCount(const T* x, int64_t d, const GpuState* st, int64_t* above, int64_t* band) {
  const float f1 = mstopk::FloatCeil(st->bis.thres1), f2 = mstopk::FloatCeil(st->bis.thres2);
  __shared__ ChunkLoad<T> load;
  float a[kPerThread];
  load.Magnitudes(x, d, a);
  int na, nb;
  CountMine(a, f1, f2, &na, &nb);
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage ta, tb;
  const int total_a = Reduce(ta).Sum(na);
  const int total_b = Reduce(tb).Sum(nb);
  if (threadIdx.x == 0) {
    above[blockIdx.x] = total_a;
    band[blockIdx.x] = total_b;
  }
}

// One thread: the totals, the window, the thresholds (the prefix sums are cub's).
__global__ void SelectPlan(GpuState* st, const int64_t* above, const int64_t* band, const int64_t* above_start,
                           const int64_t* band_start, int64_t chunks, int64_t k, uint64_t random,
                           double* thresholds) {
  const int64_t k1 = above_start[chunks - 1] + above[chunks - 1];
  const int64_t nband = band_start[chunks - 1] + band[chunks - 1];
  st->window = mstopk::Window::Place(k1, nband, k, random);
  thresholds[0] = st->bis.thres1;
  thresholds[1] = st->bis.thres2;
}

template <typename T, typename Tidx>
__global__ void SelectWrite(const T* x, int64_t d, const GpuState* st, const int64_t* above_start,
                            const int64_t* band_start, T* values, Tidx* indices) {
  const float f1 = mstopk::FloatCeil(st->bis.thres1), f2 = mstopk::FloatCeil(st->bis.thres2);
  __shared__ ChunkLoad<T> load;
  float a[kPerThread];
  load.Magnitudes(x, d, a);
  int na, nb;
  CountMine(a, f1, f2, &na, &nb);
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage ta, tb;
  int ra, rb;
  Scan(ta).ExclusiveSum(na, ra);
  Scan(tb).ExclusiveSum(nb, rb);
  int64_t rank_a = above_start[blockIdx.x] + ra, rank_b = band_start[blockIdx.x] + rb;
  const mstopk::Window window = st->window;
  const int64_t start = blockIdx.x * static_cast<int64_t>(kSumBlock) + threadIdx.x * static_cast<int64_t>(kPerThread);
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = start + j;
    int64_t pos = -1;
    if (a[j] >= f1) pos = window.Slot(true, rank_a++);
    else if (a[j] >= f2) pos = window.Slot(false, rank_b++);
    if (pos >= 0) {
      indices[pos] = static_cast<Tidx>(i);
      values[pos] = x[i];
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

}  // namespace

template <typename T, typename Tidx>
struct MsTopK<GpuDevice, T, Tidx> {
  static int64_t ScratchBytes(int64_t d) {
    const int64_t chunks = Chunks(d);
    return Align(sizeof(GpuState)) + Align(chunks * 8) + Align(((chunks + kTree - 1) / kTree) * 8) +
           4 * Align(chunks * 8) + Align(kBatch * 4) + Align(kBatch * 8) +
           Align(static_cast<int64_t>(ScanBytes(chunks)));
  }

  Status operator()(const GpuDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                    uint64_t random, T* values, Tidx* indices, double* thresholds, void* scratch) {
    cudaStream_t stream = dev.stream();
    if (k >= d || k == 0) {  // everything in index order (nothing when d == 0), or nothing
      return Launch("SelectAll", SelectAll<T, Tidx>, GridFor(k), kThreads, 0, stream, x, k, values, indices,
                    thresholds);
    }
    const int64_t chunks = Chunks(d), lanes = chunks * kSumLanes;
    if (chunks > INT32_MAX) return errors::InvalidArgument("mstopk: x is too large for the GPU kernel");
    Scratch s = Layout(scratch, d);
    const int grid_chunks = static_cast<int>(chunks);
    HVDX_RETURN_IF_ERROR(Launch("ResetState", ResetState, 1, 1, 0, stream, s.st));
    HVDX_RETURN_IF_ERROR(Launch("LaneStats", LaneStats<T>, static_cast<int>((lanes + kThreads - 1) / kThreads),
                              kThreads, 0, stream, x, d, lanes, s.block_sums, s.st));
    double *in = s.block_sums, *out = s.tree;
    for (int64_t n = chunks; n > 1; n = (n + kTree - 1) / kTree) {
      HVDX_RETURN_IF_ERROR(Launch("PairwiseLevel", PairwiseLevel, static_cast<int>((n + kTree - 1) / kTree), kThreads,
                                0, stream, in, n, out));
      std::swap(in, out);
    }
    HVDX_RETURN_IF_ERROR(Launch("InitBisection", InitBisection, 1, 1, 0, stream, in, d, k, s.st));
    const int count_grid = std::min(GridFor(d), kBatchGrid);
    for (int done = 0; done < num_samplings; done += kBatchRounds) {
      const int m = std::min(kBatchRounds, num_samplings - done);
      HVDX_RETURN_IF_ERROR(Launch("PlanBatch", PlanBatch, 1, kBatch, 0, stream, s.st, m, s.batch_f, s.batch_counts));
      HVDX_RETURN_IF_ERROR(Launch("CountBatch", CountBatch<T>, count_grid, kThreads, 0, stream, x, d, m, s.batch_f,
                                s.batch_counts));
      HVDX_RETURN_IF_ERROR(Launch("ApplyBatch", ApplyBatch, 1, 1, 0, stream, s.st, m, s.batch_counts));
    }
    HVDX_RETURN_IF_ERROR(
        Launch("SelectCount", SelectCount<T>, grid_chunks, kThreads, 0, stream, x, d, s.st, s.above, s.band));
    size_t bytes = s.scan_bytes;
    HVDX_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.scan, bytes, s.above, s.above_start, grid_chunks, stream),
                              "cub::DeviceScan::ExclusiveSum");
    bytes = s.scan_bytes;
    HVDX_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.scan, bytes, s.band, s.band_start, grid_chunks, stream),
                              "cub::DeviceScan::ExclusiveSum");
    HVDX_RETURN_IF_ERROR(Launch("SelectPlan", SelectPlan, 1, 1, 0, stream, s.st, s.above, s.band, s.above_start,
                              s.band_start, chunks, k, random, thresholds));
    return Launch("SelectWrite", SelectWrite<T, Tidx>, grid_chunks, kThreads, 0, stream, x, d, s.st, s.above_start,
                  s.band_start, values, indices);
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
