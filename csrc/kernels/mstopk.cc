// CPU kernel of HvdxMstopk: Algorithm 1 of shi2021 in three multi-threaded passes over x.
//
//   1. stats:   sum and max of the finite |x| (Algorithm 1 lines 1-3);
//   2. count:   the first b = min(N, 4) rounds query only the 16 thresholds at ratios
//               j / 16, so one pass counting every element against all 16 answers them;
//   3. collect: the elements at or above the interval where the bisection then is (for
//               small densities a small multiple of k), with their indices, in order.
// The remaining N - b rounds count over that list, shrinking it as the interval narrows,
// and the selection reads it. Every count is exact against the same float64 thresholds as
// the one-pass-per-round reference (tests/mstopk_reference.py), so the result is identical.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/mstopk.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <cfloat>
#include <cmath>
#include <vector>

#include <mutex>
#include <random>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvdx {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;
constexpr int kCoarseBits = 4;  // rounds answered by the counting pass
constexpr int kCoarse = 1 << kCoarseBits;
using mstopk::kSumBlock;
using mstopk::kSumLanes;

// |x| as float; NaN and +-Inf become +inf (they rank above every finite value).
template <typename T>
inline float Magnitude(T v) {
  const float a = std::fabs(static_cast<float>(v));
  return a <= FLT_MAX ? a : INFINITY;
}

// Contiguous ranges of x processed in parallel; results are kept per range, so they do not
// depend on which thread ran which range.
struct Ranges {
  int64_t n, size, count;
  Ranges(int64_t n_, int threads) : n(n_) {
    size = std::max<int64_t>(int64_t{1} << 15, (n + 4 * threads - 1) / (4 * threads));
    size = (size + kSumBlock - 1) / kSumBlock * kSumBlock;  // whole summation blocks
    count = (n + size - 1) / size;
  }
  int64_t begin(int64_t c) const { return c * size; }
  int64_t end(int64_t c) const { return std::min(n, (c + 1) * size); }
};

template <typename F>
void ParallelRanges(const CPUDevice& dev, const Ranges& ranges, double cycles_per_element, F f) {
  const Eigen::TensorOpCost cost(static_cast<double>(ranges.size) * 4, 0,
                                 static_cast<double>(ranges.size) * cycles_per_element);
  dev.parallelFor(ranges.count, cost, [&](Eigen::Index first, Eigen::Index last) {
    for (Eigen::Index c = first; c < last; ++c) f(c, ranges.begin(c), ranges.end(c));
  });
}

// Hot loops work on float blocks (half and bfloat16 are converted block by block), and
// are compiled twice, for AVX2 and for the baseline, with the CPU choosing at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HVDX_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define HVDX_MULTIVERSION
#endif

// The sum of the finite magnitudes is formed in a fixed order that does not depend on the
// number of threads, so that mean(|x|) is reproducible bit for bit (and equals the
// reference's): blocks of kSumBlock elements, each summed in kSumLanes interleaved float32
// lanes (lane l takes the elements i = l mod kSumLanes, in order; these vectorize), the
// lanes added in float64 in order, then the block sums in float64 in order.
struct Stats {
  float max = 0;
  int64_t nonfinite = 0;
};

// Sum of the finite |x| of one block (n <= kSumBlock) in the order above; updates stats.
HVDX_MULTIVERSION double BlockStats(const float* x, int64_t n, Stats* stats) {
  float sum[kSumLanes] = {};
  float max[kSumLanes] = {};
  int32_t bad[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const float a = std::fabs(x[i + l]);
      const bool finite = a <= FLT_MAX;
      const float m = finite ? a : 0.0f;
      sum[l] += m;
      max[l] = max[l] > m ? max[l] : m;
      bad[l] += finite ? 0 : 1;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float a = std::fabs(x[i]);
    const bool finite = a <= FLT_MAX;
    const float m = finite ? a : 0.0f;
    sum[l] += m;
    max[l] = max[l] > m ? max[l] : m;
    bad[l] += finite ? 0 : 1;
  }
  double block = 0;
  for (int l = 0; l < kSumLanes; ++l) {
    block += static_cast<double>(sum[l]);
    stats->max = std::max(stats->max, max[l]);
    stats->nonfinite += bad[l];
  }
  return block;
}

