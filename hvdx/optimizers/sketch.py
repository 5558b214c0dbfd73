"""The norms of the ranks' average gradient before aggregating it: an all-reduced CountSketch.

LARS' eq. 11 (shi2021 eq. 11; you2017) scales each layer by eeta ||w|| / ||g|| with g the
gradient averaged over the ranks. Under a sparse strategy the ratio is applied before the
strategy (`LARS.local_trusted`), when that average does not exist yet on any rank. Each rank's
own norm ||g_i|| is larger than ||mean_i g_i|| where the ranks' gradients are mostly noise
(by up to sqrt(N) on N ranks whose gradients are uncorrelated), so a step scaled by it is
smaller than dense LARS' step by that factor.

A CountSketch (Charikar, Chen and Farach-Colton 2002) measures the norm of the average
without sending it: entry j of a layer's gradient goes to bucket h(j) of `width` buckets with
sign s(j), h and s the same on every rank,

    S(g)_b = sum over j with h(j) = b of s(j) g_j,    E ||S(g)||^2 = ||g||^2

(expectation over the hash; the estimate's relative standard deviation is at most
sqrt(2 / width) of ||g||^2, about 1 / sqrt(2 width) of ||g||). S is linear, so the mean over
the ranks of S(g_i) is S(mean_i g_i): one allreduce of `width` numbers per layer gives every
rank the same estimate of ||mean_i g_i||. Layers of at most `width` entries are sent whole
(their norm is exact). Cost per step: one pass over each gradient (the hash is recomputed, not
stored) and one allreduce of sum_l min(n_l, width) floats.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["DEFAULT_WIDTH", "count_sketch", "sketch_width", "averaged_squared_norms"]

#: Buckets per layer: the norm's relative standard deviation is about 4.4 % (1 / sqrt(2 * 256)).
DEFAULT_WIDTH = 256

_MASK32 = (1 << 32) - 1


def sketch_width(size: int, width: int) -> int:
    """How many numbers a layer of `size` entries sends: all of them up to `width`, else `width`."""
    return min(int(size), int(width))


def _hash_constants(layer: int, seed: int) -> np.ndarray:
    """Four odd 32-bit multipliers and offsets of multiply-shift hashing, the same on every rank
    for the same (layer, seed)."""
    return np.random.RandomState((seed * 1_000_003 + layer) % (2 ** 32)).randint(1, 2 ** 31, size=4,
                                                                                  dtype=np.int64) * 2 + 1


def count_sketch(gradient: tf.Tensor, width: int = DEFAULT_WIDTH, layer: int = 0, seed: int = 0) -> tf.Tensor:
    """S(gradient): [sketch_width(size, width)] float32, the gradient itself (flattened) when it
    has at most `width` entries.

    Entry j goes to bucket ((a j + b) mod 2^32) * width >> 32 with sign from the top bit of
    (c j + d) mod 2^32 (multiply-shift hashing; a, b, c, d drawn from (layer, seed)).

    Raises:
      ValueError: width < 1.
    """
    if int(width) < 1:
        raise ValueError(f"width must be at least 1 bucket, got {width!r}")
    flat = tf.reshape(tf.cast(gradient, tf.float32), [-1])
    size = flat.shape[0]
    if size is not None and size <= width:
        return flat
    a, b, c, d = (tf.constant(int(x), tf.int64) for x in _hash_constants(layer, seed))
    j = tf.range(tf.size(flat, out_type=tf.int64), dtype=tf.int64)
    bucket = tf.bitwise.right_shift(tf.bitwise.bitwise_and(a * j + b, _MASK32) * int(width), 32)
    top = tf.bitwise.right_shift(tf.bitwise.bitwise_and(c * j + d, _MASK32), 31)
    signed = flat * (1.0 - 2.0 * tf.cast(top, tf.float32))
    return tf.math.unsorted_segment_sum(signed, bucket, num_segments=int(width))


def averaged_squared_norms(gradients: Sequence[tf.Tensor], width: int = DEFAULT_WIDTH, seed: int = 0,
                           allreduce=None) -> List[tf.Tensor]:
    """Estimates of ||mean over ranks of gradients[l]||^2, float32 scalars, the same on every rank.

    Args:
      gradients: this rank's gradient of each layer (dense, static shapes), in the same order
        on every rank.
      width: buckets per layer (DEFAULT_WIDTH).
      seed: the hash's seed, the same on every rank.
      allreduce: averages a float32 vector over the ranks (e.g. Horovod's allreduce with
        op=Average in the right process set); None: one rank, the sketch of its own gradients.

    Raises:
      ValueError: a gradient without a static size, or width < 1.
    """
    sizes = []
    for g in gradients:
        size = tf.TensorShape(g.shape).num_elements()
        if size is None:
            raise ValueError(f"a gradient of shape {g.shape} has no static size; the sketch needs one per layer")
        sizes.append(sketch_width(size, width))
    if not gradients:
        return []
    sketches = tf.concat([count_sketch(g, width, layer, seed) for layer, g in enumerate(gradients)], axis=0)
    if allreduce is not None:
        sketches = allreduce(sketches)
    return [tf.reduce_sum(tf.square(part)) for part in tf.split(sketches, sizes)]
