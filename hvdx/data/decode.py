"""Decoding and resizing: what DataCache keeps in node memory (shi2021 sec. 4.1, Fig. 5).

`decode_image` turns an encoded image into uint8 pixels at the requested resolution. A
JPEG that is at least 2, 4 or 8 times larger than the target in both dimensions is decoded
at that reduced scale by libjpeg itself (`decode_jpeg(ratio=...)`), which costs a fraction
of a full decode: low-resolution phases of progressive resizing (sec. 5.6) decode cheaply.
The result is then resized (bilinear) to exactly (height, width). The same
function is used in and out of DataCache, so cached samples equal directly decoded ones.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdx.arguments import is_integer

__all__ = ["DECODER", "decode_image", "decode_image_eager", "normalize_resolution"]

DECODER = "tf.io.decode_image|jpeg-ratio-1248|resize-bilinear-round|uint8"
"""The decoder's identity (how `decode_image` turns bytes into pixels): part of a node
store's identity, so that a change of method, rounding or dtype rebuilds stores made by the
old one. Change it whenever `decode_image`'s output changes."""

Resolution = Optional[Tuple[int, int]]
_RATIOS = (1, 2, 4, 8)


def normalize_resolution(resolution: Union[None, int, Tuple[int, int]], name: str = "resolution") -> Resolution:
    """None, an int (square) or (height, width), checked."""
    if resolution is None:
        return None
    if is_integer(resolution):
        resolution = (resolution, resolution)
    try:
        h, w = (int(v) for v in resolution)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be None, an int or (height, width), got {resolution!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must be positive, got {resolution!r}")
    return h, w


def _resize(image: tf.Tensor, resolution: Tuple[int, int]) -> tf.Tensor:
    """Bilinear resize to `resolution`, rounded; an image already at that size is kept as is.
    (A JPEG decoded at reduced scale is less than twice the target: no antialiasing needed.)"""
    def resize() -> tf.Tensor:
        resized = tf.image.resize(image, resolution, method="bilinear")
        return tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)

    if tf.executing_eagerly():
        return image if tuple(image.shape[:2]) == tuple(resolution) else resize()
    same = tf.reduce_all(tf.equal(tf.shape(image)[:2], resolution))
    return tf.cond(same, lambda: image, resize)


def _decode_jpeg(data: tf.Tensor, resolution: Tuple[int, int], channels: int) -> tf.Tensor:
    shape = tf.io.extract_jpeg_shape(data)
    h, w = resolution
    # The largest ratio at which libjpeg's output (ceil(size / ratio)) still covers the target.
    fits = [tf.logical_and((shape[0] + r - 1) // r >= h, (shape[1] + r - 1) // r >= w) for r in _RATIOS]
    index = tf.reduce_max(tf.where(tf.stack(fits), tf.range(len(_RATIOS)), 0))
    branches = [functools.partial(tf.io.decode_jpeg, data, channels=channels, ratio=r) for r in _RATIOS]
    return tf.switch_case(index, branches)


def decode_image(data: tf.Tensor, resolution: Union[None, int, Tuple[int, int]] = None, channels: int = 3) -> tf.Tensor:
    """uint8 [height, width, channels] pixels of an encoded image (JPEG, PNG, BMP, GIF),
    resized to `resolution` ((height, width) or an int) unless it is None."""
    resolution = normalize_resolution(resolution)
    data = tf.convert_to_tensor(data, tf.string)
    if resolution is None:
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
        return tf.ensure_shape(image, [None, None, channels])

    def other() -> tf.Tensor:
        return tf.io.decode_image(data, channels=channels, expand_animations=False)

    image = tf.cond(tf.io.is_jpeg(data), lambda: _decode_jpeg(data, resolution, channels), other)
    image.set_shape([None, None, channels])
    return tf.ensure_shape(_resize(image, resolution), [*resolution, channels])


def decode_image_eager(data: bytes, resolution: Resolution, channels: int = 3) -> np.ndarray:
    """`decode_image` for Python threads (DataCache's readers): the same kernels with the same
    arguments, so the same pixels, run eagerly in the calling thread. (A tf.function would
    run on TensorFlow's inter-op pool, which tf.data's own threads may all be occupying.)"""
    if resolution is None or data[:3] != b"\xff\xd8\xff":
        return decode_image(data, resolution, channels).numpy()
    tensor = tf.constant(data)
    height, width = (int(v) for v in tf.io.extract_jpeg_shape(tensor).numpy()[:2])
    h, w = resolution
    ratio = max(r for r in _RATIOS if -(-height // r) >= h and -(-width // r) >= w) if (
        height >= h and width >= w) else 1
    return _resize(tf.io.decode_jpeg(tensor, channels=channels, ratio=ratio), resolution).numpy()
