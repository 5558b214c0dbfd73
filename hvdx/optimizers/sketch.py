"""The norms of the ranks' average gradient before aggregating it: an all-reduced CountSketch.

LARS' eq. 11 (shi2021 eq. 11; you2017) scales each layer by eeta ||w|| / ||g|| with g the
gradient averaged over the ranks. Under a sparse strategy the ratio is applied before the
strategy (`LARS.local_trusted`), when that average does not exist yet on any rank. Each rank's
own norm ||g_i|| is larger than ||mean_i g_i|| where the ranks' gradients are mostly noise
(by up to sqrt(N) on N ranks whose gradients are uncorrelated), so a step scaled by it is
smaller than dense LARS' step by that factor.

A CountSketch (Charikar, Chen and Farach-Colton 2002) measures the norm of the average
without sending it: entry j of a layer's gradient goes with a pseudo-random sign s(j) (a hash
of j, the same on every rank) into bucket j mod `width`,

    S(g)_b = sum over j = b mod width of s(j) g_j,    E ||S(g)||^2 = ||g||^2

(expectation over the signs; the estimate's relative standard deviation is about
sqrt(2 / width) of ||g||^2, 1 / sqrt(2 width) of ||g||, where no bucket holds much more than
its share of the energy: the width is prime so that it mixes the power-of-two strides of the
layers' layouts). S is linear, so the mean over the ranks of S(g_i) is S(mean_i g_i): one
allreduce of `width` numbers per layer gives every rank the same estimate of ||mean_i g_i||.
Layers of at most `width` entries are sent whole (their norm is exact). Cost per step: one pass
over each gradient (the signs are recomputed, not stored; no scatter) and one allreduce of
sum_l min(n_l, width) floats.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["DEFAULT_WIDTH", "averaged_squared_norms", "count_sketch", "negative_signs"]

#: Buckets per layer, a prime: entry j goes to bucket j mod width, which then mixes the
#: power-of-two strides of the layers' layouts (output channels) into every bucket. The norm's
#: relative spread is about 4.5 % (1 / sqrt(2 * 251)).
DEFAULT_WIDTH = 251

# murmur3's 32-bit finaliser (as signed int32: TensorFlow multiplies int32 modulo 2^32)
_FMIX = (-2048144789, -1028477387)  # 0x85ebca6b, 0xc2b2ae35


def _start(layer: int, seed: int) -> Tuple[int, int]:
    """An odd multiplier and an offset (int32) for the layer's entry indices, the same on every
    rank for the same (layer, seed)."""
    a, b = (int(x) for x in np.random.RandomState((seed * 1_000_003 + layer) % (2 ** 32)).randint(
        0, 2 ** 32, size=2, dtype=np.uint64))
    return int(np.uint32(a | 1).view(np.int32)), int(np.uint32(b).view(np.int32))


def _shift(x: tf.Tensor, bits: int) -> tf.Tensor:
    """x >> bits as unsigned 32-bit integers (TensorFlow's right_shift of int32 keeps the sign)."""
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, bits), (1 << (32 - bits)) - 1)


def negative_signs(count: int, layer: int = 0, seed: int = 0) -> tf.Tensor:
    """[count] bool, True where entry j of the layer gets sign -1: the top bit of murmur3's
    finaliser of (a j + b) mod 2^32 (a, b drawn from (layer, seed))."""
    a, b = _start(layer, seed)
    x = tf.range(count, dtype=tf.int32) * a + b
    x = tf.bitwise.bitwise_xor(x, _shift(x, 16)) * _FMIX[0]
    x = tf.bitwise.bitwise_xor(x, _shift(x, 13)) * _FMIX[1]
    return tf.bitwise.bitwise_xor(x, _shift(x, 16)) < 0


def count_sketch(gradient: tf.Tensor, width: int = DEFAULT_WIDTH, layer: int = 0, seed: int = 0) -> tf.Tensor:
    """S(gradient): [min(size, width)] float32, the gradient itself (flattened) when it has at
    most `width` entries; else entry j, with its sign (`negative_signs`), is added into bucket
    j mod width. One pass over the gradient, no scatter.

    Raises:
      ValueError: width < 1, or a gradient without a static size or of 2^31 entries or more
        (the hash counts entries in int32).
    """
    if int(width) < 1:
        raise ValueError(f"width must be at least 1 bucket, got {width!r}")
    size = tf.TensorShape(gradient.shape).num_elements()
    if size is None:
        raise ValueError(f"a gradient of shape {gradient.shape} has no static size; the sketch needs one per layer")
    if size >= 2 ** 31:
        raise ValueError(f"a gradient of {size} entries: the sketch hashes at most 2^31 - 1 per layer; use "
                         "trust_norms='rank' for this model")
    flat = tf.reshape(tf.cast(gradient, tf.float32), [-1])
    if size <= width:
        return flat
    signed = tf.where(negative_signs(size, layer, seed), -flat, flat)
    rows = -(-size // int(width))
    if rows * width != size:
        signed = tf.pad(signed, [[0, rows * width - size]])
    return tf.reduce_sum(tf.reshape(signed, [rows, int(width)]), axis=0)


def averaged_squared_norms(gradients: Sequence[tf.Tensor], width: int = DEFAULT_WIDTH, seed: int = 0,
                           allreduce: Optional[Callable[[tf.Tensor], tf.Tensor]] = None) -> List[tf.Tensor]:
    """Estimates of ||mean over ranks of gradients[l]||^2, float32 scalars, the same on every rank.

    Args:
      gradients: this rank's gradient of each layer (dense, static shapes), in the same order
        on every rank.
      width: buckets per layer (DEFAULT_WIDTH).
      seed: the hash's seed, the same on every rank.
      allreduce: averages a float32 vector over the ranks (e.g. Horovod's allreduce with
        op=Average in the right process set); None: one rank, the sketch of its own gradients.

    Raises:
      ValueError: as `count_sketch`.
    """
    if not gradients:
        return []
    parts = [count_sketch(g, width, layer, seed) for layer, g in enumerate(gradients)]
    sketches = tf.concat(parts, axis=0)
    if allreduce is not None:
        sketches = allreduce(sketches)
    return [tf.reduce_sum(tf.square(part)) for part in tf.split(sketches, [int(p.shape[0]) for p in parts])]