// at_least[j] += count(|x[i]| >= edge[j]) for the kCoarse edges (compares vectorize).
HVDX_MULTIVERSION void CountAtLeast(const float* x, int64_t n, const float* edge, int64_t* at_least) {
  int32_t count[kCoarse] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float a = Magnitude(x[i]);
    for (int j = 0; j < kCoarse; ++j) count[j] += a >= edge[j] ? 1 : 0;
  }
  for (int j = 0; j < kCoarse; ++j) at_least[j] += count[j];
}

// Appends (offset + i, |x[i]|) for every |x[i]| >= lowest, in order. Hits are rare: each
// group of 16 is tested at once and only groups with a hit are looked at one by one.
HVDX_MULTIVERSION void CollectAtLeast(const float* x, int64_t n, float lowest, int64_t offset,
                                      std::vector<int64_t>* index, std::vector<float>* mag) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    int hit = 0;
    for (int l = 0; l < 16; ++l) hit |= Magnitude(x[i + l]) >= lowest ? 1 : 0;
    if (!hit) continue;
    for (int l = 0; l < 16; ++l) {
      const float a = Magnitude(x[i + l]);
      if (a >= lowest) {
        index->push_back(offset + i + l);
        mag->push_back(a);
      }
    }
  }
  for (; i < n; ++i) {
    const float a = Magnitude(x[i]);
    if (a >= lowest) {
      index->push_back(offset + i);
      mag->push_back(a);
    }
  }
}

// x[begin, end) as float blocks of at most kSumBlock elements: f(offset, block, n).
template <typename T, typename F>
void ForFloatBlocks(const T* x, int64_t begin, int64_t end, F f) {
  float buffer[kSumBlock];
  for (int64_t b = begin; b < end; b += kSumBlock) {
    const int64_t n = std::min(end - b, kSumBlock);
    if constexpr (std::is_same_v<T, float>) {
      f(b, x + b, n);
    } else {
      for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(x[b + i]);
      f(b, static_cast<const float*>(buffer), n);
    }
  }
}

// Per-range lists of (index, |x|) in index order.
struct Candidates {
  std::vector<std::vector<int64_t>> index;
  std::vector<std::vector<float>> magnitude;
  explicit Candidates(int64_t ranges) : index(ranges), magnitude(ranges) {}
  int64_t size() const {
    int64_t n = 0;
    for (const auto& v : index) n += v.size();
    return n;
  }
};

