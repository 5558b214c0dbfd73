"""DataCache's tf.data pipeline (shi2021 sec. 4.1): a scan over batch numbers calling Python
(a `Reader`) on an epoch's first batch and, in epochs not yet all in memory, on every
batch; then per-sample augmentation over each batch.

With a slab the call plans (and in epoch 1 fills) and returns slots and the slab's arrays,
zero-copy views of the node's mapping, from which `tf.gather` copies out the batch in a
parallel map: from epoch 2 on no Python code touches pixels. Once an epoch is all in the
slab the call returns the whole epoch's ids and slots, carried in the scan's state, and
the other batches are slices of them chosen by a `tf.cond` without Python (32,000 samples,
batches of 64: epochs about 25% shorter than with a call per batch; the cond's
instantiation per iterator costs about 15 ms more, so an epoch of 2,000 samples is about
10% longer). Without a slab the call copies every batch out of the store's values.
docs/datacache.md, "The read path".
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from hvdx import timeline
from hvdx.arguments import integer
from hvdx.data.decode import Resolution
from hvdx.data.reader import EpochPlan, Reader

__all__ = ["PARALLEL", "PREFETCH", "batch_augment", "check_batch_size", "dataset", "steps_per_epoch"]

#: Batches prefetched, and batches gathered or augmented at once: fixed, and tf.data's
#: autotuning is off in the dataset's options (a user's options may turn it on again). With
#: the autotuning thread in the pipeline, deleting an iterator over this scan (Model.fit: one
#: per epoch) took 0.25-0.3 s in about every second epoch (TensorFlow 2.21, 2 cores), as long
#: as a 32,000-sample epoch; without it, under 1 ms. AUTOTUNE in a map a user adds after it
#: then means as many parallel calls as cores.
PREFETCH = 4
PARALLEL = max(1, min(4, os.cpu_count() or 1))


def check_batch_size(batch_size: int) -> int:
    """`batch_size` as a Python int; ValueError unless it is a positive int (NumPy's too)."""
    return integer(batch_size, "batch_size", 1, expected="a positive int")


def steps_per_epoch(per_rank: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Batches of `batch_size` in a share of `per_rank` samples (the last one partial unless
    `drop_remainder`). Raises ValueError for a bad batch size."""
    batch_size = check_batch_size(batch_size)
    return per_rank // batch_size if drop_remainder else math.ceil(per_rank / batch_size)


def dataset(reader: Reader, batch_size: int, resolution: Resolution, *,
            augment: Optional[Callable[[tf.Tensor], tf.Tensor]] = None, epochs: Optional[int] = 1,
            first_epoch: int = 0, drop_remainder: bool = False, with_index: bool = False,
            compile_augment: bool = True, prefetch: int = PREFETCH) -> tf.data.Dataset:
    """Batches (images uint8 [B, h, w, c], labels int64 [B]) (+ sample ids [B] with
    `with_index`) of `reader`'s share at `resolution`, `epochs` epochs per iteration (None:
    forever), each iteration continuing with the next epoch from `first_epoch` on; see
    `DataCache.dataset`. The arguments are checked by the caller."""
    counter = itertools.count(first_epoch)
    counter_lock = threading.Lock()
    h, w = resolution if resolution is not None else (None, None)
    c = reader.channels
    split = reader.split
    per_rank = split.per_rank
    steps = steps_per_epoch(per_rank, batch_size, drop_remainder)
    usable = per_rank - per_rank % batch_size if drop_remainder else per_rank
    slab = reader.slab(resolution)
    if resolution is not None:
        reader.loader.decode_graph(resolution)  # traced now, not in epoch 1
    plans: Dict[int, Tuple[EpochPlan, np.ndarray]] = {}  # by epoch: the plan, the batches' slots
    finishing: set = set()  # epochs whose last batch is being read: their leftovers follow it

    def batch_of(state: np.ndarray, step: np.ndarray) -> Tuple[int, np.ndarray, bool, np.ndarray]:
        """(epoch, the batch's samples, whether the epoch is all in the slab, their slots).
        The first batch of an epoch takes the next epoch number and plans it."""
        if reader.split is not split:
            raise ValueError("this DataCache dataset was made before an elastic reset split the data again for the "
                             "new ranks: make the dataset again after the reset (inside the function "
                             "hvd.elastic.run wraps)")
        k = int(step) % steps
        if k == 0:
            with counter_lock:
                epoch = next(counter)
            plan = reader.start_epoch(epoch, resolution)
            plan = plan._replace(samples=plan.samples[:usable])
            slots = slab.slots(plan.samples) if plan.in_slab else plan.samples
            with counter_lock:
                plans[epoch] = (plan, slots)
                for old in [e for e in plans if e < epoch - 64]:  # iterations abandoned mid-epoch
                    del plans[old]
            if plan.in_slab:
                reader.store.count_hits(len(plan.samples))
        else:
            epoch = int(state)
        plan, slots = plans[epoch]
        if k == steps - 1 and plan.leftovers:  # after this batch: their decode errors belong to this epoch
            finishing.add(epoch)
        part = slice(k * batch_size, (k + 1) * batch_size)
        return epoch, plan.samples[part], plan.in_slab, slots[part]

    def finish(epoch: int) -> None:
        if epoch in finishing:
            finishing.discard(epoch)
            reader.finish_epoch(plans[epoch][0], resolution)

    def slab_step(state: np.ndarray, step: np.ndarray):
        """(epoch, base, warm, ids, slots, pixels, labels): with `warm` (the epoch is all in
        the slab and has no leftovers to wait for: called on its first batch only) the
        whole epoch's ids and slots, the batches being their slices from `base` = 0;
        otherwise this batch's (filled first), at `base` = its offset in the epoch."""
        epoch, samples, in_slab, slots = batch_of(state, step)
        plan, epoch_slots = plans[epoch]
        warm = in_slab and not plan.leftovers
        if warm:
            base, samples, slots = 0, plan.samples, epoch_slots
        else:
            base = int(step) % steps * batch_size
            if not in_slab:
                with timeline.python_span("datacache", "slab", "fill a batch (decode or copy in)"):
                    samples = reader.fill_slab(samples, resolution, slab)
                slots = slab.slots(samples)
            finish(epoch)
        # the slab's arrays are zero-copy views of the node's mapping: TensorFlow takes them
        # over without copying, and tf.gather copies out only the batch
        return np.int64(epoch), np.int64(base), np.bool_(warm), samples, slots, slab.pixels, slab.labels

    def read_step(state: np.ndarray, step: np.ndarray):
        epoch, samples, _, _ = batch_of(state, step)
        images, labels, ids = reader.read_values(samples, resolution)
        finish(epoch)
        return np.int64(epoch), ids, images, labels

    # The scan's state: (epoch, base, warm, ids, slots, pixels, labels), see slab_step. The
    # pixels are gathered by TF in a parallel map after the scan: a batch's copy overlaps the
    # scan's next step.
    @tf.autograph.experimental.do_not_convert
    def from_slab(state: Tuple[tf.Tensor, ...], step: tf.Tensor):
        epoch, base, warm = state[:3]
        k = step % steps

        def plan_or_fill():
            out = tf.numpy_function(slab_step, [epoch, step],
                                    [tf.int64, tf.int64, tf.bool, tf.int64, tf.int64, tf.uint8, tf.int64],
                                    stateful=True)
            for t, shape in zip(out, ([], [], [], [None], [None], [None, h, w, c], [None])):
                t.set_shape(shape)
            return tuple(out)

        # Python on an epoch's first batch, and on every batch of an epoch not all in the slab
        state = tf.cond(tf.logical_or(tf.equal(k, 0), tf.logical_not(warm)), plan_or_fill, lambda: tuple(state))
        epoch, base, warm, ids, slots, pixels, labels = state
        part = slice(k * batch_size - base, (k + 1) * batch_size - base)
        return state, (slots[part], pixels, labels, ids[part])

    @tf.autograph.experimental.do_not_convert
    def gather(slots: tf.Tensor, pixels: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
        pixels.set_shape([None, h, w, c])
        return _batch(tf.gather(pixels, slots), tf.gather(labels, slots), ids)

    @tf.autograph.experimental.do_not_convert
    def from_values(state: tf.Tensor, step: tf.Tensor):
        epoch, ids, images, labels = tf.numpy_function(
            read_step, [state, step], [tf.int64, tf.int64, tf.uint8, tf.int64], stateful=True)
        epoch.set_shape([])
        return epoch, _batch(images, labels, ids)

    def _batch(images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
        images.set_shape([None, h, w, c])  # (a gather by slots of unknown shape has none)
        labels.set_shape([None])
        ids.set_shape([None])
        return (images, labels, ids) if with_index or augment is not None else (images, labels)

    total = steps * epochs if epochs is not None else 2**62
    if slab is not None:
        ds = tf.data.Dataset.range(total).scan(
            (tf.constant(-1, tf.int64), tf.constant(0, tf.int64), tf.constant(False), tf.zeros([0], tf.int64),
             tf.zeros([0], tf.int64), tf.zeros([0, h, w, c], tf.uint8), tf.zeros([0], tf.int64)), from_slab)
        ds = ds.map(gather, num_parallel_calls=PARALLEL, deterministic=True)
    else:
        ds = tf.data.Dataset.range(total).scan(tf.constant(-1, tf.int64), from_values)
    if augment is not None:  # per sample, over the batch (no unbatching and batching again), in parallel
        per_batch = batch_augment(augment, (batch_size, h, w, c), compile_augment)

        @tf.autograph.experimental.do_not_convert
        def augmented(images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
            images = per_batch(images)
            return (images, labels, ids) if with_index else (images, labels)

        ds = ds.map(augmented, num_parallel_calls=PARALLEL, deterministic=True)
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.prefetch(prefetch).with_options(options)


def batch_augment(augment: Callable, shape: Tuple, compile_augment: bool) -> Callable[[tf.Tensor], tf.Tensor]:
    """`augment` applied to every sample of a batch of `shape` ([B, h, w, c]): `tf.map_fn`
    (a random op draws per sample), compiled with XLA when asked and XLA has every op (a
    batch then runs as one fused computation; compiled on the first batch of each shape).
    An augmentation XLA cannot compile runs uncompiled, with a RuntimeWarning."""
    sample = tf.TensorSpec(shape[1:], tf.uint8)
    out = tf.function(augment).get_concrete_function(sample).structured_outputs
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), out)
    signature = [tf.TensorSpec([None, *shape[1:]], tf.uint8)]

    def per_batch(images: tf.Tensor):
        return tf.map_fn(augment, images, fn_output_signature=spec)

    if compile_augment and None not in shape:
        compiled = tf.function(per_batch, input_signature=signature, jit_compile=True)
        try:  # lowered to XLA's HLO (not run, not compiled yet): fails here if XLA lacks an op
            compiled.experimental_get_compiler_ir(tf.zeros(shape, tf.uint8))(stage="hlo")
            return compiled
        except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as exc:
            message = getattr(exc, "message", str(exc)).strip().splitlines()[0]
            warnings.warn(f"hvdx.data: augment cannot be compiled with XLA ({message}); it runs uncompiled",
                          RuntimeWarning, stacklevel=4)
    return tf.function(per_batch, input_signature=signature)
