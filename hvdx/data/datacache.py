"""DataCache (shi2021 sec. 4.1, Fig. 5): a tf.data input pipeline that reads each training
file once from slow storage, decodes it once per node, and serves it from node memory from
the second epoch on. Internals and guarantees: docs/datacache.md.

    cache = hvdx.data.DataCache("/nfs/imagenet/train", resolution=96)
    model.fit(cache.dataset(batch_size=256, augment=flip_and_crop), epochs=90)

`DataCache` composes, one module each:

- `split` (split.py): which node keeps which samples (`split_seed`) and which rank reads
  which of them in each epoch (`seed`, epoch): `remainder="drop"` (the default; every
  sample read at most once per epoch, the leftovers still decoded into the store in
  epoch 1, so epoch 2 reads no file) or "pad" (every sample read at least once);
- `disk` (level 1, local disk: `DiskCache`) and `store` (level 2, node memory: `NodeStore`,
  one store on /dev/shm per node, shared by its ranks; at a fixed resolution a slab of the
  node's part, read by `tf.gather` from a zero-copy view);
- `loader` (samples read through level 1 and decoded, the error policy), `prefetch` (epoch
  1's filling of the store ahead of the reader, in the order the reader will want the
  samples, at most `lookahead` ahead), `reader` (a rank's batches out of the store) and
  `pipeline` (the tf.data dataset over the reader, augmentation after the cache).

Raises ValueError for bad arguments (naming them), for an undecodable file with
`on_error="raise"` (naming its path), and for node parts too small for the ranks.
"""
from __future__ import annotations

import itertools
import logging
import os
import weakref
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdx.arguments import integer, is_integer
from hvdx.data import pipeline
from hvdx.data.catalog import ImageFolder, TFRecordShards
from hvdx.data.decode import DECODER, normalize_resolution
from hvdx.data.disk import DiskCache, default_cache_dir
from hvdx.data.loader import ON_ERROR, Loader
from hvdx.data.prefetch import Prefetcher
from hvdx.data.reader import Reader
from hvdx.data.source import GFileSource, Source
from hvdx.data.split import REMAINDERS, Placement, RankSplit, catalog_part, epoch_share, node_part, samples_per_rank
from hvdx.data.store import DEFAULT_STORE_DIR, NodeStore, tidy_stores

__all__ = ["DataCache", "Placement", "default_cache_dir", "epoch_share", "node_part", "reset_open", "samples_per_rank"]

_SERIAL = itertools.count()

log = logging.getLogger(__name__)

#: The caches not closed (weakly held): a membership change re-splits each (`reset_open`).
_OPEN: "weakref.WeakSet[DataCache]" = weakref.WeakSet()


def reset_open(placement: Optional[Placement] = None) -> int:
    """Re-splits every open DataCache for the job's current ranks (`DataCache.reset`), in the
    order they were made (every rank made them in the same order: collective with
    `tfrecords`). Returns how many. Called by `hvdx.elastic`'s reset."""
    caches = sorted(_OPEN, key=lambda c: c._serial)
    for cache in caches:
        cache.reset(placement)
    return len(caches)


