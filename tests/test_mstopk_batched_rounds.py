"""The GPU kernel's batched bisection (csrc/kernels/mstopk.cu.cc: PlanPass, CountHist,
ApplyHist) gives Algorithm 1's thresholds exactly (Shi et al. 2021, arXiv:2010.10458,
Algorithm 1 lines 4-24): the next m rounds can only visit the ratios lo + j (hi - lo) / 2^m,
so one pass that histograms how many of their 2^m - 1 thresholds each element reaches, then
m updates on the suffix sums of those counts, make the same decisions as m passes. The
kernel takes an element's bin from a float estimate where the estimate's error bound keeps
it inside one bin, and from the exact thresholds otherwise; and it places the selection's
window before reading x again, from the bisection's own counts (lines 25-31).

This is a NumPy model of the kernel's arithmetic (float64 thresholds, float32 magnitudes
against the float ceiling of each threshold, the float estimate and its bound, the suffix
sums), checked against tests/mstopk_reference.py; the CUDA kernel itself is checked bit for
bit against the CPU kernel on a GPU machine (scripts/gpu_harness.sh, docs/gpu.md)."""
import numpy as np
import pytest

from scripts.gpu_harness import inputs
from tests import mstopk_reference as ref

ROUNDS_PER_PASS = 15  # kMaxRounds in csrc/kernels/mstopk.cu.cc (on a GPU with 128 KiB of shared memory)
FLT_EPS, FLT_TRUE_MIN = 1.1920928955078125e-07, 1.4012984643248171e-45


def float_ceil(t: np.ndarray) -> np.ndarray:
    """mstopk::FloatCeil elementwise: the smallest float32 f >= t (+inf beyond FLT_MAX)."""
    t = np.asarray(t, np.float64)
    f = t.astype(np.float32)
    up = f.astype(np.float64) < t
    f[up] = np.nextafter(f[up], np.float32(np.inf))
    f[~(t <= 3.4028234663852886e38)] = np.inf
    return f


def estimated_bins(mags: np.ndarray, bis: ref.Bisection, step: float, n: int):
    """PlanPass's estimate and CountHist's use of it: (bin, certain) per element in range."""
    width = step * bis.span
    top = abs(bis.threshold_at(bis.hi)) + abs(bis.threshold_at(bis.lo))
    ulp = max(top * FLT_EPS, FLT_TRUE_MIN)
    eps = np.float32(min(3 * ulp / width + n * 2.0**-22 + 1e-6, 1.0) if width > 0 else 1.0)
    base = np.float32(bis.threshold_at(bis.lo))
    inv = np.float32(1.0 / width) if width > 0 else np.float32(0.0)
    with np.errstate(all="ignore"):
        e = ((mags - base) * inv).astype(np.float32)
        whole = np.minimum(np.maximum(np.nan_to_num(e, nan=0.0), np.float32(0)), np.float32(n)).astype(np.int64)
        frac = (e - whole.astype(np.float32)).astype(np.float32)
    certain = (eps < 0.5) & (whole >= 1) & (whole <= n - 2) & (frac >= eps) & (frac <= 1 - eps)
    return whole, certain


def batched_thresholds(x: np.ndarray, k: int, num_samplings: int, rounds_per_pass: int = ROUNDS_PER_PASS):
    """(thres1, k1, thres2, k2) as the GPU kernel computes them, rounds_per_pass rounds per pass."""
    a64 = ref.magnitudes(x)
    mags = a64.astype(np.float32)
    bis = ref.Bisection.of(a64, k)
    passes = 0
    for done in range(0, num_samplings, rounds_per_pass):
        m = min(rounds_per_pass, num_samplings - done)
        n = 1 << m
        first, step = bis.lo, (bis.hi - bis.lo) / n                       # PlanPass
        f = np.full(n, np.nan, np.float32)
        f[1:] = float_ceil(bis.threshold_at(first + np.arange(1, n) * step))
        assert np.all(np.diff(f[1:]) >= 0), "thresholds must not decrease with j (the search needs it)"
        exact = np.searchsorted(f[1:], mags, side="right")               # the largest b with f[b] <= a
        inside = (mags >= f[1]) & (mags < f[n - 1])
        whole, certain = estimated_bins(mags, bis, step, n)              # CountHist
        sure = inside & certain
        assert np.array_equal(whole[sure], exact[sure]), "a certain estimate is the exact bin"
        counts = np.cumsum(np.bincount(exact, minlength=n)[::-1])[::-1]  # ApplyHist: suffix sums
        passes += 1
        for _ in range(m):
            j = (bis.ratio() - first) / step
            assert j == int(j) and 1 <= j < n, "every ratio of the pass lies on its grid"
            bis.update(int(counts[int(j)]))
    assert passes == -(-num_samplings // rounds_per_pass)
    return bis


@pytest.mark.parametrize("distribution", inputs.DISTRIBUTIONS)
def test_counting_fifteen_rounds_per_pass_makes_the_decisions_of_one_pass_per_round(distribution):
    for d in (1, 17, 4097, 100_003):
        x = inputs.make(distribution, d, 3)
        for k in sorted({1, max(1, d // 100), max(1, d // 10), max(d - 1, 1)}):
            for num_samplings in (1, 5, 15, 16, 30):
                bis = batched_thresholds(x, k, num_samplings)
                got = (bis.thres1, bis.k1, bis.thres2, bis.k2)
                want = ref.thresholds(ref.magnitudes(x), k, num_samplings)
                assert tuple(map(float, got)) == tuple(map(float, want)), (d, k, num_samplings)


@pytest.mark.parametrize("distribution", inputs.DISTRIBUTIONS)
def test_the_window_is_placed_from_the_bisections_own_counts(distribution):
    """ApplyHist places the selection's window before the select reads x: the above set has
    k1 elements when a round qualified (else the non-finite ones, thres1 = inf), and
    |x| >= thres2 holds for k2 (d when no round did, thres2 = 0)."""
    for d in (17, 4097, 100_003):
        x = inputs.make(distribution, d, 5)
        a = ref.magnitudes(x)
        for k in sorted({1, max(1, d // 1000), max(1, d // 100), d - 1}):
            for num_samplings in (1, 30):
                bis = batched_thresholds(x, k, num_samplings)
                above = bis.k1 if bis.k1 > 0 else int(np.count_nonzero(~np.isfinite(x)))
                assert above == np.count_nonzero(a >= bis.thres1), (d, k, num_samplings)
                assert bis.k2 == np.count_nonzero(a >= bis.thres2), (d, k, num_samplings)
                sel = ref.mstopk(x, k, num_samplings, offset=0)
                if above > k:  # more than k non-finite: the window is taken from the above set
                    assert (sel.above.size, sel.band.size) == (0, above)
                else:
                    assert (sel.above.size, sel.band.size) == (above, bis.k2 - above)
