"""A straightforward NumPy implementation of MSTopK (shi2021, Algorithm 1) with hvdx's fixes.

It runs one full counting pass per round, exactly as Algorithm 1 is written, and is the
specification the op's kernels are tested against:

- a = |x| in float64; NaN and +-Inf count as +inf (above every finite value); mean and max
  are over the finite elements (0 when there are none), and mean is clamped to <= max so
  that thresholds never decrease with the ratio (only rounding could make mean > max);
  the sum is formed in a fixed order (`finite_sum`) so that every kernel gets the same
  mean bit for bit, whatever its number of threads;
- round i: ratio = l + (r - l) / 2, thres = mean + ratio * (max - mean) (float64, no FMA),
  nnz = count(a >= thres); thres1/k1 is the round with the largest 0 < nnz <= k (first one
  on ties), thres2/k2 the round with the smallest nnz > k (first one on ties);
- no round for thres1 -> thres1 = +inf: only the non-finite elements count as above it
  (none for finite input). No round for thres2 -> thres2 = 0: every element below thres1
  is in the band;
- selected: every element with a >= thres1 (index order), then the k - k1 band elements
  (thres2 <= a < thres1) at positions offset .. offset + k - k1 - 1 of the band in index
  order, offset uniform over 0 .. len(band) - (k - k1) (Algorithm 1's bound is off by one);
- if more than k elements are non-finite, the above set itself is the band: a window of k;
- k >= d selects everything (indices 0..d-1), k == 0 nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class Selection:
    indices: np.ndarray      # int64, exactly min(k, d), above set then band window
    thres1: float            # +inf when no round qualified
    thres2: float            # 0.0 when no round qualified
    above: np.ndarray        # indices with a >= thres1 (index order)
    band: np.ndarray         # indices with thres2 <= a < thres1 (index order)
    offset: Optional[int]    # start of the window (None when no window was needed)


def magnitudes(x: np.ndarray) -> np.ndarray:
    """|x| in float64 with every non-finite element mapped to +inf."""
    a = np.abs(np.asarray(x).astype(np.float64))
    a[~np.isfinite(a)] = np.inf
    return a


SUM_BLOCK, SUM_LANES = 4096, 16


def finite_sum(a: np.ndarray) -> float:
    """Sum of the finite entries of `a` in the kernels' order: blocks of 4096 elements, each
    summed in 16 interleaved float32 lanes (lane l: elements l, l+16, ... in order), the
    lanes added in float64 in order, then the block sums pairwise (a fixed binary tree that
    the GPU reduces in parallel). np.cumsum adds sequentially."""
    padded = np.zeros(-(-a.size // SUM_BLOCK) * SUM_BLOCK, np.float32)
    padded[:a.size] = np.where(np.isfinite(a), a, 0.0)  # |x| of a float input: exact in float32
    lanes = np.cumsum(padded.reshape(-1, SUM_BLOCK // SUM_LANES, SUM_LANES), axis=1,
                      dtype=np.float32)[:, -1, :].astype(np.float64)
    blocks = np.cumsum(lanes, axis=1)[:, -1]
    while blocks.size > 1:  # pairwise, level by level: s[i] = s[2i] + s[2i+1]
        if blocks.size % 2:
            blocks = np.append(blocks, 0.0)  # x + 0 = x: the odd last sum is carried up
        blocks = blocks[0::2] + blocks[1::2]
    return float(blocks[0]) if blocks.size else 0.0


@dataclass
class Bisection:
    """Algorithm 1 lines 4-23, one round at a time (mstopk::Bisection in csrc/kernels/mstopk.h):
    the caller counts nnz(a >= threshold()) however it likes and reports it to update()."""
    mean: float
    span: float      # max - mean >= 0
    k: int
    k2: int          # d
    lo: float = 0.0
    hi: float = 1.0
    k1: int = 0
    thres1: float = np.inf
    thres2: float = 0.0

    @classmethod
    def of(cls, a: np.ndarray, k: int) -> "Bisection":
        """Lines 1-3: mean and max of the finite magnitudes (mean clamped to <= max)."""
        finite = a[np.isfinite(a)]
        u = float(finite.max()) if finite.size else 0.0
        mean = min(finite_sum(a) / finite.size, u) if finite.size else 0.0
        return cls(mean=mean, span=u - mean, k=k, k2=a.size)

    def ratio(self) -> float:
        return self.lo + (self.hi - self.lo) / 2

    def threshold_at(self, ratio: float) -> float:
        return self.mean + ratio * self.span

    def threshold(self) -> float:
        return self.threshold_at(self.ratio())

    def update(self, nnz: int) -> None:
        """Lines 10-23 for the current round, given nnz = count(a >= threshold())."""
        ratio = self.ratio()
        thres = self.threshold_at(ratio)
        if nnz <= self.k:
            self.hi = ratio
            if nnz > self.k1:
                self.k1, self.thres1 = nnz, thres
        else:
            self.lo = ratio
            if nnz < self.k2:
                self.k2, self.thres2 = nnz, thres


def thresholds(a: np.ndarray, k: int, num_samplings: int):
    """The bisection of Algorithm 1 lines 1-24: (thres1, k1, thres2, k2)."""
    bis = Bisection.of(a, k)
    for _ in range(num_samplings):
        bis.update(int(np.count_nonzero(a >= bis.threshold())))
    return bis.thres1, bis.k1, bis.thres2, bis.k2


def mstopk(x: np.ndarray, k: int, num_samplings: int = 30, offset: Optional[int] = None,
           rng: Optional[np.random.Generator] = None) -> Selection:
    """Algorithm 1 with the fixes above. `offset` fixes the window; else drawn from `rng`."""
    x = np.asarray(x)
    d = x.size
    k = min(int(k), d)
    empty = np.zeros(0, np.int64)
    if k == 0:
        return Selection(empty, np.inf, 0.0, empty, empty, None)
    if k == d:
        every = np.arange(d, dtype=np.int64)
        return Selection(every, np.inf, 0.0, every, empty, None)
    a = magnitudes(x)
    thres1, _, thres2, _ = thresholds(a, k, num_samplings)
    above = np.flatnonzero(a >= thres1)
    band = np.flatnonzero((a >= thres2) & (a < thres1))
    if above.size > k:                      # more than k non-finite elements
        above, band, need = empty, above, k
    else:
        need = k - above.size
    if need == 0:
        return Selection(above, thres1, thres2, above, band, None)
    if offset is None:
        offset = int((rng or np.random.default_rng()).integers(0, band.size - need + 1))
    if not 0 <= offset <= band.size - need:
        raise ValueError(f"offset {offset} outside 0..{band.size - need}")
    indices = np.concatenate([above, band[offset:offset + need]])
    return Selection(indices, thres1, thres2, above, band, offset)
