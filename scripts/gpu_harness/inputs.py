"""The inputs the kernels are checked on: the distributions of benchmarks/topk.py's
Figure 6 (normal, Laplace, Student-t(3), Cauchy) and the edge cases of the op tests
(exact zeros, ties, NaN/Inf), as float32 NumPy arrays, reproducible from a seed."""
from __future__ import annotations

import numpy as np

FIGURE6 = ["normal", "laplace", "student_t3", "cauchy"]
EDGE = ["zeros", "many_zeros", "ties", "nonfinite", "many_nonfinite"]
DISTRIBUTIONS = FIGURE6 + EDGE


def make(name: str, d: int, seed: int = 0) -> np.ndarray:
    """d float32 elements of distribution `name` (one of DISTRIBUTIONS).

    zeros: all +0.0; many_zeros: 90 % exact zeros, Student-t(2) elsewhere (dead units);
    ties: normal rounded to multiples of 0.5 (few distinct magnitudes); nonfinite: normal
    with NaN, +Inf and -Inf at d/500 places each; many_nonfinite: 30 % NaN, 10 % -Inf.
    Raises ValueError for an unknown name.
    """
    rng = np.random.default_rng(seed)
    if name == "zeros":
        return np.zeros(d, np.float32)
    if name == "normal":
        x = rng.standard_normal(d, np.float32)
    elif name == "laplace":
        x = rng.laplace(0.0, 1.0, d).astype(np.float32)
    elif name == "student_t3":
        x = rng.standard_t(3, d).astype(np.float32)
    elif name == "cauchy":
        x = rng.standard_cauchy(d).astype(np.float32)
    elif name == "many_zeros":
        x = np.where(rng.random(d, np.float32) < 0.9, np.float32(0), rng.standard_t(2, d).astype(np.float32))
    elif name == "ties":
        x = np.round(rng.standard_normal(d, np.float32) * 2) / 2
    elif name == "nonfinite":
        x = rng.standard_normal(d, np.float32)
        for value in (np.nan, np.inf, -np.inf):
            x[rng.integers(0, d, max(1, d // 500))] = value
    elif name == "many_nonfinite":
        x = rng.standard_normal(d, np.float32)
        x[rng.random(d, np.float32) < 0.3] = np.nan
        x[rng.random(d, np.float32) < 0.1] = -np.inf
    else:
        raise ValueError(f"unknown distribution {name!r}; one of {', '.join(DISTRIBUTIONS)}")
    return np.ascontiguousarray(x, np.float32)
