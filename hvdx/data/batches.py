"""Resumable training batches for `Model.fit(..., steps_per_epoch=)`: each batch a pure
function of (seed, global step, sample), so a run resumed at any epoch reads and draws what
the uninterrupted run read and drew.

    ds = datacache_batches(cache, 256, 96, first_epoch=epoch, first_step=step, seed=0,
                           num_classes=1000, train=True, augment="rrc", source_resolution=120)
    ds = synthetic_batches(1000, 96, 256, seed=0, first_step=step, rank=rank)   # no data needed

Both yield (float32 images in [-1, 1], one-hot labels) forever.
"""
from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from hvdx.data.augment import augment_batch

__all__ = ["datacache_batches", "synthetic_batches", "to_model_input"]

_FOREVER = 2**62


def to_model_input(images: tf.Tensor, labels: tf.Tensor, num_classes: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """uint8 images to float32 in [-1, 1]; integer labels to one-hot float32 [B, num_classes]
    (label smoothing needs them one-hot)."""
    x = tf.cast(images, tf.float32) / 127.5 - 1.0
    return x, tf.one_hot(tf.cast(labels, tf.int32), num_classes)


def synthetic_batches(num_classes: int, resolution: int, batch_size: int, *, seed: int, first_step: int,
                      rank: int, stream: int = 0) -> tf.data.Dataset:
    """Learnable random data from step `first_step` on: class c's images are a fixed 4 x 4
    colour pattern of class c (from `seed`), upscaled to `resolution`, plus Gaussian noise;
    batch s of `rank` is a pure function of (seed, stream, s, rank). Use one `stream` for
    training and another for validation."""
    patterns = tf.random.stateless_uniform([num_classes, 4, 4, 3], [seed, 99])

    def make(step):
        step_seed = tf.stack([tf.cast(seed * 7919 + stream, tf.int64), step * 1024 + rank])
        labels = tf.random.stateless_uniform([batch_size], step_seed, 0, num_classes, tf.int32)
        base = tf.image.resize(tf.gather(patterns, labels), [resolution, resolution], "nearest")
        noise = tf.random.stateless_normal([batch_size, resolution, resolution, 3], step_seed + 1, stddev=0.3)
        x = tf.clip_by_value(base + noise, 0.0, 1.0) * 2.0 - 1.0
        return x, tf.one_hot(labels, num_classes)

    return tf.data.Dataset.range(first_step, _FOREVER).map(make).prefetch(2)


def datacache_batches(cache, batch_size: int, resolution: int, *, first_epoch: int, first_step: int, seed: int,
                      num_classes: int, train: bool, augment: str = "none", crop_area: float = 0.08,
                      source_resolution: Optional[int] = None) -> tf.data.Dataset:
    """This rank's batches from `cache` (an `hvdx.data.DataCache`) at `resolution`, from
    epoch `first_epoch` (DataCache's (seed, epoch) order) and global step `first_step` on.

    Training batches (`train`) drop the remainder and are augmented by `augment_batch`
    (`augment`, `crop_area`), each sample seeded by (seed, global step, sample id); they are
    read at `source_resolution` (default `resolution`; larger for random-resized crop,
    which cuts its boxes out of that and resizes them to `resolution`). Validation batches
    (not `train`) are read at `resolution`, unaugmented, the last one padded as the cache
    pads it.
    """
    read_at = (source_resolution or resolution) if train else resolution
    ds = cache.dataset(batch_size, resolution=read_at, epochs=None, first_epoch=first_epoch, with_index=True,
                       drop_remainder=train)
    if not train:
        return ds.map(lambda x, y, i: to_model_input(x, y, num_classes)).prefetch(2)

    def augmented(step, batch):
        images, labels, ids = batch
        seeds = tf.stack([tf.fill(tf.shape(ids), step * 1000 + seed), ids], axis=1)
        images = augment_batch(images, seeds, augment, resolution, crop_area)
        return to_model_input(images, labels, num_classes)

    steps = tf.data.Dataset.range(first_step, _FOREVER)
    return tf.data.Dataset.zip((steps, ds)).map(augmented, num_parallel_calls=tf.data.AUTOTUNE,
                                                  deterministic=True).prefetch(2)
