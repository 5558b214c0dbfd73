"""The demo's image data set: scikit-learn's digits as JPEG class folders, the layout
ImageNet ships in (`train/<class>/*.jpg`, `val/<class>/*.jpg`), small enough to write in
seconds, for `DataCache` and the DAWNBench recipe's `make demo`.

    train, val = write_demo_dataset(DEMO_ROOT)     # written once; later calls return the paths
"""
from __future__ import annotations

import os
import shutil
from typing import Tuple

import numpy as np
import tensorflow as tf

__all__ = ["DEMO_ROOT", "write_demo_dataset"]

#: Where the demo keeps its folders (outside any checkout); "-v1" names the data's version.
DEMO_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "hvdx", "dawnbench-demo-v1")


def write_demo_dataset(root: str = DEMO_ROOT, copies: int = 3, size: int = 48, seed: int = 0) -> Tuple[str, str]:
    """Writes scikit-learn's 1797 digits as `size` px RGB JPEGs in class folders "0".."9",
    train/ and val/ under `root`, unless both exist; returns (train, val).

    train: `copies` copies of 75 % of the digits (stratified split, `seed`), each randomly
    scaled (0.7-1.0 of the side), shifted, tinted (ink and paper colours) and noised; val:
    the other 25 %, once, centred at 0.85 of the side, white on black. Atomic: the tree is
    written beside `root` and renamed into place, so concurrent writers (one per node) and
    interrupted runs are safe. Needs scikit-learn.
    """
    train, val = os.path.join(root, "train"), os.path.join(root, "val")
    if os.path.isdir(train) and os.path.isdir(val):
        return train, val
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(digits.images, digits.target, test_size=0.25,
                                                      random_state=seed, stratify=digits.target)
    rng = np.random.default_rng(seed)
    tmp = f"{root}.tmp-{os.getpid()}"

    def write(folder: str, images: np.ndarray, labels: np.ndarray, copies: int, jitter: bool) -> None:
        for label in range(10):
            os.makedirs(os.path.join(tmp, folder, f"{label}"), exist_ok=True)
        for i, (image, label) in enumerate(zip(images, labels)):
            for c in range(copies):
                scale = rng.uniform(0.7, 1.0) if jitter else 0.85
                inner = int(round(size * scale))
                digit = tf.image.resize(image[..., None] / 16.0, [inner, inner], "bicubic").numpy()
                canvas = np.zeros([size, size, 1], np.float32)
                dy, dx = rng.integers(0, size - inner + 1, 2) if jitter else [(size - inner) // 2] * 2
                canvas[dy:dy + inner, dx:dx + inner] = np.clip(digit, 0, 1)
                ink = rng.uniform(0.6, 1.0, 3) if jitter else np.ones(3)
                paper = rng.uniform(0.0, 0.3, 3) if jitter else np.zeros(3)
                rgb = paper + canvas * (ink - paper) + (rng.normal(0, 0.03, [size, size, 3]) if jitter else 0)
                pixels = tf.constant(np.clip(rgb * 255, 0, 255).astype(np.uint8))
                path = os.path.join(tmp, folder, f"{label}", f"{i:05d}-{c}.jpg")
                tf.io.write_file(path, tf.io.encode_jpeg(pixels, quality=90))

    write("train", x_train, y_train, copies, jitter=True)
    write("val", x_val, y_val, 1, jitter=False)
    try:
        os.rename(tmp, root)
    except OSError:  # another node's writer finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return train, val
