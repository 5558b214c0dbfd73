"""`tf.keras.datasets.mnist.load_data()` without a download: scikit-learn's bundled 8x8
digits, scaled to 28x28 uint8 images (3x3 blocks, 2 pixels of border), split 75/25; with
$HVDX_DIGITS_PIXELS=8 the 8x8 images as they are (what a user who feeds the digits writes)."""
import os

import numpy as np
from sklearn.datasets import load_digits


def load_data(path=None):
    digits = load_digits()
    pixels = os.environ.get("HVDX_DIGITS_PIXELS", "28")
    if pixels not in ("8", "28"):
        raise ValueError(f"HVDX_DIGITS_PIXELS must be 8 or 28, got {pixels!r}")
    images = digits.images * (255.0 / 16.0)
    if pixels == "28":
        images = np.pad(np.kron(images, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    images = images.astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    cut = len(images) * 3 // 4
    return (images[:cut], labels[:cut]), (images[cut:], labels[cut:])


def seed(rank):
    """Seeds Python, NumPy and TensorFlow with $HVDX_SEED + rank when $HVDX_SEED is set
    (benchmarks/horovod_examples.py: every method of a seed draws the same initial weights,
    shuffles and dropout masks); otherwise does nothing, as the unseeded example."""
    import os

    if "HVDX_SEED" in os.environ:
        import tensorflow as tf

        tf.keras.utils.set_random_seed(int(os.environ["HVDX_SEED"]) + rank)


def report(model, rank):
    """Rank 0 writes the model's accuracy on the test split to $HVDX_RESULT_FILE (JSON), when set."""
    import json
    import os

    path = os.environ.get("HVDX_RESULT_FILE")
    if rank != 0 or not path:
        return
    _, (images, labels) = load_data()
    probs = model(images[..., None].astype(np.float32) / 255.0, training=False)
    accuracy = float(np.mean(np.argmax(np.asarray(probs), axis=1) == labels))
    with open(path, "w") as f:
        json.dump({"accuracy": accuracy}, f)