// Writes the selection: every element with a >= f1 (index order), then the band window of
// elements f2 <= a < f1; if more than k are above (only non-finite ones can be), a window
// of k of them. `visit(c, emit)` calls emit(index, a) for range c's elements in index order.
template <typename Visit>
void Select(const CPUDevice& dev, int64_t ranges, double cycles, Visit visit, float f1, float f2,
            int64_t k, uint64_t random, std::vector<int64_t>* out) {
  std::vector<int64_t> above(ranges), band(ranges);
  const Eigen::TensorOpCost cost(1 << 16, 0, cycles);
  dev.parallelFor(ranges, cost, [&](Eigen::Index first, Eigen::Index last) {
    for (Eigen::Index c = first; c < last; ++c) {
      int64_t na = 0, nb = 0;
      visit(c, [&](int64_t, float a) {
        na += a >= f1;
        nb += a >= f2 && a < f1;
      });
      above[c] = na;
      band[c] = nb;
    }
  });
  int64_t k1 = 0, nband = 0;
  std::vector<int64_t> above_start(ranges), band_start(ranges);
  for (int64_t c = 0; c < ranges; ++c) {
    above_start[c] = k1;
    band_start[c] = nband;
    k1 += above[c];
    nband += band[c];
  }
  const bool above_is_band = k1 > k;
  const int64_t need = above_is_band ? k : k - k1;
  const int64_t offset = need > 0 ? mstopk::WindowOffset(random, above_is_band ? k1 : nband, need) : 0;
  out->resize(k);
  int64_t* dst = out->data();
  dev.parallelFor(ranges, cost, [&](Eigen::Index first, Eigen::Index last) {
    for (Eigen::Index c = first; c < last; ++c) {
      int64_t ra = above_start[c], rb = band_start[c];
      visit(c, [&](int64_t i, float a) {
        if (a >= f1) {
          if (!above_is_band) {
            dst[ra] = i;
          } else if (ra >= offset && ra < offset + need) {
            dst[ra - offset] = i;
          }
          ++ra;
        } else if (a >= f2) {
          if (!above_is_band && rb >= offset && rb < offset + need) dst[k1 + rb - offset] = i;
          ++rb;
        }
      });
    }
  });
}

}  // namespace

