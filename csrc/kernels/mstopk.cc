// CPU kernel of HvdxMstopk: Algorithm 1 of shi2021, reading x once in the common case.
// (The OpKernel that calls it is csrc/ops/mstopk_kernel.cc; this file builds without
// TensorFlow too, for the harness in csrc/harness.) MsTopK<CPU>::operator() runs, in order:
//
//   1. ScanMagnitudes, StartBisection (lines 1-3): one multi-threaded pass computes the sum
//      and max of the finite |x| and collects, per range of x, (position, |x|) of the
//      range's largest elements: every element at or above a cut (a bucket of the
//      magnitude's float bits: exponent and 4 mantissa bits) that rises, from a histogram of
//      the list, whenever the list outgrows its share of k. ExactFrom makes sure the lists
//      reach the (k+1)-th largest magnitude's bucket (x again only if a range held far
//      more than its share of the large elements).
//   2. BisectionRounds (lines 4-24): every threshold at or above the lists' lowest bucket is
//      counted exactly on the lists (LiveLists: shrinking with the bisection's interval, in
//      parallel). A lower threshold lies below the bucket of the (k+1)-th largest magnitude,
//      so it counts more than k, which is all the bisection needs to go on. ChooseThres1,
//      ChooseThres2 (lines 13-16, 19-22): only if thres2's tie-break cannot be decided from
//      the bounds is x read again (ExactCounts) to count those few thresholds exactly.
//      RoundsAtMean when max == mean: one count answers every round.
//   3. SelectFromLists when thres2 is at or above the lists' lowest bucket (the rule for
//      N >= ~10 on continuous data), else SelectFromX (one more pass): Select counts the
//      above set and the band per range, places the window (mstopk::Window, shared with the
//      CUDA kernel) and writes the selected indices; Gather copies their values.
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

// -- Pass 1 (Algorithm 1 lines 1-3): magnitude statistics and the ranges' lists -------------

// What the first pass over x learns: the statistics of the magnitudes, the fixed-order sum
// of the finite ones, and per range the list of its largest elements.
struct FirstPass {
  Stats stats;
  double sum = 0;
  std::vector<RangeScan> lists;
};

// One multi-threaded pass: the sum, max and min of the magnitudes and, per range, the list
// of its largest elements: after compaction at most twice its share of k plus 4096 (1/64 of
// a small range), for large densities 1/32 of the range, but 1.25 shares at least), twice
// that in between. Each element pushed costs more than a pass's read of it, so the lists
// stay short; a threshold below them is decided from their counts (it counts more than k).
template <typename T>
FirstPass ScanMagnitudes(const CPUDevice& dev, const Ranges& ranges, const T* x, int64_t d, int64_t k) {
  FirstPass pass;
  std::vector<Stats> part(ranges.count);
  std::vector<double> block_sums((d + kSumBlock - 1) / kSumBlock);
  pass.lists.resize(ranges.count);
  ParallelRanges(dev, ranges, 3, [&](int64_t c, int64_t b, int64_t e) {
    RangeScan& s = pass.lists[c];
    const double share = static_cast<double>(k) * static_cast<double>(e - b) / static_cast<double>(d);
    const int64_t slack = std::min<int64_t>(4096, (e - b) / 64);
    s.cap = 2 * (static_cast<int64_t>(std::max(std::min(2 * share, (e - b) / 32.0), 1.25 * share)) + slack);
    ForFloatBlocks(x, b, e, [&](int64_t offset, const float* block, int64_t n) {
      block_sums[offset / kSumBlock] = BlockStats(block, n, &part[c]);
      s.Collect(block, n, static_cast<uint32_t>(offset - b));
    });
  });
  for (const Stats& s : part) {
    pass.stats.max = std::max(pass.stats.max, s.max);
    pass.stats.min = std::min(pass.stats.min, s.min);
    pass.stats.nonfinite += s.nonfinite;
  }
  pass.sum = mstopk::PairwiseSum(block_sums.data(), static_cast<int64_t>(block_sums.size()));
  return pass;
}

