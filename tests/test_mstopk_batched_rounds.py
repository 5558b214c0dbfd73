"""The GPU kernel's batched bisection (csrc/kernels/mstopk.cu.cc: PlanBatch, CountBatch,
ApplyBatch) gives Algorithm 1's thresholds exactly (Shi et al. 2021, arXiv:2010.10458,
Algorithm 1 lines 4-24): the next m rounds can only visit the ratios lo + j (hi - lo) / 2^m,
so one pass that counts how many of their 2^m - 1 thresholds each element reaches, then m
updates on the suffix sums of those counts, make the same decisions as m passes.

This is a NumPy model of the kernel's arithmetic (float64 thresholds, float32 magnitudes
against the float ceiling of each threshold, the binary search, the suffix sums), checked
against tests/mstopk_reference.py; the CUDA kernel itself is checked bit for bit against
the CPU kernel on a GPU machine (scripts/gpu_harness.sh, docs/gpu.md)."""
import numpy as np
import pytest

from scripts.gpu_harness import inputs
from tests import mstopk_reference as ref

BATCH_ROUNDS = 8  # kBatchRounds in csrc/kernels/mstopk.cu.cc


def float_ceil(t: float) -> np.float32:
    """mstopk::FloatCeil: the smallest float32 f >= t (+inf beyond FLT_MAX)."""
    if not t <= 3.4028234663852886e38:
        return np.float32(np.inf)
    f = np.float32(t)
    return np.nextafter(f, np.float32(np.inf)) if float(f) < t else f


def batched_thresholds(x: np.ndarray, k: int, num_samplings: int, batch_rounds: int = BATCH_ROUNDS):
    """(thres1, k1, thres2, k2) as the GPU kernel computes them, batch_rounds rounds per pass."""
    a64 = ref.magnitudes(x)
    mags = a64.astype(np.float32)
    bis = ref.Bisection.of(a64, k)
    passes = 0
    for done in range(0, num_samplings, batch_rounds):
        m = min(batch_rounds, num_samplings - done)
        n = 1 << m
        first, step = bis.lo, (bis.hi - bis.lo) / n                       # PlanBatch
        f = np.array([float_ceil(bis.threshold_at(first + j * step)) for j in range(1, n)], np.float32)
        assert np.all(np.diff(f) >= 0), "thresholds must not decrease with j (the binary search needs it)"
        reached = np.searchsorted(f, mags, side="right")                  # CountBatch: b per element
        counts = np.cumsum(np.bincount(reached, minlength=n)[::-1])[::-1]  # ApplyBatch: suffix sums
        passes += 1
        for _ in range(m):
            j = (bis.ratio() - first) / step
            assert j == int(j) and 1 <= j < n, "every ratio of the batch lies on its grid"
            bis.update(int(counts[int(j)]))
    assert passes == -(-num_samplings // batch_rounds)
    return bis.thres1, bis.k1, bis.thres2, bis.k2


@pytest.mark.parametrize("distribution", inputs.DISTRIBUTIONS)
def test_counting_eight_rounds_per_pass_makes_the_decisions_of_one_pass_per_round(distribution):
    for d in (1, 17, 4097, 100_003):
        x = inputs.make(distribution, d, 3)
        for k in sorted({1, max(1, d // 100), max(1, d // 10), max(d - 1, 1)}):
            for num_samplings in (1, 5, 8, 9, 30):
                got = batched_thresholds(x, k, num_samplings)
                want = ref.thresholds(ref.magnitudes(x), k, num_samplings)
                assert tuple(map(float, got)) == tuple(map(float, want)), (d, k, num_samplings)
