"""Decoding and resizing: what DataCache keeps in node memory (shi2021 sec. 4.1, Fig. 5).

`decode_image` turns an encoded image into uint8 pixels at the requested resolution. A
JPEG that is at least 2, 4 or 8 times larger than the target in both dimensions is decoded
at that reduced scale by libjpeg itself (`decode_jpeg(ratio=...)`), which costs a fraction
of a full decode: low-resolution phases of progressive resizing (sec. 5.6) decode cheaply.
The result is then resized (bilinear, antialiased) to exactly (height, width). The same
function is used in and out of DataCache, so cached samples equal directly decoded ones.
"""
from __future__ import annotations

import functools
import threading
from typing import Optional, Tuple, Union

import tensorflow as tf

__all__ = ["decode_image", "normalize_resolution"]

Resolution = Optional[Tuple[int, int]]
_RATIOS = (1, 2, 4, 8)


def normalize_resolution(resolution: Union[None, int, Tuple[int, int]], name: str = "resolution") -> Resolution:
    """None, an int (square) or (height, width), checked."""
    if resolution is None:
        return None
    if isinstance(resolution, int):
        resolution = (resolution, resolution)
    try:
        h, w = (int(v) for v in resolution)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be None, an int or (height, width), got {resolution!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must be positive, got {resolution!r}")
    return h, w


def _resize(image: tf.Tensor, resolution: Tuple[int, int]) -> tf.Tensor:
    resized = tf.image.resize(image, resolution, method="bilinear", antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)


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


_decoders: dict = {}
_decoders_lock = threading.Lock()


def compiled_decoder(resolution: Resolution, channels: int):
    """`decode_image` for one resolution, traced once (one call instead of ~15 eager ops);
    safe to call from several threads."""
    key = (resolution, channels)
    with _decoders_lock:
        if key not in _decoders:
            fn = tf.function(functools.partial(decode_image, resolution=resolution, channels=channels))
            _decoders[key] = fn.get_concrete_function(tf.TensorSpec([], tf.string))
        return _decoders[key]
