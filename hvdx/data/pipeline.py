"""DataCache's tf.data pipeline (shi2021 sec. 4.1): one element per epoch, a Python call
(a `Reader`) that plans it, then the epoch's batches; then per-sample augmentation over
each batch.

With a slab an epoch all in the slab (epoch 2 on) is planned whole: the call returns the
epoch's slots and ids as a [batches, batch_size] array (and the partial last batch) and the
slab's arrays, zero-copy views of the node's mapping; the batches are its rows
(`from_tensor_slices`) and `tf.gather` copies the pixels out in a parallel map: no Python
per batch, no Python code touching pixels. An epoch not all in the slab (epoch 1, or one
with leftovers to wait for) calls Python on every batch, which fills the slab first.
Without a slab the call per batch copies the batch out of the store's values. Its functions
are single-device functions (`single_device`): a new iterator instantiates them without
graph optimization. docs/datacache.md, "The read path".
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
from hvdx.data import single_device
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

    def check_split() -> None:
        if reader.split is not split:
            raise ValueError("this DataCache dataset was made before an elastic reset split the data again for the "
                             "new ranks: make the dataset again after the reset (inside the function "
                             "hvd.elastic.run wraps)")

    def begin_epoch() -> Tuple[int, EpochPlan, np.ndarray]:
        """Takes the next epoch number and plans it: (epoch, plan, the samples' slots)."""
        check_split()
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
        return epoch, plan, slots

    def batch_of(epoch: np.ndarray, step: np.ndarray) -> Tuple[int, np.ndarray, EpochPlan, np.ndarray]:
        """(epoch, the samples of its batch `step`, its plan, their slots)."""
        check_split()
        epoch, k = int(epoch), int(step)
        plan, slots = plans[epoch]
        if k == steps - 1 and plan.leftovers:  # after this batch: their decode errors belong to this epoch
            finishing.add(epoch)
        part = slice(k * batch_size, (k + 1) * batch_size)
        return epoch, plan.samples[part], plan, slots[part]

    def finish(epoch: int) -> None:
        if epoch in finishing:
            finishing.discard(epoch)
            reader.finish_epoch(plans[epoch][0], resolution)

    empty = np.zeros([0, batch_size], np.int64)
    full = usable // batch_size  # whole batches; a partial one follows when usable is not a multiple

    def slab_epoch(_: np.ndarray):
        """(epoch, planned slots [W, B] and ids [W, B], the partial last batch's [t, r] (t: 0
        or 1), batches read by a call each, pixels, labels). An epoch all in the slab and
        without leftovers to wait for (`warm`) is planned whole: W = its whole batches, no
        call per batch; any other epoch is read by a call per batch (W = 0)."""
        epoch, plan, slots = begin_epoch()
        if plan.in_slab and not plan.leftovers:
            cut = full * batch_size
            rest = usable - cut
            tail = (1, rest) if rest else (0, 0)
            planned = (slots[:cut].reshape(full, batch_size), plan.samples[:cut].reshape(full, batch_size),
                       slots[cut:].reshape(tail), plan.samples[cut:].reshape(tail))
            called = 0
        else:
            planned, called = (empty, empty, empty[:, :0], empty[:, :0]), steps
        # the slab's arrays are zero-copy views of the node's mapping: TensorFlow takes them
        # over without copying, and tf.gather copies out only the batch
        return (np.int64(epoch), *planned, np.int64(called), slab.pixels, slab.labels)

    def slab_batch(epoch: np.ndarray, step: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(slots, ids) of one batch of an epoch not read whole: its samples are put into the
        slab first (decoded or copied in) unless the plan found them there."""
        epoch, samples, plan, slots = batch_of(epoch, step)
        if not plan.in_slab:
            with timeline.python_span("datacache", "slab", "fill a batch (decode or copy in)"):
                samples = reader.fill_slab(samples, resolution, slab)
            slots = slab.slots(samples)
        finish(epoch)
        return slots, samples

    def values_epoch(_: np.ndarray) -> np.ndarray:
        return np.int64(begin_epoch()[0])

    def values_batch(epoch: np.ndarray, step: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, samples, _, _ = batch_of(epoch, step)
        images, labels, ids = reader.read_values(samples, resolution)
        finish(epoch)
        return images, labels, ids

    # One element per epoch (the Python call that plans it), then its batches: from_tensor_slices
    # of the planned ones, a call per batch for the others.
    def python(fn: Callable, inputs, dtypes, shapes) -> Tuple[tf.Tensor, ...]:
        """`fn` called on `inputs` by tf.numpy_function, its outputs given `shapes`."""
        out = tf.numpy_function(fn, inputs, dtypes, stateful=True)
        for t, shape in zip(out, shapes):
            t.set_shape(shape)
        return tuple(out)

    def read_by_call(epoch: tf.Tensor, count: tf.Tensor, fn: Callable, dtypes, shapes) -> tf.data.Dataset:
        return single_device.map(tf.data.Dataset.range(count), tf.autograph.experimental.do_not_convert(
            lambda step: python(fn, [epoch, step], dtypes, shapes)))

    @tf.autograph.experimental.do_not_convert
    def slab_plan(epoch: tf.Tensor):
        return python(slab_epoch, [epoch], [tf.int64] * 6 + [tf.uint8, tf.int64],
                      ([], [None, batch_size], [None, batch_size], [None, None], [None, None], [], [None, h, w, c],
                       [None]))

    @tf.autograph.experimental.do_not_convert
    def slab_batches(epoch, slots, ids, tail_slots, tail_ids, count, pixels, labels) -> tf.data.Dataset:
        planned = tf.data.Dataset.from_tensor_slices((slots, ids)).concatenate(
            tf.data.Dataset.from_tensor_slices((tail_slots, tail_ids)))
        called = read_by_call(epoch, count, slab_batch, [tf.int64, tf.int64], ([None], [None]))
        return tf.data.Dataset.zip((planned.concatenate(called), tf.data.Dataset.from_tensors((pixels, labels)).repeat()))

    @tf.autograph.experimental.do_not_convert
    def gather(batch: Tuple[tf.Tensor, tf.Tensor], arrays: Tuple[tf.Tensor, tf.Tensor]):
        (slots, ids), (pixels, labels) = batch, arrays
        return _batch(tf.gather(pixels, slots), tf.gather(labels, slots), ids)

    @tf.autograph.experimental.do_not_convert
    def values_plan(epoch: tf.Tensor):
        return python(values_epoch, [epoch], [tf.int64], ([],))[0]

    @tf.autograph.experimental.do_not_convert
    def values_batches(epoch: tf.Tensor) -> tf.data.Dataset:
        return read_by_call(epoch, tf.constant(steps, tf.int64), values_batch, [tf.uint8, tf.int64, tf.int64],
                            ([None, h, w, c], [None], [None]))

    def _batch(images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
        images.set_shape([None, h, w, c])  # (a gather by slots of unknown shape has none)
        labels.set_shape([None])
        ids.set_shape([None])
        return (images, labels, ids) if with_index or augment is not None else (images, labels)

    count = (epochs if epochs is not None else 2**62) if steps else 0
    epochs_ds = tf.data.Dataset.range(count)
    if slab is not None:
        ds = single_device.flat_map(single_device.map(epochs_ds, slab_plan), slab_batches)
        ds = single_device.map(ds, gather, PARALLEL)
    else:
        ds = single_device.map(single_device.flat_map(single_device.map(epochs_ds, values_plan), values_batches),
                               _batch)
    if augment is not None:  # per sample, over the batch (no unbatching and batching again), in parallel
        per_batch = batch_augment(augment, (batch_size, h, w, c), compile_augment)

        @tf.autograph.experimental.do_not_convert
        def augmented(images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
            images = per_batch(images)
            return (images, labels, ids) if with_index else (images, labels)

        ds = ds.map(augmented, num_parallel_calls=PARALLEL, deterministic=True)
    options = tf.data.Options()
    options.autotune.enabled = False
    # tf.data's default graph rewrites find nothing to fuse or parallelize here, and looking
    # costs a new process' first iterator a rewrite of the whole pipeline (a user's options
    # may turn them on again for what they add after it)
    options.experimental_optimization.apply_default_optimizations = False
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
