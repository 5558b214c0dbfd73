"""The digits task the multi-rank checks train on: scikit-learn's digits and a small MLP."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def split(shape: Sequence[int] = (64,)):
    """Digits as float32 in [0, 1] reshaped to `shape` per sample, 75/25 stratified (seed 0).

    Returns:
      x_train, x_test, y_train, y_test (train_test_split's order).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32).reshape(-1, *shape)
    return train_test_split(x, data.target, test_size=0.25, random_state=0, stratify=data.target)


def mlp(seed: int = 0, width: int = 64):
    """64 inputs -> `width` ReLU units -> 10 logits, its weights seeded by `seed` (hvdx.zoo.mlp)."""
    from hvdx.zoo import mlp

    return mlp(64, (width,), seed=seed)
