"""Samples read through level 1 and decoded (shi2021 sec. 4.1: what the node store is filled
with): one at a time in a Python thread, or many in order by a tf.data pipeline of their own,
with the error policy for undecodable files (`on_error`: raise naming the file, or skip it,
naming it in `skipped` with one warning).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdx.data.catalog import ImageFolder, TFRecordShards
from hvdx.data.decode import Resolution, decode_image, decode_image_eager
from hvdx.data.disk import DiskCache
from hvdx.data.source import GFileSource, Source
from hvdx.data.store import Sample

__all__ = ["BLOCK", "ON_ERROR", "Loader"]

ON_ERROR = ("raise", "skip")
BLOCK = 16  # samples per step of `Loader.blocks`' pipeline


class Loader:
    """Reads the samples of `catalog` through `disk` (level 1) and decodes them at a resolution
    with `channels` channels.

    `on_error`: "raise" (an undecodable file raises ValueError naming it) or "skip" (it is
    named in `skipped`, warned about once, and loads as None from then on). `io_threads`:
    reads from a slow source at once in `blocks`' pipeline."""

    def __init__(self, catalog: Union[ImageFolder, TFRecordShards], disk: DiskCache, source: Source, channels: int,
                 on_error: str, io_threads: int) -> None:
        self.catalog, self.disk, self.source = catalog, disk, source
        self.channels, self.on_error, self.io_threads = channels, on_error, io_threads
        self.skipped: Dict[str, str] = {}  # file (or record) -> why it is undecodable
        self._bad: set = set()  # skipped sample ids
        self._lock = threading.Lock()
        self._decode_slots = threading.BoundedSemaphore(os.cpu_count() or 1)
        self._decode_fns: Dict[Tuple[int, int], Callable] = {}

    def is_bad(self, sample: int) -> bool:
        """Whether `sample` was found undecodable and skipped."""
        return sample in self._bad

    def decode(self, sample: int, resolution: Resolution) -> Optional[Sample]:
        """`sample` read through level 1 and decoded; None if it is undecodable and skipped.
        Any number of threads may wait on the source; at most one decode per core runs at once.
        Raises ValueError naming the file when it is undecodable and on_error="raise"."""
        if sample in self._bad:
            return None
        data, label = self.catalog.read(sample, self.disk)
        try:
            with self._decode_slots:
                image = decode_image_eager(data, resolution, self.channels)
        except (tf.errors.InvalidArgumentError, tf.errors.UnknownError, ValueError) as exc:
            where = self.catalog.describe(sample)
            message = getattr(exc, "message", str(exc)).strip().splitlines()[0]
            if self.on_error == "raise":
                raise ValueError(f"hvdx.data: cannot decode {where}: {message}") from None
            with self._lock:
                self._bad.add(sample)
                first = where not in self.skipped
                self.skipped[where] = message
            if first:
                warnings.warn(f"hvdx.data: skipping undecodable {where}: {message}", RuntimeWarning)
            return None
        return image, -1 if label is None else label

    def decode_graph(self, resolution: Tuple[int, int]) -> Callable[[tf.Tensor], tf.Tensor]:
        """`decode_image` at `resolution` as a tf.function traced once per resolution (not once
        per pipeline of `blocks`: tracing its graph costs a few hundred ms)."""
        with self._lock:
            fn = self._decode_fns.get(resolution)
            if fn is None:
                fn = tf.function(lambda data: decode_image(data, resolution, self.channels),
                                 input_signature=[tf.TensorSpec([], tf.string)]).get_concrete_function()
                self._decode_fns[resolution] = fn
            return fn

    def blocks(self, samples: List[int], resolution: Tuple[int, int]) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """(uint8 pixels at `resolution`, labels) of `samples`, in order, in blocks of `BLOCK`,
        from a tf.data pipeline: files on a local disk read by `tf.io.read_file`, others
        through level 1 (`io_threads` Python reads at once, waiting on I/O: the private
        thread pool has a thread for each), decoded by `decode_image`'s graph, one per core.
        The pipeline runs on a private thread pool, so that a reader waiting in another
        pipeline never holds threads this one needs.
        Raises the first failing read or decode's error (tf.errors.OpError)."""
        h, w = resolution
        cores = max(2, os.cpu_count() or 1)
        threads = cores  # the private pool: decodes, and reads waiting on a slow source
        ids = np.asarray(samples, np.int64)
        if isinstance(self.catalog, ImageFolder) and not self.disk.keep and isinstance(self.source, GFileSource):
            paths = [self.catalog.paths[s] for s in samples]
            labels = self.catalog.labels[ids]
            ds = tf.data.Dataset.from_tensor_slices((ids, paths, labels))
            ds = ds.map(lambda i, p, y: (i, tf.io.read_file(p), y), num_parallel_calls=tf.data.AUTOTUNE,
                        deterministic=True)
        else:
            def read(sample: np.ndarray):
                data, label = self.catalog.read(int(sample), self.disk)
                return np.bytes_(data), np.int64(-1 if label is None else label)

            @tf.autograph.experimental.do_not_convert
            def fetch(i: tf.Tensor):
                data, label = tf.numpy_function(read, [i], [tf.string, tf.int64], stateful=True)
                return i, data, label

            ds = tf.data.Dataset.from_tensor_slices(ids).map(fetch, num_parallel_calls=self.io_threads,
                                                             deterministic=True)
            threads += self.io_threads  # a read waiting on the source holds a thread

        decode = self.decode_graph((h, w))
        ds = ds.map(lambda i, data, label: (i, decode(data), label), num_parallel_calls=cores, deterministic=True)
        ds = ds.batch(BLOCK).prefetch(2)  # one Python step per block of samples, not per sample
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        options.threading.max_intra_op_parallelism = 1
        for _, images, labels in ds.with_options(options):
            yield images.numpy(), labels.numpy()
