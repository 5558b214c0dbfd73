// CUDA kernel of HvdxMstopk (shi2021, Algorithm 1), same semantics as the CPU kernel.
//
// Everything stays on the device; the host only enqueues kernels on TensorFlow's stream:
//   stats   one thread per (sum block, lane): the fixed-order sum of BlockStats (mstopk.cc),
//           max and non-finite count; one thread then folds the lanes and blocks in order;
//   rounds  N x (count |x| >= threshold, one thread updates the Bisection), as Algorithm 1
//           is written: on a GPU a pass is cheap and the state never leaves the device;
//   select  per chunk counts of the above set and the band, one thread for the prefix sums
//           and the window, then a block-wide scan writes every selected element in order.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <cfloat>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/mstopk.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {
namespace functor {
namespace {

using mstopk::GpuState;
using mstopk::kSumBlock;
using mstopk::kSumLanes;

constexpr int kThreads = 256;
constexpr int kPerThread = kSumBlock / kThreads;  // 16 consecutive elements per thread

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ inline float Mag(float v) {
  const float a = fabsf(v);
  return a <= FLT_MAX ? a : INFINITY;
}

template <typename T>
__global__ void LaneStats(const T* x, int64_t d, int64_t lanes, double* lane_sums, GpuState* st) {
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
    lane_sums[t] = static_cast<double>(sum);
  }
  using ReduceF = cub::BlockReduce<float, kThreads>;
  using ReduceU = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename ReduceF::TempStorage tf;
  __shared__ typename ReduceU::TempStorage tu;
  const float block_max = ReduceF(tf).Reduce(max, MaxOp());
  const unsigned long long block_bad = ReduceU(tu).Sum(bad);
  if (threadIdx.x == 0) {
    atomicMax(&st->max_bits, __float_as_uint(block_max));  // non-negative floats order as uints
    atomicAdd(&st->nonfinite, block_bad);
  }
}

__global__ void ResetState(GpuState* st) {
  st->max_bits = 0;
  st->nonfinite = 0;
  st->nnz = 0;
}

__global__ void InitBisection(const double* lane_sums, int64_t blocks, int64_t d, int64_t k, GpuState* st) {
  double sum = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    double block = 0;
    for (int l = 0; l < kSumLanes; ++l) block = __dadd_rn(block, lane_sums[b * kSumLanes + l]);
    sum = __dadd_rn(sum, block);
  }
  const double max = static_cast<double>(__uint_as_float(st->max_bits));
  const int64_t finite = d - static_cast<int64_t>(st->nonfinite);
  const double mean = finite > 0 ? fmin(__ddiv_rn(sum, static_cast<double>(finite)), max) : 0.0;
  st->bis = mstopk::Bisection(mean, max, k, d);
  st->nnz = 0;
}

template <typename T>
__global__ void CountRound(const T* x, int64_t d, GpuState* st) {
  const float f = mstopk::FloatCeil(st->bis.Threshold());
  unsigned long long count = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < d;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    count += Mag(static_cast<float>(x[i])) >= f ? 1 : 0;
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const unsigned long long total = Reduce(temp).Sum(count);
  if (threadIdx.x == 0 && total > 0) atomicAdd(&st->nnz, total);
}

__global__ void UpdateRound(GpuState* st) {
  st->bis.Update(static_cast<int64_t>(st->nnz));
  st->nnz = 0;
}

// This thread's kPerThread consecutive elements of its chunk: how many are above (a >= f1)
// and how many in the band (f2 <= a < f1).
template <typename T>
__device__ void CountMine(const T* x, int64_t d, int64_t start, float f1, float f2, int* na, int* nb) {
  *na = 0;
  *nb = 0;
  for (int j = 0; j < kPerThread && start + j < d; ++j) {
    const float a = Mag(static_cast<float>(x[start + j]));
    *na += a >= f1;
    *nb += a >= f2 && a < f1;
  }
}

// Per chunk of kSumBlock elements: how many are above (a >= f1) and in the band.
template <typename T>
__global__ void SelectCount(const T* x, int64_t d, const GpuState* st, int64_t* above, int64_t* band) {
  const float f1 = mstopk::FloatCeil(st->bis.thres1), f2 = mstopk::FloatCeil(st->bis.thres2);
  const int64_t start = blockIdx.x * kSumBlock + threadIdx.x * static_cast<int64_t>(kPerThread);
  int na, nb;
  CountMine(x, d, start, f1, f2, &na, &nb);
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage ta, tb;
  const int total_a = Reduce(ta).Sum(na);
  const int total_b = Reduce(tb).Sum(nb);
  if (threadIdx.x == 0) {
    above[blockIdx.x] = total_a;
    band[blockIdx.x] = total_b;
  }
}

