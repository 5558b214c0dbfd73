// CPU kernel of HvdxMstopk: Algorithm 1 of shi2021, reading x once in the common case.
// (The OpKernel that calls it is csrc/ops/mstopk_kernel.cc; this file builds without
// TensorFlow too, for the harness in csrc/harness.)
//
//   1. scan:    one multi-threaded pass computes the sum and max of the finite |x|
//               (Algorithm 1 lines 1-3) and collects, per range of x, (position, |x|) of
//               the range's largest elements: every element at or above a cut (a bucket of
//               the magnitude's float bits: exponent and 4 mantissa bits) that rises,
//               from a histogram of the list, whenever the list outgrows its share of k.
//   2. rounds:  every threshold at or above the highest cut is counted exactly on the
//               lists (shrinking with the bisection's interval, in parallel). A lower
//               threshold lies below the bucket of the (k+1)-th largest magnitude, so it
//               counts more than k elements, which is all the bisection needs to go on.
//               Only if thres2's tie-break (Algorithm 1 line 19) cannot be decided that way
//               is x read again, to count those few thresholds exactly.
//   3. select:  from the lists when thres2 is at or above the highest cut (the rule for
//               N >= ~10 on continuous data); otherwise one more pass over x.
// Every count is exact against the same float64 thresholds as the one-pass-per-round
// reference (tests/mstopk_reference.py), so the result is identical whatever the input's
// distribution, and it does not depend on the number of threads.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "kernels/mstopk.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace hvdx {
namespace {

using CPUDevice = CpuDevice;
using mstopk::kSumBlock;
using mstopk::kSumLanes;

// Magnitudes as the bits of a non-negative float: ordered like the values, NaN and +-Inf
// mapped to +inf (they rank above every finite value).
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr int kKeyShift = 19;                               // bucket = bits >> 19
constexpr uint32_t kKeyMask = (1u << kKeyShift) - 1;
constexpr int kKeys = static_cast<int>(kInfBits >> kKeyShift) + 1;

inline uint32_t MagBits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u &= 0x7FFFFFFFu;
  return u < kInfBits ? u : kInfBits;
}
inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// |x| as float; NaN and +-Inf become +inf.
template <typename T>
inline float Magnitude(T v) {
  const float a = std::fabs(static_cast<float>(v));
  return a <= FLT_MAX ? a : INFINITY;
}

// Contiguous ranges of x processed in parallel, one per thread (each range's list carries a
// fixed slack, and its share of k is larger and steadier the larger the range); results are
// kept per range, so they do not depend on which thread ran which range. A range has fewer
// than 2^31 elements.
struct Ranges {
  int64_t n, size, count;
  Ranges(int64_t n_, int threads) : n(n_) {
    size = std::max<int64_t>(int64_t{1} << 15, (n + threads - 1) / threads);
    size = std::min<int64_t>(size, int64_t{1} << 30);
    size = (size + kSumBlock - 1) / kSumBlock * kSumBlock;  // whole summation blocks
    count = (n + size - 1) / size;
  }
  int64_t begin(int64_t c) const { return c * size; }
  int64_t end(int64_t c) const { return std::min(n, (c + 1) * size); }
};