namespace functor {

template <typename T, typename Tidx>
struct MsTopK<CPUDevice, T, Tidx> {
  void operator()(const CPUDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                  uint64_t random, T* values, Tidx* indices, double* thresholds, void*) {
    thresholds[0] = HUGE_VAL;
    thresholds[1] = 0.0;
    if (k >= d) {  // everything, in index order
      for (int64_t i = 0; i < d; ++i) {
        indices[i] = static_cast<Tidx>(i);
        values[i] = x[i];
      }
      return;
    }
    const Ranges ranges(d, dev.numThreads());

    // Pass 1: mean and max of the finite magnitudes.
    std::vector<Stats> part(ranges.count);
    std::vector<double> block_sums((d + kSumBlock - 1) / kSumBlock);
    ParallelRanges(dev, ranges, 2, [&](int64_t c, int64_t b, int64_t e) {
      ForFloatBlocks(x, b, e, [&](int64_t offset, const float* block, int64_t n) {
        block_sums[offset / kSumBlock] = BlockStats(block, n, &part[c]);
      });
    });
    Stats all;
    for (const Stats& s : part) {
      all.max = std::max(all.max, s.max);
      all.nonfinite += s.nonfinite;
    }
    double sum = 0;
    for (double s : block_sums) sum += s;
    const int64_t finite = d - all.nonfinite;
    const double max = all.max;
    const double mean = finite > 0 ? std::min(sum / static_cast<double>(finite), max) : 0.0;
    mstopk::Bisection bis(mean, max, k, d);

    // Elements f2 <= a < f1 of x itself, for the selections that need the whole vector.
    auto visit_x = [&](int64_t c, auto emit) {
      for (int64_t i = ranges.begin(c), e = ranges.end(c); i < e; ++i) emit(i, Magnitude(x[i]));
    };
    std::vector<int64_t> selected;
    if (!(bis.span > 0)) {
      // Every threshold equals mean: one count answers every round.
      const float f = mstopk::FloatCeil(bis.Threshold());
      std::vector<int64_t> count(ranges.count);
      ParallelRanges(dev, ranges, 1, [&](int64_t c, int64_t b, int64_t e) {
        int64_t n = 0;
        for (int64_t i = b; i < e; ++i) n += Magnitude(x[i]) >= f;
        count[c] = n;
      });
      int64_t nnz = 0;
      for (int64_t n : count) nnz += n;
      for (int r = 0; r < num_samplings; ++r) bis.Update(nnz);
    } else {
      // Pass 2: the first b = min(N, 4) rounds query only ratios j / 16: count every
      // element against those 16 thresholds at once.
      const int bits = std::min(num_samplings, kCoarseBits);
      const int64_t bins = kCoarse;
      float edge[kCoarse];
      for (int64_t j = 0; j < bins; ++j)
        edge[j] = mstopk::FloatCeil(bis.ThresholdAt(static_cast<double>(j) / bins));
      std::vector<std::vector<int64_t>> part_counts(ranges.count, std::vector<int64_t>(bins));
      ParallelRanges(dev, ranges, 3, [&](int64_t c, int64_t b, int64_t e) {
        ForFloatBlocks(x, b, e, [&](int64_t, const float* block, int64_t n) {
          CountAtLeast(block, n, edge, part_counts[c].data());
        });
      });
      std::vector<int64_t> at_least(bins, 0);  // count(a >= edge[j])
      for (const auto& counts : part_counts)
        for (int64_t j = 0; j < bins; ++j) at_least[j] += counts[j];
      for (int r = 0; r < bits; ++r)
        bis.Update(at_least[static_cast<int64_t>(bis.Ratio() * bins)]);

      // Pass 3: collect every element at or above the interval the bisection is in (a few
      // more than k for small densities), in index order.
      const float floor_edge = edge[static_cast<int64_t>(bis.lo * bins)];
      Candidates cand(ranges.count);
      ParallelRanges(dev, ranges, 1, [&](int64_t c, int64_t b, int64_t e) {
        ForFloatBlocks(x, b, e, [&](int64_t offset, const float* block, int64_t n) {
          CollectAtLeast(block, n, floor_edge, offset, &cand.index[c], &cand.magnitude[c]);
        });
      });

      // Rounds b+1..N over the shrinking set of magnitudes inside the interval.
      if (num_samplings > bits) {
        std::vector<float> live;
        int64_t above = 0;
        const float top = mstopk::FloatCeil(bis.ThresholdAt(bis.hi));
        for (const auto& m : cand.magnitude) {
          for (float a : m) {
            if (a >= top) ++above;
            else live.push_back(a);
          }
        }
        for (int r = bits; r < num_samplings; ++r) {
          const float f = mstopk::FloatCeil(bis.Threshold());
          int64_t nnz = above;
          for (float a : live) nnz += a >= f;
          bis.Update(nnz);
          const float lo = mstopk::FloatCeil(bis.ThresholdAt(bis.lo));
          const float hi = mstopk::FloatCeil(bis.ThresholdAt(bis.hi));
          auto keep = std::remove_if(live.begin(), live.end(), [&](float a) {
            above += a >= hi;
            return a >= hi || a < lo;
          });
          live.erase(keep, live.end());
        }
      }

      if (bis.has_thres2) {
        // The band lies above thres2 >= the collected floor: select from the candidates.
        const float f1 = mstopk::FloatCeil(bis.thres1), f2 = mstopk::FloatCeil(bis.thres2);
        auto visit_cand = [&](int64_t c, auto emit) {
          const auto& idx = cand.index[c];
          const auto& mag = cand.magnitude[c];
          for (size_t j = 0; j < idx.size(); ++j) emit(idx[j], mag[j]);
        };
        Select(dev, ranges.count, static_cast<double>(cand.size()) / ranges.count + 1, visit_cand,
               f1, f2, k, random, &selected);
      }
    }
    if (selected.empty()) {
      // The band reaches below mean (thres2 = 0) or every threshold was equal: read x again.
      const float f1 = mstopk::FloatCeil(bis.thres1), f2 = mstopk::FloatCeil(bis.thres2);
      Select(dev, ranges.count, static_cast<double>(ranges.size), visit_x, f1, f2, k, random,
             &selected);
    }
    for (int64_t j = 0; j < k; ++j) {
      indices[j] = static_cast<Tidx>(selected[j]);
      values[j] = x[selected[j]];
    }
    thresholds[0] = bis.thres1;
    thresholds[1] = bis.thres2;
  }
};

template struct MsTopK<CPUDevice, float, int32_t>;
template struct MsTopK<CPUDevice, float, int64_t>;
template struct MsTopK<CPUDevice, Eigen::half, int32_t>;
template struct MsTopK<CPUDevice, Eigen::half, int64_t>;
template struct MsTopK<CPUDevice, Eigen::bfloat16, int32_t>;
template struct MsTopK<CPUDevice, Eigen::bfloat16, int64_t>;

}  // namespace functor

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace errors = ::tensorflow::errors;