// One thread: exclusive prefix sums of the chunk counts, the window, the thresholds.
__global__ void SelectPlan(GpuState* st, int64_t* above, int64_t* band, int64_t chunks, int64_t k,
                           uint64_t random, double* thresholds) {
  int64_t k1 = 0, nband = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t a = above[c], b = band[c];
    above[c] = k1;
    band[c] = nband;
    k1 += a;
    nband += b;
  }
  st->above_is_band = k1 > k;
  st->k1 = k1;
  st->band = nband;
  st->need = st->above_is_band ? k : k - k1;
  st->offset = st->need > 0 ? mstopk::WindowOffset(random, st->above_is_band ? k1 : nband, st->need) : 0;
  thresholds[0] = st->bis.thres1;
  thresholds[1] = st->bis.thres2;
}

template <typename T, typename Tidx>
__global__ void SelectWrite(const T* x, int64_t d, const GpuState* st, const int64_t* above_start,
                            const int64_t* band_start, T* values, Tidx* indices) {
  const float f1 = mstopk::FloatCeil(st->bis.thres1), f2 = mstopk::FloatCeil(st->bis.thres2);
  const int64_t start = blockIdx.x * kSumBlock + threadIdx.x * static_cast<int64_t>(kPerThread);
  int na, nb;
  CountMine(x, d, start, f1, f2, &na, &nb);
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage ta, tb;
  int ra, rb;
  Scan(ta).ExclusiveSum(na, ra);
  Scan(tb).ExclusiveSum(nb, rb);
  int64_t rank_a = above_start[blockIdx.x] + ra, rank_b = band_start[blockIdx.x] + rb;
  const bool above_is_band = st->above_is_band;
  const int64_t k1 = st->k1, need = st->need, offset = st->offset;
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = start + j;
    if (i >= d) break;
    const float a = Mag(static_cast<float>(x[i]));
    int64_t pos = -1;
    if (a >= f1) {
      if (!above_is_band) pos = rank_a;
      else if (rank_a >= offset && rank_a < offset + need) pos = rank_a - offset;
      ++rank_a;
    } else if (a >= f2) {
      if (!above_is_band && rank_b >= offset && rank_b < offset + need) pos = k1 + rank_b - offset;
      ++rank_b;
    }
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
struct MsTopK<Eigen::GpuDevice, T, Tidx> {
  void operator()(const Eigen::GpuDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                  uint64_t random, T* values, Tidx* indices, double* thresholds, void* scratch) {
    cudaStream_t stream = dev.stream();
    if (k >= d || k == 0) {  // everything in index order (nothing when d == 0), or nothing
      SelectAll<<<GridFor(k), kThreads, 0, stream>>>(x, k, values, indices, thresholds);
      return;
    }
    const int64_t blocks = (d + kSumBlock - 1) / kSumBlock, lanes = blocks * kSumLanes;
    char* bytes = static_cast<char*>(scratch);
    GpuState* st = reinterpret_cast<GpuState*>(bytes);
    double* lane_sums = reinterpret_cast<double*>(bytes + (sizeof(GpuState) + 255) / 256 * 256);
    int64_t* above = reinterpret_cast<int64_t*>(lane_sums + lanes);
    int64_t* band = above + blocks;

    ResetState<<<1, 1, 0, stream>>>(st);
    LaneStats<<<static_cast<int>((lanes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        x, d, lanes, lane_sums, st);
    InitBisection<<<1, 1, 0, stream>>>(lane_sums, blocks, d, k, st);
    for (int r = 0; r < num_samplings; ++r) {
      CountRound<<<GridFor(d), kThreads, 0, stream>>>(x, d, st);
      UpdateRound<<<1, 1, 0, stream>>>(st);
    }
    SelectCount<<<static_cast<int>(blocks), kThreads, 0, stream>>>(x, d, st, above, band);
    SelectPlan<<<1, 1, 0, stream>>>(st, above, band, blocks, k, random, thresholds);
    SelectWrite<<<static_cast<int>(blocks), kThreads, 0, stream>>>(x, d, st, above, band, values, indices);
  }
};

template struct MsTopK<Eigen::GpuDevice, float, int32_t>;
template struct MsTopK<Eigen::GpuDevice, float, int64_t>;
template struct MsTopK<Eigen::GpuDevice, Eigen::half, int32_t>;
template struct MsTopK<Eigen::GpuDevice, Eigen::half, int64_t>;
template struct MsTopK<Eigen::GpuDevice, Eigen::bfloat16, int32_t>;
template struct MsTopK<Eigen::GpuDevice, Eigen::bfloat16, int64_t>;

}  // namespace functor
}  // namespace hvdx

#endif  // GOOGLE_CUDA