class DataCache:
    """A two-level cache (local disk, node memory) under a tf.data pipeline.

    Give either `root` (an ImageNet-style folder tree) or `tfrecords` (a glob or list of
    TFRecord files of `tf.train.Example`s with `image_key` and `label_key`).

    - `resolution`: (height, width) or an int; samples are decoded and resized to it (None:
      as decoded; then every image must have the same size to be batched).
    - `cache_dir`: level-1 directory (default `default_cache_dir()`: `$HVDX_DATACACHE_DIR`,
      else node-local `$TMPDIR/hvdx-datacache-<uid>` or /tmp/..., plus a hash of the data
      set's location; logged at INFO and in `repr`); `disk_bytes` bounds it.
    - `store_dir`: where the node's store goes (default /dev/shm/hvdx-datacache); its name
      holds a hash of the data set's location and the node's place (node k of m), so a later
      run over the same data set and node count reuses it (another split seed, file list,
      decoder or hvdx version rebuilds it; the unused stores of other node counts and of
      nodes the job no longer has are removed). A warning names
      stale stores of other data sets that no process uses (`python -m hvdx.data list`,
      `clear`). `memory_bytes` bounds it (default:
      half of the free space of `store_dir`'s file system): a resolution's slab (the whole
      part, allocated at once) is made only if it fits beside what the store holds, else
      the samples go into LMDB values, which fill up to the bound and then read through.
    - `source`: how files are read (default `GFileSource`, any tf.io.gfile path).
    - `seed`: shuffling (every rank must pass the same); `split_seed`: the split into nodes.
    - `remainder`: "drop" or "pad" (`hvdx.data.split`).
    - `on_error`: "raise" (an undecodable file fails the pipeline with its path) or "skip"
      (it is replaced in its batch by another sample of that batch, counted in
      `stats["skipped"]` and named, with one warning per file).
    - `io_threads`: reads from the source (through level 1) at once, ahead of the reader;
      `lookahead`: how many decoded samples the prefetcher may hold that the reader has not
      taken.
    - `placement`: override the node / local rank read from hvdx's topology.

    In an elastic job (`hvdx.elastic`) a membership change re-splits every open cache
    (`reset`); the interrupted epoch starts again under the new split (docs/elastic.md).

    With `tfrecords` on several nodes, building a DataCache is collective (the nodes agree
    on their parts' sizes through Horovod): every rank must build it.
    """

    def __init__(self, root: Optional[str] = None, *, tfrecords: Union[None, str, Sequence[str]] = None,
                 resolution: Union[None, int, Tuple[int, int]] = None, channels: int = 3,
                 cache_dir: Optional[str] = None, disk_bytes: Optional[int] = None, disk_copy: Optional[bool] = None,
                 store_dir: str = DEFAULT_STORE_DIR, memory_bytes: Optional[int] = None,
                 source: Optional[Source] = None, seed: int = 0, split_seed: int = 0,
                 remainder: str = "drop", on_error: str = "raise", io_threads: int = 16, lookahead: int = 512,
                 image_key: str = "image/encoded", label_key: str = "image/class/label",
                 placement: Optional[Placement] = None) -> None:
        if (root is None) == (tfrecords is None):
            raise ValueError("give exactly one of root (a folder tree) and tfrecords (TFRecord files)")
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if not is_integer(channels) or channels not in (1, 3, 4):
            raise ValueError(f"channels must be 1, 3 or 4, got {channels!r}")
        channels = int(channels)
        io_threads = integer(io_threads, "io_threads", 1)
        lookahead = integer(lookahead, "lookahead", 1)
        self.resolution = normalize_resolution(resolution)
        self.channels = channels
        self.seed, self.split_seed = integer(seed, "seed", 0), integer(split_seed, "split_seed", 0)
        self.remainder, self.on_error = remainder, on_error
        self.lookahead = lookahead
        self._serial = next(_SERIAL)
        self.placement = placement or Placement.current()
        self.source = source or GFileSource()
        p = self.placement

        if root is not None:
            self.catalog: Union[ImageFolder, TFRecordShards] = ImageFolder(root, self.source)
        else:
            self.catalog = TFRecordShards(tfrecords, self.source, image_key, label_key)
        self.fingerprint = self.catalog.fingerprint
        if cache_dir is None:
            cache_dir = os.path.join(default_cache_dir(), self.catalog.location[:16])
        # level 1 is named by the data set's location: a file changed in place misses its own
        # copy (copies are named by path and stamp) instead of emptying the directory
        if disk_copy is None:
            first = self.catalog.paths[0] if isinstance(self.catalog, ImageFolder) else self.catalog.shards[0]
            disk_copy = not self.source.is_local(first)
        self.disk = DiskCache(cache_dir, self.catalog.location, self.source, max_bytes=disk_bytes, keep=disk_copy)
        if disk_copy:
            log.info("hvdx.data: level-1 (local disk) cache of %s in %s", root or tfrecords, self.disk.directory)
        else:
            log.info("hvdx.data: %s is on a local disk: level 1 keeps no copies", root or tfrecords)

        self.split = self._split(p)

        if memory_bytes is None:
            os.makedirs(store_dir, exist_ok=True)
            st = os.statvfs(store_dir)
            memory_bytes = max(2**24, st.f_bavail * st.f_frsize // 2)
        # named by the split too: a process that joins an elastic job under another split never
        # opens (and rebuilds) the store a surviving process of its host still serves from
        name = f"{self.catalog.location[:16]}-node{p.node}of{p.num_nodes}"
        self.store = NodeStore(os.path.join(store_dir, name), meta={
            "location": self.catalog.location, "fingerprint": self.fingerprint, "decoder": DECODER,
            "node": p.node, "num_nodes": p.num_nodes, "split_seed": self.split_seed}, memory_bytes=memory_bytes)
        if p.local_rank == 0:
            tidy_stores(store_dir, self.store.path, self.catalog.location, p.num_nodes)

        self.loader = Loader(self.catalog, self.disk, self.source, channels, on_error, io_threads)
        self.prefetcher = Prefetcher(self.store, self.loader, io_threads, lookahead)
        self.reader = Reader(self.store, self.split, self.loader, self.prefetcher)
        # a restarted job: the node's slab is opened now, its pages mapping into this process
        # in the background while the job builds its model (store.Slab)
        self.reader.slab(self.resolution, create=False)
        _OPEN.add(self)

    def _split(self, placement: Placement) -> RankSplit:
        """This rank's `RankSplit` under `placement` (collective with `tfrecords` on several
        nodes). Raises ValueError when the node parts are too small for the ranks."""
        part, sizes = catalog_part(self.catalog, placement, self.split_seed, self.disk)
        per_rank = samples_per_rank(sizes, placement.local_size, self.remainder)
        if per_rank == 0:
            raise ValueError(f"the data set's node parts ({sizes} samples) are too small for "
                             f"{placement.local_size} rank(s) per node with remainder={self.remainder!r}")
        return RankSplit(part, placement, self.seed, per_rank)

    # -- a membership change (Elastic Horovod) -------------------------------------------------

    def reset(self, placement: Optional[Placement] = None) -> None:
        """The job's ranks changed (`hvdx.elastic`'s reset calls this for every open cache):
        splits the data set again for `placement` (default: the current topology's) with the
        same `split_seed` and `seed`, and keeps both levels. The node store stays the one
        this process opened: the samples it holds are served from it (its slab while this
        node's part is the one the slab was made for, else from its LMDB values), the new
        part's samples it lacks are read once (level 1, else the source) and kept as values.
        Datasets made before the reset stop with a ValueError: make them again, inside the
        function `hvd.elastic.run` wraps. Collective with `tfrecords` on several nodes.

        Raises ValueError when the new node parts are too small for the ranks."""
        new = placement or Placement.current()
        split = self._split(new)
        self.reader.slab(self.resolution)  # the store's slab, open in this process while the part is its own
        held = int(np.sum(self.store.locate(self.reader.key(int(s), self.resolution) for s in split.part) > 0))
        old, self.placement = self.placement, new
        self.split = split
        self.reader.resplit(split)
        log.info("hvdx.data: re-split %s for node %d/%d (was %d/%d): %d samples in this node's part, %d of them "
                 "in its store, %d per rank", self.catalog.location[:16], new.node, new.num_nodes, old.node,
                 old.num_nodes, len(split.part), held, split.per_rank)

    # -- sizes -------------------------------------------------------------------------------

    @property
    def part(self) -> np.ndarray:
        """The samples this node keeps (sorted ids)."""
        return self.split.part

    @property
    def per_rank(self) -> int:
        """Samples every rank reads per epoch (the same on every rank)."""
        return self.split.per_rank

    @property
    def samples_per_rank(self) -> int:
        """Samples every rank reads per epoch (the same on every rank)."""
        return self.split.per_rank

    def steps_per_epoch(self, batch_size: int, drop_remainder: bool = False) -> int:
        """Batches every rank gets per epoch from `dataset(batch_size, drop_remainder=...)`."""
        return pipeline.steps_per_epoch(self.split.per_rank, batch_size, drop_remainder)

    @property
    def skipped(self) -> dict:
        """Undecodable files skipped (on_error="skip"): file (or record) -> why."""
        return self.loader.skipped

    @property
    def stats(self) -> dict:
        """Counters of both levels and of skipped files."""
        return {"disk": dict(self.disk.stats), "store": dict(self.store.stats), "skipped": len(self.skipped)}

    def share(self, epoch: int) -> np.ndarray:
        """This rank's samples of `epoch`, in reading order."""
        return self.split.share(epoch).samples

    # -- the pipeline ----------------------------------------------------------------------------

    def dataset(self, batch_size: int, *, augment: Optional[Callable[[tf.Tensor], tf.Tensor]] = None,
                epochs: Optional[int] = 1, first_epoch: int = 0,
                resolution: Union[None, int, Tuple[int, int], str] = "default",
                drop_remainder: bool = False, with_index: bool = False, compile_augment: bool = True,
                prefetch: int = pipeline.PREFETCH) -> tf.data.Dataset:
        """Batches (images uint8 [B, h, w, c], labels int64 [B]) (+ sample ids [B] with
        `with_index`) of this rank's share, `epochs` epochs per iteration (None: forever).

        Every iteration over the dataset continues with the next epoch (first_epoch, first_epoch
        + 1, ...), so Model.fit's per-epoch iterations each get a new order. `augment(image)`
        runs per sample after the cache (`tf.map_fn` over each batch, so random ops draw per
        sample), compiled with XLA (`compile_augment`, the default: one fused computation per
        batch instead of a dozen small kernels per sample) unless it uses an op XLA lacks (then
        with a warning it runs uncompiled; float arithmetic may round differently under XLA).
        `resolution` overrides the cache's (progressive resizing: one dataset per phase; each
        resolution has its own keys in the store and its own slab). `prefetch`: batches made
        ahead (a fixed number; the dataset's options turn tf.data's autotuning off: it made
        deleting an iterator slow, see `hvdx.data.pipeline.PREFETCH`).
        Raises ValueError for a bad batch_size, epochs or resolution.
        """
        batch_size = pipeline.check_batch_size(batch_size)
        epochs = integer(epochs, "epochs", 1, optional=True)
        res = self.resolution if resolution == "default" else normalize_resolution(resolution)
        return pipeline.dataset(self.reader, batch_size, res, augment=augment, epochs=epochs,
                                first_epoch=first_epoch, drop_remainder=drop_remainder, with_index=with_index,
                                compile_augment=compile_augment, prefetch=prefetch)

    def close(self) -> None:
        """Stops the prefetchers and closes the store's handle (both levels stay for the
        node's other ranks and later runs). Datasets made by this cache stop working."""
        _OPEN.discard(self)
        self.prefetcher.close()
        self.store.close()

    def __repr__(self) -> str:
        p = self.placement
        return (f"DataCache({len(self.part)} samples on node {p.node}/{p.num_nodes}, {self.per_rank} per rank, "
                f"resolution={self.resolution}, disk={self.disk.directory if self.disk.keep else None!r}, "
                f"store={self.store.path!r})")
