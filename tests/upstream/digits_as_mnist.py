"""`tf.keras.datasets.mnist.load_data()` without a download: scikit-learn's bundled 8x8
digits, scaled to 28x28 uint8 images (3x3 blocks, 2 pixels of border), split 75/25."""
import numpy as np
from sklearn.datasets import load_digits


def load_data(path=None):
    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3))) * (255.0 / 16.0)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).astype(np.uint8)
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
