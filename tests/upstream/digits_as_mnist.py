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
