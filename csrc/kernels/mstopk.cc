// CPU kernel of HvdxMstopk: Algorithm 1 of shi2021 in three multi-threaded passes over x.
//
//   1. stats:     sum and max of the finite |x| (Algorithm 1 lines 1-3);
//   2. histogram: the first b = min(N, 11) rounds query only the 2^b thresholds at ratios
//                 j / 2^b, so one histogram with exactly those edges answers them all;
//   3. collect:   the elements at or above the lower edge of the bin where the bisection
//                 ended (a few more than k for small densities), in index order.
// The remaining N - b rounds count over that short list, shrinking it as the interval
// narrows, and the selection reads it. Every count is exact against the same float64
// thresholds as the one-pass-per-round reference, so the selected set is identical.
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
constexpr int kMaxHistogramBits = 11;
constexpr int64_t kSumBlock = 4096;  // see RangeStats
constexpr int kSumLanes = 16;

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

// The sum of the finite magnitudes is formed in a fixed order that does not depend on the
// number of threads, so that mean(|x|) is reproducible bit for bit (and equals the
// reference's): blocks of kSumBlock elements, each summed in kSumLanes interleaved float64
// lanes (lane l takes the elements i = l mod kSumLanes, in order), lanes added in order,
// block sums added in order.

struct Stats {
  float max = 0;
  int64_t nonfinite = 0;
};

// Stats of x[begin, end) (begin a multiple of kSumBlock); writes each block's sum.
template <typename T>
Stats RangeStats(const T* x, int64_t begin, int64_t end, double* block_sums) {
  float max[kSumLanes] = {};
  int32_t bad[kSumLanes] = {};
  for (int64_t b = begin; b < end; b += kSumBlock) {
    double sum[kSumLanes] = {};
    const int64_t e = std::min(end, b + kSumBlock);
    int64_t i = b;
    for (; i + kSumLanes <= e; i += kSumLanes) {
      for (int l = 0; l < kSumLanes; ++l) {
        const float a = std::fabs(static_cast<float>(x[i + l]));
        const bool finite = a <= FLT_MAX;
        sum[l] += finite ? a : 0.0f;
        max[l] = std::max(max[l], finite ? a : 0.0f);
        bad[l] += finite ? 0 : 1;
      }
    }
    for (int l = 0; i < e; ++i, ++l) {
      const float a = std::fabs(static_cast<float>(x[i]));
      const bool finite = a <= FLT_MAX;
      sum[l] += finite ? a : 0.0f;
      max[l] = std::max(max[l], finite ? a : 0.0f);
      bad[l] += finite ? 0 : 1;
    }
    double block = 0;
    for (int l = 0; l < kSumLanes; ++l) block += sum[l];
    block_sums[b / kSumBlock] = block;
  }
  Stats stats;
  for (int l = 0; l < kSumLanes; ++l) {
    stats.max = std::max(stats.max, max[l]);
    stats.nonfinite += bad[l];
  }
  return stats;
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
                  uint64_t random, T* values, Tidx* indices, double* thresholds) {
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
      part[c] = RangeStats(x, b, e, block_sums.data());
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
      // Pass 2: one histogram answers the first b rounds.
      const int bits = std::min(num_samplings, kMaxHistogramBits);
      const int64_t bins = int64_t{1} << bits;
      std::vector<float> edge(bins);
      for (int64_t j = 0; j < bins; ++j)
        edge[j] = mstopk::FloatCeil(bis.ThresholdAt(static_cast<double>(j) / bins));
      const double scale = static_cast<double>(bins) / bis.span;
      std::vector<std::vector<int64_t>> hist(ranges.count);
      ParallelRanges(dev, ranges, 4, [&](int64_t c, int64_t b, int64_t e) {
        std::vector<int64_t>& h = hist[c];
        h.assign(bins, 0);
        const float lowest = edge[1];  // bin 0 is never queried: ratios are > 0
        for (int64_t i = b; i < e; ++i) {
          const float a = Magnitude(x[i]);
          if (a < lowest) continue;
          double guess = (static_cast<double>(a) - mean) * scale;
          int64_t j = guess >= static_cast<double>(bins - 1) ? bins - 1 : static_cast<int64_t>(guess);
          j = std::max<int64_t>(j, 1);
          while (j + 1 < bins && a >= edge[j + 1]) ++j;
          while (a < edge[j]) --j;
          ++h[j];
        }
      });
      std::vector<int64_t> at_least(bins + 1, 0);  // at_least[j] = count(a >= edge[j]), j >= 1
      for (int64_t j = bins - 1; j >= 1; --j) {
        int64_t n = 0;
        for (const auto& h : hist) n += h[j];
        at_least[j] = at_least[j + 1] + n;
      }
      for (int r = 0; r < bits; ++r)
        bis.Update(at_least[static_cast<int64_t>(bis.Ratio() * bins)]);

      // Pass 3: collect every element at or above the bin the bisection ended in.
      const float floor_edge = edge[static_cast<int64_t>(bis.lo * bins)];
      Candidates cand(ranges.count);
      ParallelRanges(dev, ranges, 1, [&](int64_t c, int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const float a = Magnitude(x[i]);
          if (a >= floor_edge) {
            cand.index[c].push_back(i);
            cand.magnitude[c].push_back(a);
          }
        }
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
    if (k == 0) {
      if constexpr (std::is_same_v<Device, CPUDevice>) {
        thresholds->flat<double>()(0) = HUGE_VAL;
        thresholds->flat<double>()(1) = 0.0;
        return;
      }
    }
    functor::MsTopK<Device, T, Tidx>()(ctx->eigen_device<Device>(), x.flat<T>().data(), d, k,
                                       num_samplings_, random, values->flat<T>().data(),
                                       indices->flat<Tidx>().data(), thresholds->flat<double>().data());
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