template <typename F>
void ParallelRanges(const CPUDevice& dev, const Ranges& ranges, double cycles_per_element, F f) {
  const OpCost cost(static_cast<double>(ranges.size) * 4, 0,
                    static_cast<double>(ranges.size) * cycles_per_element);
  dev.parallelFor(ranges.count, cost, [&](Index first, Index last) {
    for (Index c = first; c < last; ++c) f(c, ranges.begin(c), ranges.end(c));
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
// lanes added in float64 in order, then the block sums in float64 pairwise
// (mstopk::PairwiseSum: a fixed tree that the GPU reduces in parallel).
struct Stats {
  float max = 0, min = INFINITY;  // min over every magnitude (non-finite ones count as +inf)
  int64_t nonfinite = 0;
};

// Sum of the finite |x| of one block (n <= kSumBlock) in the order above; updates stats.
HVDX_MULTIVERSION double BlockStats(const float* x, int64_t n, Stats* stats) {
  float sum[kSumLanes] = {};
  float max[kSumLanes] = {};
  float min[kSumLanes];
  int32_t bad[kSumLanes] = {};
  for (int l = 0; l < kSumLanes; ++l) min[l] = INFINITY;
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const float a = std::fabs(x[i + l]);
      const bool finite = a <= FLT_MAX;
      const float m = finite ? a : 0.0f;
      sum[l] += m;
      max[l] = max[l] > m ? max[l] : m;
      min[l] = min[l] < a ? min[l] : a;  // NaN compares false: keeps min
      bad[l] += finite ? 0 : 1;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float a = std::fabs(x[i]);
    const bool finite = a <= FLT_MAX;
    const float m = finite ? a : 0.0f;
    sum[l] += m;
    max[l] = max[l] > m ? max[l] : m;
    min[l] = min[l] < a ? min[l] : a;
    bad[l] += finite ? 0 : 1;
  }
  double block = 0;
  for (int l = 0; l < kSumLanes; ++l) {
    block += static_cast<double>(sum[l]);
    stats->max = std::max(stats->max, max[l]);
    stats->min = std::min(stats->min, min[l]);
    stats->nonfinite += bad[l];
  }
  return block;
}

// hist[bucket(|x[i]|)] += 1.
HVDX_MULTIVERSION void Histogram(const float* x, int64_t n, uint32_t* hist) {
  for (int64_t i = 0; i < n; ++i) ++hist[MagBits(x[i]) >> kKeyShift];
}

// A list of (position, magnitude bits) with room for one more block written without
// bounds checks: `size` entries are valid.
struct List {
  std::vector<uint32_t> position, bits;
  int64_t size = 0;
  void Reserve(int64_t n) {
    if (static_cast<int64_t>(bits.size()) < n) {
      const int64_t grown = std::max<int64_t>(n, 2 * static_cast<int64_t>(bits.size()));
      position.resize(grown);
      bits.resize(grown);
    }
  }
};

// Appends (base + i, bits of |x[i]|) for every element with bits >= lowest, in order; the
// list has room for n more. Hits are rare: the largest of each group of 32 is tested (this
// vectorizes), and groups with a hit are written without branches.
HVDX_MULTIVERSION void CollectAtLeast(const float* x, int64_t n, uint32_t lowest, uint32_t base, List* list) {
  constexpr int kGroup = 32;
  uint32_t* position = list->position.data();
  uint32_t* bits = list->bits.data();
  int64_t size = list->size;
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup) {
    uint32_t largest = 0;
    for (int l = 0; l < kGroup; ++l) largest = std::max(largest, MagBits(x[i + l]));
    if (largest < lowest) continue;
    for (int l = 0; l < kGroup; ++l) {
      const uint32_t u = MagBits(x[i + l]);
      position[size] = base + static_cast<uint32_t>(i + l);
      bits[size] = u;
      size += u >= lowest ? 1 : 0;
    }
  }
  for (; i < n; ++i) {
    const uint32_t u = MagBits(x[i]);
    position[size] = base + static_cast<uint32_t>(i);
    bits[size] = u;
    size += u >= lowest ? 1 : 0;
  }
  list->size = size;
}

// counts[j] += count(|x[i]| >= f[j]) for the m thresholds f (as float bits).
HVDX_MULTIVERSION void CountThresholds(const float* x, int64_t n, const uint32_t* f, int m, int64_t* counts) {
  for (int j = 0; j < m; ++j) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += MagBits(x[i]) >= f[j] ? 1 : 0;
    counts[j] += c;
  }
}

// count(bits[j] >= f) (vectorizes).
HVDX_MULTIVERSION int64_t CountAtLeast(const uint32_t* bits, int64_t n, uint32_t f) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) count += bits[j] >= f ? 1 : 0;
  return count;
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

// What the scan keeps of one range: the list of every element of the range with bucket
// >= cut (position in the range, magnitude bits), in index order. When the list exceeds
// `cap` entries, the cut rises to the lowest bucket that keeps at most cap / 2 of them
// (a histogram of the list tells which), and the list drops what fell below it.
struct RangeScan : List {
  uint32_t cut = 0;
  int64_t cap = 0;

  // Appends the elements of one block at or above the cut; compacts when over cap.
  void Collect(const float* x, int64_t n, uint32_t base) {
    Reserve(size + n);
    CollectAtLeast(x, n, cut << kKeyShift, base, this);
    if (size > cap) Compact();
  }
  void Compact() {
    std::vector<uint32_t> hist(kKeys, 0);
    for (int64_t j = 0; j < size; ++j) ++hist[bits[j] >> kKeyShift];
    int64_t kept = 0;
    uint32_t key = kKeys;
    while (key > 0 && kept + hist[key - 1] <= cap / 2) kept += hist[--key];
    Keep(key);
  }
  // Keeps the entries with bucket >= key (key >= cut).
  void Keep(uint32_t key) {
    cut = key;
    const uint32_t lowest = key << kKeyShift;
    int64_t n = 0;
    for (int64_t j = 0; j < size; ++j) {
      if (bits[j] >= lowest) {
        position[n] = position[j];
        bits[n++] = bits[j];
      }
    }
    size = n;
  }
};