template <typename Device, typename T, typename Tidx>
class MsTopKOp : public OpKernel {
 public:
  explicit MsTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_samplings", &num_samplings_));
    ::tensorflow::int64 seed, seed2;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed2", &seed2));
    if (seed == 0 && seed2 == 0) {
      std::random_device device;
      rng_.seed((static_cast<uint64_t>(device()) << 32) ^ device());
    } else {
      std::seed_seq seq{static_cast<uint64_t>(seed), static_cast<uint64_t>(seed2)};
      rng_.seed(seq);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& k_tensor = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(x.shape()),
                errors::InvalidArgument("mstopk: x must be 1-D, got shape ", x.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(k_tensor.shape()),
                errors::InvalidArgument("mstopk: k must be a scalar, got shape ", k_tensor.shape().DebugString()));
    const int64_t d = x.NumElements();
    const int64_t k_requested = k_tensor.scalar<::tensorflow::int64>()();
    OP_REQUIRES(ctx, k_requested >= 0, errors::InvalidArgument("mstopk: k must be >= 0, got ", k_requested));
    OP_REQUIRES(ctx, (std::is_same_v<Tidx, int64_t> || d <= std::numeric_limits<int32_t>::max()),
                errors::InvalidArgument("mstopk: int32 indices cannot address ", d, " elements; use int64"));
    const int64_t k = std::min(k_requested, d);
    Tensor *values, *indices, *thresholds;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({2}), &thresholds));
    uint64_t random;
    {
      std::lock_guard<std::mutex> lock(mu_);
      random = rng_();
    }
    void* scratch_ptr = nullptr;
    Tensor scratch;
    if constexpr (std::is_same_v<Device, CPUDevice>) {
      if (k == 0) {
        thresholds->flat<double>()(0) = HUGE_VAL;
        thresholds->flat<double>()(1) = 0.0;
        return;
      }
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                             TensorShape({mstopk::GpuScratchBytes(d)}), &scratch));
      scratch_ptr = scratch.flat<::tensorflow::int8>().data();
    }
    functor::MsTopK<Device, T, Tidx>()(ctx->eigen_device<Device>(), x.flat<T>().data(), d, k,
                                       num_samplings_, random, values->flat<T>().data(),
                                       indices->flat<Tidx>().data(), thresholds->flat<double>().data(),
                                       scratch_ptr);
  }

 private:
  int num_samplings_;
  std::mutex mu_;
  std::mt19937_64 rng_;
};

#define HVDX_REGISTER_MSTOPK(DEV, DEVICE, T, TIDX)                                        \
  REGISTER_KERNEL_BUILDER(Name("HvdxMstopk")                                            \
                              .Device(::tensorflow::DEVICE_##DEV)                       \
                              .HostMemory("k")                                          \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<TIDX>("Tidx"),                            \
                          MsTopKOp<DEVICE, T, TIDX>);
#define HVDX_REGISTER_MSTOPK_ALL(DEV, DEVICE)                        \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, float, int32_t)                  \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, float, int64_t)                  \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::half, int32_t)            \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::half, int64_t)            \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::bfloat16, int32_t)        \
  HVDX_REGISTER_MSTOPK(DEV, DEVICE, Eigen::bfloat16, int64_t)

HVDX_REGISTER_MSTOPK_ALL(CPU, CPUDevice)
#if GOOGLE_CUDA
HVDX_REGISTER_MSTOPK_ALL(GPU, Eigen::GpuDevice)
#endif

}  // namespace hvdx
