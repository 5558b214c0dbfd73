"""Seeded batch augmentation for image training: ImageNet's random-resized crop and mirror,
pad-and-crop, each a pure function of per-sample seeds (a resumed run draws what the
uninterrupted run drew).

    images = augment_batch(images, seeds, "rrc", size=96, min_area=0.08)   # uint8 [B, H, W, C]

DataCache stores samples at one resolution, so random-resized crop reads them at
`source_resolution` (larger than the training resolution) and cuts its boxes out of that.
The crop is bilinear, `tf.image.crop_and_resize`'s arithmetic written with gathers
(`resize_boxes`): the CropAndResize op has no cost model in TensorFlow's graph optimizer,
which logs an error for it in every tf.data function that contains it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["CROP_RATIOS", "KINDS", "augment_batch", "crop_boxes", "pad_and_crop", "random_resized_crop",
           "resize_boxes", "source_resolution"]

#: Random-resized crop's aspect ratios (width / height), log-uniform: ImageNet training's range.
CROP_RATIOS = (3 / 4, 4 / 3)

#: `augment_batch`'s kinds: pad-and-crop + mirror, pad-and-crop, random-resized crop + mirror,
#: random-resized crop, nothing.
KINDS = ("flip", "shift", "rrc", "rrc-noflip", "none")


def source_resolution(resolution: int, kind: str, crop_source: float) -> int:
    """The resolution to read training samples at for `kind` at `resolution` px:
    round(`crop_source` x resolution) for random-resized crop (its boxes are cut out of the
    larger image), else `resolution`."""
    if kind.startswith("rrc"):
        return max(resolution, int(round(crop_source * resolution)))
    return resolution


def crop_boxes(seeds: tf.Tensor, min_area: float) -> Tuple[tf.Tensor, tf.Tensor]:
    """Random-resized crop's boxes, per sample from its seed: area fraction a ~ U(min_area, 1),
    aspect ratio r log-uniform in CROP_RATIOS, sides h = sqrt(a / r), w = sqrt(a r) (each
    clipped to 1), placed uniformly at random in the image.

    Args:
        seeds: int64 [B, 2], one stateless seed per sample.
    Returns:
        (boxes float32 [B, 4] as (y0, x0, y1, x1) fractions of the image, mirror bool [B]: a
        fair coin per sample from the same seed).
    """
    u = tf.map_fn(lambda seed: tf.random.stateless_uniform([5], seed), seeds, fn_output_signature=tf.float32)
    area = min_area + (1.0 - min_area) * u[:, 0]
    low, high = np.log(CROP_RATIOS[0]), np.log(CROP_RATIOS[1])
    ratio = tf.exp(low + (high - low) * u[:, 1])
    h, w = tf.minimum(tf.sqrt(area / ratio), 1.0), tf.minimum(tf.sqrt(area * ratio), 1.0)
    y0, x0 = (1.0 - h) * u[:, 2], (1.0 - w) * u[:, 3]
    return tf.stack([y0, x0, y0 + h, x0 + w], axis=1), u[:, 4] < 0.5


def _sample_points(start: tf.Tensor, end: tf.Tensor, extent: tf.Tensor, size: int):
    """crop_and_resize's sample coordinates along one axis: `size` points from start to end
    (fractions) of an axis of `extent` pixels; returns (lower index, upper index, weight of
    the upper), each [B, size]."""
    last = tf.cast(extent - 1, tf.float32)
    if size > 1:
        scale = (end - start) * last / (size - 1)
        points = start[:, None] * last + tf.range(size, dtype=tf.float32)[None, :] * scale[:, None]
    else:
        points = (0.5 * (start + end) * last)[:, None]
    points = tf.clip_by_value(points, 0.0, last)
    lower = tf.floor(points)
    return tf.cast(lower, tf.int32), tf.cast(tf.math.ceil(points), tf.int32), points - lower


def resize_boxes(images: tf.Tensor, boxes: tf.Tensor, size: int) -> tf.Tensor:
    """Box b of image b resized to size x size, bilinearly: `tf.image.crop_and_resize(images,
    boxes, range(B), [size, size])`'s arithmetic, written with gathers (no CropAndResize op).
    A sample point that rounding puts outside the image takes the edge pixel (crop_and_resize
    would give 0).

    Args:
        images: [B, H, W, C], any real or integer dtype.
        boxes: float32 [B, 4], (y0, x0, y1, x1) as fractions of the image, y0 <= y1, x0 <= x1.
    Returns:
        float32 [B, size, size, C].
    """
    images = tf.cast(images, tf.float32)
    shape = tf.shape(images)
    top, bottom, dy = _sample_points(boxes[:, 0], boxes[:, 2], shape[1], size)
    left, right, dx = _sample_points(boxes[:, 1], boxes[:, 3], shape[2], size)
    dx, dy = dx[:, None, :, None], dy[:, :, None, None]

    def across(rows: tf.Tensor) -> tf.Tensor:  # rows [B, size, W, C] -> [B, size, size, C]
        a = tf.gather(rows, left, axis=2, batch_dims=1)
        return a + (tf.gather(rows, right, axis=2, batch_dims=1) - a) * dx

    upper = across(tf.gather(images, top, axis=1, batch_dims=1))
    return upper + (across(tf.gather(images, bottom, axis=1, batch_dims=1)) - upper) * dy


def random_resized_crop(images: tf.Tensor, seeds: tf.Tensor, size: int, min_area: float = 0.08,
                        flip: bool = True) -> tf.Tensor:
    """ImageNet training's augmentation, per sample and stateless: a `crop_boxes` box of the
    image resized bilinearly to size x size (`resize_boxes`), then mirrored left-right with
    probability 1/2 if `flip`.

    Args:
        images: uint8 [B, H, W, C] (larger than `size`: see `source_resolution`).
        seeds: int64 [B, 2], one seed per sample.
    Returns:
        uint8 [B, size, size, C].
    """
    boxes, mirror = crop_boxes(seeds, min_area)
    out = resize_boxes(images, boxes, size)
    if flip:
        out = tf.where(mirror[:, None, None, None], tf.reverse(out, axis=[2]), out)
    return tf.cast(tf.clip_by_value(tf.round(out), 0.0, 255.0), tf.uint8)


def pad_and_crop(images: tf.Tensor, seeds: tf.Tensor, mirror: bool) -> tf.Tensor:
    """Per sample, stateless: reflect-pad by 1/8 of the side (at least 1 px), crop a random
    window of the original size (a translation), and if `mirror` flip left-right with
    probability 1/2. Same shape and dtype out."""
    size = tf.shape(images)[1:3]
    pad = tf.maximum(size // 8, 1)

    def one(args):
        image, seed = args
        padded = tf.pad(image, [[pad[0], pad[0]], [pad[1], pad[1]], [0, 0]], mode="REFLECT")
        image = tf.image.stateless_random_crop(padded, tf.shape(image), seed)
        if mirror:
            image = tf.image.stateless_random_flip_left_right(image, seed + 1)
        return image

    return tf.map_fn(one, (images, seeds), fn_output_signature=images.dtype)


def augment_batch(images: tf.Tensor, seeds: tf.Tensor, kind: str, size: Optional[int] = None,
                  min_area: float = 0.08) -> tf.Tensor:
    """Per sample, stateless (seeded by `seeds` [B, 2], so a resumed run draws the same):
    "flip" / "shift": `pad_and_crop` with / without the mirror (the size is kept);
    "rrc" / "rrc-noflip": `random_resized_crop` to `size` with / without the mirror;
    "none": unchanged. uint8 in, uint8 out.

    Raises:
        ValueError: a kind not in KINDS, or random-resized crop without `size`.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown augmentation {kind!r}: choose one of {', '.join(KINDS)}")
    if kind == "none":
        return images
    if kind.startswith("rrc"):
        if size is None:
            raise ValueError("random-resized crop needs the output size")
        return random_resized_crop(images, seeds, size, min_area, flip=kind == "rrc")
    return pad_and_crop(images, seeds, mirror=kind == "flip")