// Writes the selection: every element with a >= f1 (index order), then the band window of
// elements f2 <= a < f1; if more than k are above (only non-finite ones can be), a window
// of k of them. `visit(c, emit)` calls emit(index, a) for range c's elements in index order.
template <typename Visit>
void Select(const CPUDevice& dev, int64_t ranges, double cycles, Visit visit, float f1, float f2,
            int64_t k, uint64_t random, std::vector<int64_t>* out) {
  std::vector<int64_t> above(ranges), band(ranges);
  const OpCost cost(1 << 16, 0, cycles);
  dev.parallelFor(ranges, cost, [&](Index first, Index last) {
    for (Index c = first; c < last; ++c) {
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
  dev.parallelFor(ranges, cost, [&](Index first, Index last) {
    for (Index c = first; c < last; ++c) {
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

// One round of the bisection: its threshold, and nnz = count(|x| >= thres) known to lie in
// [lower, upper] (exact when equal).
struct Round {
  double thres;
  uint32_t f;  // bits of FloatCeil(thres)
  bool at_most_k;
  int64_t lower, upper;
};

}  // namespace

namespace functor {

template <typename T, typename Tidx>
struct MsTopK<CPUDevice, T, Tidx> {
  static int64_t ScratchBytes(int64_t) { return 0; }

  Status operator()(const CPUDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                    uint64_t random, T* values, Tidx* indices, double* thresholds, void*) {
    thresholds[0] = HUGE_VAL;
    thresholds[1] = 0.0;
    if (k == 0) return OkStatus();
    if (k >= d) {  // everything, in index order
      for (int64_t i = 0; i < d; ++i) {
        indices[i] = static_cast<Tidx>(i);
        values[i] = x[i];
      }
      return OkStatus();
    }
    const Ranges ranges(d, dev.numThreads());

    // Pass 1: mean and max of the finite magnitudes; per range the list of its largest
    // elements: after compaction at most twice its share of k plus 4096 (1/64 of a
    // small range), for large
    // densities 1/32 of the range, but 1.25 shares at least), twice that in between. Each
    // element pushed costs more than a pass's read of it, so the lists stay short; a
    // threshold below them is decided from their counts (it counts more than k).
    std::vector<Stats> part(ranges.count);
    std::vector<double> block_sums((d + kSumBlock - 1) / kSumBlock);
    std::vector<RangeScan> scans(ranges.count);
    ParallelRanges(dev, ranges, 3, [&](int64_t c, int64_t b, int64_t e) {
      RangeScan& s = scans[c];
      const double share = static_cast<double>(k) * static_cast<double>(e - b) / static_cast<double>(d);
      const int64_t slack = std::min<int64_t>(4096, (e - b) / 64);
      s.cap = 2 * (static_cast<int64_t>(std::max(std::min(2 * share, (e - b) / 32.0), 1.25 * share)) + slack);
      ForFloatBlocks(x, b, e, [&](int64_t offset, const float* block, int64_t n) {
        block_sums[offset / kSumBlock] = BlockStats(block, n, &part[c]);
        s.Collect(block, n, static_cast<uint32_t>(offset - b));
      });
    });
    Stats all;
    for (const Stats& s : part) {
      all.max = std::max(all.max, s.max);
      all.min = std::min(all.min, s.min);
      all.nonfinite += s.nonfinite;
    }
    const double sum = mstopk::PairwiseSum(block_sums.data(), static_cast<int64_t>(block_sums.size()));
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
      const uint32_t lowest = ExactFrom(dev, ranges, x, k, &scans);
      // live[c]: range c's listed magnitudes (float bits) in [lo, hi) of the bisection's
      // interval; listed[c]: how many of them were at or above hi.
      std::vector<std::vector<uint32_t>> live(ranges.count);
      std::vector<int64_t> listed(ranges.count, 0);
      int64_t total_live = 0;
      for (int64_t c = 0; c < ranges.count; ++c) {
        const RangeScan& s = scans[c];
        for (int64_t j = 0; j < s.size; ++j)
          if (s.bits[j] >= lowest) live[c].push_back(s.bits[j]);
        total_live += live[c].size();
      }
      const int64_t at_lowest = total_live;  // count(|x| >= lowest)
      const uint32_t min_bits = MagBits(all.min);
      auto live_cost = [&]() {
        const double per = static_cast<double>(total_live) / ranges.count + 1;
        return OpCost(per * 4, 0, per);
      };
      uint32_t lo_bits = lowest, hi_bits = 0xFFFFFFFFu;
      std::vector<Round> rounds;
      std::vector<int64_t> count(ranges.count);
      for (int r = 0; r < num_samplings; ++r) {
        const double ratio = bis.Ratio(), thres = bis.ThresholdAt(ratio);
        const uint32_t f = FloatBits(mstopk::FloatCeil(thres));
        // Below `lowest` (below the (k+1)-th magnitude's bucket): more than k, at least as
        // many as at `lowest`, all d only when no magnitude is smaller.
        Round round{thres, f, false, at_lowest, f > min_bits ? d - 1 : d};
        if (f <= min_bits) round.lower = d;
        if (f >= lowest) {  // exact, and lo_bits <= f <= hi_bits
          dev.parallelFor(ranges.count, live_cost(), [&](Index first, Index last) {
            for (Index c = first; c < last; ++c)
              count[c] = listed[c] + CountAtLeast(live[c].data(), live[c].size(), f);
          });
          int64_t nnz = 0;
          for (int64_t n : count) nnz += n;
          round.lower = round.upper = nnz;
          round.at_most_k = nnz <= k;
        }
        rounds.push_back(round);
        if (round.at_most_k) bis.hi = ratio;
        else bis.lo = ratio;
        // Shrink the lists to the new interval.
        const uint32_t new_hi = FloatBits(mstopk::FloatCeil(bis.ThresholdAt(bis.hi)));
        const uint32_t new_lo = std::max(lowest, FloatBits(mstopk::FloatCeil(bis.ThresholdAt(bis.lo))));
        if (new_hi < hi_bits || new_lo > lo_bits) {
          hi_bits = std::min(hi_bits, new_hi);
          lo_bits = std::max(lo_bits, new_lo);
          dev.parallelFor(ranges.count, live_cost(), [&](Index first, Index last) {
            for (Index c = first; c < last; ++c) {
              std::vector<uint32_t>& v = live[c];
              size_t n = 0;
              for (uint32_t u : v) {
                listed[c] += u >= hi_bits;
                if (u >= lo_bits && u < hi_bits) v[n++] = u;
              }
              v.resize(n);
            }
          });
          total_live = 0;
          for (const auto& v : live) total_live += v.size();
        }
      }

      // thres1 (lines 13-16): the first round with the largest count <= k (all exact).
      for (const Round& round : rounds) {
        if (round.at_most_k && round.lower > bis.k1) {
          bis.k1 = round.lower;
          bis.thres1 = round.thres;
          bis.has_thres1 = true;
        }
      }
      // thres2 (lines 19-22): the first round with the smallest count > k, if below d.
      // If the bounds of the counts below `lowest` cannot decide, x is read once more
      // to count those thresholds exactly.
      bool exact = false;
      for (;;) {
        int64_t best_lower = d, best_upper = d;
        bool undecided = false;
        bis.has_thres2 = false;
        bis.thres2 = 0.0;
        for (const Round& round : rounds) {
          if (round.at_most_k) continue;
          if (round.upper < best_lower) {
            best_lower = round.lower;
            best_upper = round.upper;
            bis.thres2 = round.thres;
            bis.has_thres2 = true;
          } else if (round.lower < best_upper) {
            undecided = true;
            break;
          }
        }
        if (!undecided || exact) break;
        ExactCounts(dev, ranges, x, &rounds);
        exact = true;
      }

      const float f1 = mstopk::FloatCeil(bis.thres1), f2 = mstopk::FloatCeil(bis.thres2);
      if (FloatBits(f2) >= lowest) {
        // The band lies at or above every range's cut: select from the lists.
        int64_t listed_total = 0;
        for (const RangeScan& s : scans) listed_total += s.size;
        auto visit_list = [&](int64_t c, auto emit) {
          const RangeScan& s = scans[c];
          const int64_t b = ranges.begin(c);
          for (int64_t j = 0; j < s.size; ++j) emit(b + s.position[j], BitsFloat(s.bits[j]));
        };
        Select(dev, ranges.count, static_cast<double>(listed_total) / ranges.count + 1, visit_list,
               f1, f2, k, random, &selected);
      }
    }
    if (selected.empty()) {
      // The band reaches below the lists (or every threshold was equal): read x again.
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
    return OkStatus();
  }

 private:
  // Makes sure that no range's cut lies above the bucket of the (k+1)-th largest
  // magnitude, and returns the float bits from which on every range's list holds all of
  // its elements: any threshold below them counts more than k. The lists give the counts
  // per bucket above the highest cut; only if those hold k or fewer (a range held far
  // more than its share of the large elements) is x read again: a histogram of it, then
  // the ranges whose cut is too high collect again.
  static uint32_t ExactFrom(const CPUDevice& dev, const Ranges& ranges, const T* x, int64_t k,
                            std::vector<RangeScan>* scans) {
    // at_least[key]: listed elements in buckets >= key. Exact for key >= every cut, a lower
    // bound on count(bucket >= key) below.
    std::vector<int64_t> at_least(kKeys + 1, 0);
    uint32_t cut_max = 0;
    for (const RangeScan& s : *scans) {
      cut_max = std::max(cut_max, s.cut);
      for (int64_t j = 0; j < s.size; ++j) ++at_least[s.bits[j] >> kKeyShift];
    }
    for (int key = kKeys - 1; key >= 0; --key) at_least[key] += at_least[key + 1];
    if (at_least[cut_max] > k) return cut_max << kKeyShift;
    // Some range held far more than its share of the large elements: the highest bucket
    // whose lower bound already exceeds k is at or below the (k+1)-th magnitude's, and
    // the ranges cut above it collect again from it. Without one (the lists hold k or
    // fewer in all), a histogram of x finds the (k+1)-th magnitude's bucket.
    uint32_t target = cut_max;
    while (target > 0 && at_least[target] <= k) --target;
    if (at_least[target] <= k) {
      std::vector<std::vector<uint32_t>> hist(ranges.count, std::vector<uint32_t>(kKeys, 0));
      ParallelRanges(dev, ranges, 3, [&](int64_t c, int64_t b, int64_t e) {
        ForFloatBlocks(x, b, e, [&](int64_t, const float* block, int64_t n) {
          Histogram(block, n, hist[c].data());
        });
      });
      int64_t above = 0;
      target = kKeys;
      while (above <= k) {  // terminates: k < d
        --target;
        for (const auto& h : hist) above += h[target];
      }
    }
    ParallelRanges(dev, ranges, 1, [&](int64_t c, int64_t b, int64_t e) {
      RangeScan& s = (*scans)[c];
      if (s.cut <= target) return;
      s.size = 0;
      s.cut = target;
      s.cap = std::numeric_limits<int64_t>::max();
      ForFloatBlocks(x, b, e, [&](int64_t offset, const float* block, int64_t n) {
        s.Collect(block, n, static_cast<uint32_t>(offset - b));
      });
    });
    cut_max = 0;
    for (const RangeScan& s : *scans) cut_max = std::max(cut_max, s.cut);
    return cut_max << kKeyShift;
  }

  // Makes the count of every inexact round exact, in one more pass over x.
  static void ExactCounts(const CPUDevice& dev, const Ranges& ranges, const T* x, std::vector<Round>* rounds) {
    std::vector<uint32_t> f;
    for (const Round& r : *rounds)
      if (r.lower != r.upper) f.push_back(r.f);
    const int m = static_cast<int>(f.size());
    std::vector<std::vector<int64_t>> counts(ranges.count, std::vector<int64_t>(m, 0));
    ParallelRanges(dev, ranges, m + 1, [&](int64_t c, int64_t b, int64_t e) {
      ForFloatBlocks(x, b, e, [&](int64_t, const float* block, int64_t n) {
        CountThresholds(block, n, f.data(), m, counts[c].data());
      });
    });
    int j = 0;
    for (Round& r : *rounds) {
      if (r.lower == r.upper) continue;
      int64_t n = 0;
      for (const auto& v : counts) n += v[j];
      r.lower = r.upper = n;
      ++j;
    }
  }
};

#define HVDX_INSTANTIATE(T)                       \
  template struct MsTopK<CpuDevice, T, int32_t>; \
  template struct MsTopK<CpuDevice, T, int64_t>;
HVDX_KERNEL_TYPES(HVDX_INSTANTIATE)
#undef HVDX_INSTANTIATE

}  // namespace functor
}  // namespace hvdx