// The bisection on [mean, max] of the finite magnitudes (mean clamped to max: a rounding
// excess of the sum).
mstopk::Bisection StartBisection(const FirstPass& pass, int64_t d, int64_t k) {
  const int64_t finite = d - pass.stats.nonfinite;
  const double max = pass.stats.max;
  const double mean = finite > 0 ? std::min(pass.sum / static_cast<double>(finite), max) : 0.0;
  return mstopk::Bisection(mean, max, k, d);
}

// Makes sure that no range's cut lies above the bucket of the (k+1)-th largest magnitude,
// and returns the float bits from which on every range's list holds all of its elements:
// any threshold below them counts more than k. The lists give the counts per bucket above
// the highest cut; only if those hold k or fewer (a range held far more than its share of
// the large elements) is x read again: a histogram of it, then the ranges whose cut is too
// high collect again.
template <typename T>
uint32_t ExactFrom(const CPUDevice& dev, const Ranges& ranges, const T* x, int64_t k, std::vector<RangeScan>* scans) {
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

// -- The bisection rounds (Algorithm 1 lines 4-24) ---------------------------------------------

// One round of the bisection: its threshold, and nnz = count(|x| >= thres) known to lie in
// [lower, upper] (exact when equal).
struct Round {
  double thres;
  uint32_t f;  // bits of FloatCeil(thres)
  bool at_most_k;
  int64_t lower, upper;
};

// When max == mean every threshold equals mean: one count over x answers every round.
template <typename T>
void RoundsAtMean(const CPUDevice& dev, const Ranges& ranges, const T* x, int num_samplings,
                  mstopk::Bisection* bis) {
  const float f = mstopk::FloatCeil(bis->Threshold());
  std::vector<int64_t> count(ranges.count);
  ParallelRanges(dev, ranges, 1, [&](int64_t c, int64_t b, int64_t e) {
    int64_t n = 0;
    for (int64_t i = b; i < e; ++i) n += Magnitude(x[i]) >= f;
    count[c] = n;
  });
  int64_t nnz = 0;
  for (int64_t n : count) nnz += n;
  for (int r = 0; r < num_samplings; ++r) bis->Update(nnz);
}

// The listed magnitudes (float bits) of each range that lie in the bisection's interval
// [lo_bits, hi_bits), and how many of each range's listed ones lie at or above hi_bits:
// for lo_bits <= f <= hi_bits, count(|x| >= f) = sum over the ranges of
// above[c] + count(live[c] >= f), every list holding all of its range's elements >= lowest.
class LiveLists {
 public:
  LiveLists(const std::vector<RangeScan>& scans, uint32_t lowest)
      : live_(scans.size()), above_(scans.size(), 0), count_(scans.size()), lo_bits_(lowest) {
    for (size_t c = 0; c < scans.size(); ++c) {
      const RangeScan& s = scans[c];
      for (int64_t j = 0; j < s.size; ++j)
        if (s.bits[j] >= lowest) live_[c].push_back(s.bits[j]);
      total_ += live_[c].size();
    }
  }
  int64_t total() const { return total_; }

  // count(|x| >= f) for lo_bits <= f <= hi_bits, counted on the lists in parallel.
  int64_t CountAtLeastBits(const CPUDevice& dev, uint32_t f) {
    dev.parallelFor(static_cast<Index>(live_.size()), Cost(), [&](Index first, Index last) {
      for (Index c = first; c < last; ++c) count_[c] = above_[c] + CountAtLeast(live_[c].data(), live_[c].size(), f);
    });
    int64_t nnz = 0;
    for (int64_t n : count_) nnz += n;
    return nnz;
  }

  // Narrows the interval to [max(lo_bits, lo), min(hi_bits, hi)), dropping what left it.
  void Shrink(const CPUDevice& dev, uint32_t lo, uint32_t hi) {
    if (!(hi < hi_bits_ || lo > lo_bits_)) return;
    hi_bits_ = std::min(hi_bits_, hi);
    lo_bits_ = std::max(lo_bits_, lo);
    dev.parallelFor(static_cast<Index>(live_.size()), Cost(), [&](Index first, Index last) {
      for (Index c = first; c < last; ++c) {
        std::vector<uint32_t>& v = live_[c];
        size_t n = 0;
        for (uint32_t u : v) {
          above_[c] += u >= hi_bits_;
          if (u >= lo_bits_ && u < hi_bits_) v[n++] = u;
        }
        v.resize(n);
      }
    });
    total_ = 0;
    for (const auto& v : live_) total_ += v.size();
  }

 private:
  OpCost Cost() const {
    const double per = static_cast<double>(total_) / live_.size() + 1;
    return OpCost(per * 4, 0, per);
  }

  std::vector<std::vector<uint32_t>> live_;
  std::vector<int64_t> above_, count_;
  int64_t total_ = 0;
  uint32_t lo_bits_, hi_bits_ = 0xFFFFFFFFu;
};

// The num_samplings rounds (lines 4-24): each threshold at or above `lowest` is counted
// exactly on the lists, which shrink with the interval; a lower one lies below the bucket of
// the (k+1)-th magnitude, so it counts more than k (at least as many as `lowest`, all d only
// when no magnitude is smaller: [lower, upper]). Moves bis's interval; returns the rounds
// (thres1 and thres2 are chosen from them afterwards).
std::vector<Round> BisectionRounds(const CPUDevice& dev, const std::vector<RangeScan>& scans, uint32_t lowest,
                                   uint32_t min_bits, int64_t d, int num_samplings, mstopk::Bisection* bis) {
  LiveLists lists(scans, lowest);
  const int64_t at_lowest = lists.total();  // count(|x| >= lowest)
  std::vector<Round> rounds;
  for (int r = 0; r < num_samplings; ++r) {
    const double ratio = bis->Ratio(), thres = bis->ThresholdAt(ratio);
    const uint32_t f = FloatBits(mstopk::FloatCeil(thres));
    Round round{thres, f, false, at_lowest, f > min_bits ? d - 1 : d};
    if (f <= min_bits) round.lower = d;
    if (f >= lowest) {  // exact, and inside the lists' interval
      round.lower = round.upper = lists.CountAtLeastBits(dev, f);
      round.at_most_k = round.lower <= bis->k;
    }
    rounds.push_back(round);
    if (round.at_most_k) bis->hi = ratio;
    else bis->lo = ratio;
    lists.Shrink(dev, std::max(lowest, FloatBits(mstopk::FloatCeil(bis->ThresholdAt(bis->lo)))),
                 FloatBits(mstopk::FloatCeil(bis->ThresholdAt(bis->hi))));
  }
  return rounds;
}

// Makes the count of every inexact round exact, in one more pass over x.
template <typename T>
void ExactCounts(const CPUDevice& dev, const Ranges& ranges, const T* x, std::vector<Round>* rounds) {
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

// thres1 (lines 13-16): the first round with the largest count <= k (those are exact).
void ChooseThres1(const std::vector<Round>& rounds, mstopk::Bisection* bis) {
  for (const Round& round : rounds) {
    if (round.at_most_k && round.lower > bis->k1) {
      bis->k1 = round.lower;
      bis->thres1 = round.thres;
      bis->has_thres1 = true;
    }
  }
}

// thres2 (lines 19-22) from the rounds' bounds: the first round with the smallest count > k,
// if below d. Returns false (bis's thres2 then undefined) if the bounds cannot decide.
bool ChooseThres2FromBounds(const std::vector<Round>& rounds, int64_t d, mstopk::Bisection* bis) {
  int64_t best_lower = d, best_upper = d;
  bis->has_thres2 = false;
  bis->thres2 = 0.0;
  for (const Round& round : rounds) {
    if (round.at_most_k) continue;
    if (round.upper < best_lower) {
      best_lower = round.lower;
      best_upper = round.upper;
      bis->thres2 = round.thres;
      bis->has_thres2 = true;
    } else if (round.lower < best_upper) {
      return false;
    }
  }
  return true;
}

// thres2, reading x once more to count the rounds below `lowest` exactly only if their
// bounds cannot decide it.
template <typename T>
void ChooseThres2(const CPUDevice& dev, const Ranges& ranges, const T* x, int64_t d, std::vector<Round>* rounds,
                  mstopk::Bisection* bis) {
  if (ChooseThres2FromBounds(*rounds, d, bis)) return;
  ExactCounts(dev, ranges, x, rounds);
  ChooseThres2FromBounds(*rounds, d, bis);  // exact counts: decided
}

// -- The selection (lines 25-31): the above set, then the band window ---------------------------

// Per range, in index order, how many elements are above (a >= f1) and in the band (f2 <= a
// < f1); returns each range's first rank in the above set and in the band, and the totals.
struct SelectionCounts {
  std::vector<int64_t> above_start, band_start;
  int64_t above = 0, band = 0;
};

// `visit(c, emit)` calls emit(index, a) for range c's elements in index order.
template <typename Visit>
SelectionCounts CountSelection(const CPUDevice& dev, int64_t ranges, const OpCost& cost, Visit visit, float f1,
                               float f2) {
  std::vector<int64_t> above(ranges), band(ranges);
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
  SelectionCounts counts;
  counts.above_start.resize(ranges);
  counts.band_start.resize(ranges);
  for (int64_t c = 0; c < ranges; ++c) {
    counts.above_start[c] = counts.above;
    counts.band_start[c] = counts.band;
    counts.above += above[c];
    counts.band += band[c];
  }
  return counts;
}

// Writes the index of every selected element to its slot of `out` (mstopk::Window::Slot).
template <typename Visit>
void WriteSelection(const CPUDevice& dev, int64_t ranges, const OpCost& cost, Visit visit, float f1, float f2,
                    const SelectionCounts& counts, const mstopk::Window& window, int64_t* out) {
  dev.parallelFor(ranges, cost, [&](Index first, Index last) {
    for (Index c = first; c < last; ++c) {
      int64_t ra = counts.above_start[c], rb = counts.band_start[c];
      visit(c, [&](int64_t i, float a) {
        int64_t slot = -1;
        if (a >= f1) slot = window.Slot(true, ra++);
        else if (a >= f2) slot = window.Slot(false, rb++);
        if (slot >= 0) out[slot] = i;
      });
    }
  });
}

// The k selected indices, in output order: every element with a >= f1 (index order), then
// the band window of elements f2 <= a < f1; if more than k are above (only non-finite ones
// can be), a window of k of them. Two passes over what `visit` visits (the lists or x).
template <typename Visit>
std::vector<int64_t> Select(const CPUDevice& dev, int64_t ranges, double cycles, Visit visit, float f1, float f2,
                            int64_t k, uint64_t random) {
  const OpCost cost(1 << 16, 0, cycles);
  const SelectionCounts counts = CountSelection(dev, ranges, cost, visit, f1, f2);
  const mstopk::Window window = mstopk::Window::Place(counts.above, counts.band, k, random);
  std::vector<int64_t> out(k);
  WriteSelection(dev, ranges, cost, visit, f1, f2, counts, window, out.data());
  return out;
}

// Select over the ranges' lists (valid when thres2's float ceiling is at or above every
// range's cut: the lists then hold every element of the above set and the band).
std::vector<int64_t> SelectFromLists(const CPUDevice& dev, const Ranges& ranges, const std::vector<RangeScan>& scans,
                                     const mstopk::Bisection& bis, int64_t k, uint64_t random) {
  int64_t listed_total = 0;
  for (const RangeScan& s : scans) listed_total += s.size;
  auto visit_list = [&](int64_t c, auto emit) {
    const RangeScan& s = scans[c];
    const int64_t b = ranges.begin(c);
    for (int64_t j = 0; j < s.size; ++j) emit(b + s.position[j], BitsFloat(s.bits[j]));
  };
  return Select(dev, ranges.count, static_cast<double>(listed_total) / ranges.count + 1, visit_list,
                mstopk::FloatCeil(bis.thres1), mstopk::FloatCeil(bis.thres2), k, random);
}

// Select over x itself (the band reaches below the lists, or every threshold was equal).
template <typename T>
std::vector<int64_t> SelectFromX(const CPUDevice& dev, const Ranges& ranges, const T* x,
                                 const mstopk::Bisection& bis, int64_t k, uint64_t random) {
  auto visit_x = [&](int64_t c, auto emit) {
    for (int64_t i = ranges.begin(c), e = ranges.end(c); i < e; ++i) emit(i, Magnitude(x[i]));
  };
  return Select(dev, ranges.count, static_cast<double>(ranges.size), visit_x, mstopk::FloatCeil(bis.thres1),
                mstopk::FloatCeil(bis.thres2), k, random);
}

// values[j] = x[selected[j]], indices[j] = selected[j] for the first n.
template <typename T, typename Tidx>
void Gather(const T* x, const int64_t* selected, int64_t n, T* values, Tidx* indices) {
  for (int64_t j = 0; j < n; ++j) {
    indices[j] = static_cast<Tidx>(selected[j]);
    values[j] = x[selected[j]];
  }
}

// Every element, in index order (k >= d).
template <typename T, typename Tidx>
void TakeAll(const T* x, int64_t d, T* values, Tidx* indices) {
  for (int64_t i = 0; i < d; ++i) {
    indices[i] = static_cast<Tidx>(i);
    values[i] = x[i];
  }
}

}  // namespace

namespace functor {

// Algorithm 1 as a sequence of passes: pass 1 (statistics and lists), the rounds (on the
// lists; x again only for what they cannot decide), the selection (from the lists, else x).
template <typename T, typename Tidx>
struct MsTopK<CPUDevice, T, Tidx> {
  static int64_t ScratchBytes(int64_t) { return 0; }

  Status operator()(const CPUDevice& dev, const T* x, int64_t d, int64_t k, int num_samplings,
                    uint64_t random, T* values, Tidx* indices, double* thresholds, void*) {
    thresholds[0] = HUGE_VAL;
    thresholds[1] = 0.0;
    if (k == 0) return OkStatus();
    if (k >= d) {
      TakeAll(x, d, values, indices);
      return OkStatus();
    }
    const Ranges ranges(d, dev.numThreads());
    FirstPass pass = ScanMagnitudes(dev, ranges, x, d, k);
    mstopk::Bisection bis = StartBisection(pass, d, k);
    std::vector<int64_t> selected;
    if (!(bis.span > 0)) {
      RoundsAtMean(dev, ranges, x, num_samplings, &bis);
    } else {
      const uint32_t lowest = ExactFrom(dev, ranges, x, k, &pass.lists);
      std::vector<Round> rounds =
          BisectionRounds(dev, pass.lists, lowest, MagBits(pass.stats.min), d, num_samplings, &bis);
      ChooseThres1(rounds, &bis);
      ChooseThres2(dev, ranges, x, d, &rounds, &bis);
      if (FloatBits(mstopk::FloatCeil(bis.thres2)) >= lowest) {
        selected = SelectFromLists(dev, ranges, pass.lists, bis, k, random);
      }
    }
    if (selected.empty()) selected = SelectFromX(dev, ranges, x, bis, k, random);
    Gather(x, selected.data(), k, values, indices);
    thresholds[0] = bis.thres1;
    thresholds[1] = bis.thres2;
    return OkStatus();
  }
};

#define HVDX_INSTANTIATE(T)                       \
  template struct MsTopK<CpuDevice, T, int32_t>; \
  template struct MsTopK<CpuDevice, T, int64_t>;
HVDX_KERNEL_TYPES(HVDX_INSTANTIATE)
#undef HVDX_INSTANTIATE

}  // namespace functor
}  // namespace hvdx
