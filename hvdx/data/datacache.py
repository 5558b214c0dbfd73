"""DataCache (shi2021 sec. 4.1, Fig. 5): a tf.data input pipeline that reads each training
file once from slow storage, decodes it once per node, and serves it from node memory from
the second epoch on. Internals and guarantees: docs/datacache.md.

    cache = hvdx.data.DataCache("/nfs/imagenet/train", resolution=96)
    model.fit(cache.dataset(batch_size=256, augment=flip_and_crop), epochs=90)

Levels: `DiskCache` (level 1, local disk: every file read from its source is kept, for
this run and later ones; none for a source already on a local disk) and `NodeStore` (level
2, node memory: decoded samples keyed by (sample index, resolution, channels), one store on
/dev/shm per node, shared by its ranks; at a fixed resolution a slab of the node's part,
read by `tf.gather` from a zero-copy view).

The split, for N samples on m nodes of n ranks: a seeded permutation (`split_seed`) deals
the samples to the nodes (TFRecord shards are dealt whole); node j keeps only its part.
In epoch e every rank of the node shuffles the part with the same seed (`seed`, e) and
local rank l takes every n-th sample from position l. Every rank reads
`samples_per_rank` samples per epoch:

- `remainder="drop"` (default): floor(N / (m n)); each sample is read at most once per
  epoch, and the at most m n - 1 left over (different ones each epoch) are still decoded
  into the store in epoch 1, so epoch 2 reads no file;
- `remainder="pad"`: ceil(N / (m n)); a node's order is extended with its own first
  samples, so every sample is read at least once and at most m n - 1 of them twice.

Batches are cut per rank from its share: the same number on every rank, the last one
partial unless `drop_remainder=True`. Augmentation runs after the cache, per sample over
each batch (compiled with XLA where it can be). In epoch 1 a prefetcher (a tf.data pipeline
of its own: `io_threads` reads at once from a slow source, one decode per core) fetches and
decodes this rank's missing samples in the order the reader will want them (the order is
known from the seed), at most `lookahead` ahead; leftovers' errors surface in that epoch.

Raises ValueError for bad arguments (naming them), for an undecodable file with
`on_error="raise"` (naming its path), and for node parts too small for the ranks.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from hvdx.data.catalog import ImageFolder, TFRecordShards
from hvdx.data.decode import DECODER, decode_image, decode_image_eager, normalize_resolution
from hvdx.data.disk import DiskCache
from hvdx.data.source import GFileSource, Source
from hvdx.data.store import NodeStore, Slab, list_stores, remove_store, sample_key

__all__ = ["DataCache", "Placement", "default_cache_dir", "epoch_share", "node_part", "samples_per_rank"]

log = logging.getLogger(__name__)
DEFAULT_STORE_DIR = "/dev/shm/hvdx-datacache"
REMAINDERS = ("drop", "pad")
_FEED_BLOCK = 16  # samples per step of the prefetcher's pipeline
ON_ERROR = ("raise", "skip")


def default_cache_dir() -> str:
    """Level 1's default base directory: `$HVDX_DATACACHE_DIR`, else node-local scratch,
    `$TMPDIR/hvdx-datacache-<uid>` (/tmp when TMPDIR is unset). Not ~/.cache: home
    directories of clusters are often on NFS, the storage level 1 is there to avoid."""
    explicit = os.environ.get("HVDX_DATACACHE_DIR")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"hvdx-datacache-{os.getuid()}")


@dataclass(frozen=True)
class Placement:
    """This process' place: node `node` of `num_nodes`, local rank `local_rank` of `local_size`."""

    node: int = 0
    num_nodes: int = 1
    local_rank: int = 0
    local_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.node < self.num_nodes and 0 <= self.local_rank < self.local_size):
            raise ValueError(f"placement out of range: {self}")

    @staticmethod
    def current() -> "Placement":
        """From hvdx's topology (`hvdx.init()`), else Horovod's ranks, else one process."""
        from hvdx.topology import initialized, topology

        if initialized():
            t = topology()
            return Placement(t.node, t.num_nodes, t.local_rank, t.local_size)
        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            return Placement(hvd.cross_rank(), hvd.cross_size(), hvd.local_rank(), hvd.local_size())
        return Placement()


# -- the split: pure functions of (N, placement, seeds, epoch) ------------------------------

def node_part(ids: np.ndarray, num_nodes: int, node: int, split_seed: int) -> np.ndarray:
    """The samples node `node` keeps: a seeded permutation of `ids` dealt to the nodes."""
    perm = np.random.default_rng(split_seed).permutation(len(ids))
    return np.sort(np.asarray(ids)[perm[node::num_nodes]])


def samples_per_rank(part_sizes: Sequence[int], local_size: int, remainder: str) -> int:
    """How many samples every rank reads per epoch, given every node's part size."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if remainder == "drop":
        return min(part_sizes) // local_size
    return math.ceil(max(part_sizes) / local_size)


def epoch_share(part: np.ndarray, epoch: int, seed: int, local_rank: int, local_size: int,
                per_rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """(this rank's samples of `epoch` in reading order, the part's leftover samples this
    rank decodes into the store without reading them: only with remainder="drop")."""
    order = np.asarray(part)[np.random.default_rng([seed, epoch]).permutation(len(part))]
    used = per_rank * local_size
    if len(order) < used:  # remainder="pad": the node's own first samples again
        order = np.resize(order, used)
    return order[local_rank:used:local_size], order[used:][local_rank::local_size]


# -- the cache --------------------------------------------------------------------------------

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
      holds a hash of the data set's location and the node, so a later run over the same
      data set replaces it (another split, node count, file list, decoder or hvdx version
      rebuilds it; the stores of nodes the job no longer has are removed). A warning names
      stale stores of other data sets that no process uses (`python -m hvdx.data list`,
      `clear`). `memory_bytes` bounds it (default:
      half of the free space of `store_dir`'s file system): a resolution's slab (the whole
      part, allocated at once) is made only if it fits beside what the store holds, else
      the samples go into LMDB values, which fill up to the bound and then read through.
    - `source`: how files are read (default `GFileSource`, any tf.io.gfile path).
    - `seed`: shuffling (every rank must pass the same); `split_seed`: the split into nodes.
    - `remainder`: "drop" or "pad" (see the module's docstring).
    - `on_error`: "raise" (an undecodable file fails the pipeline with its path) or "skip"
      (it is replaced in its batch by another sample of that batch, counted in
      `stats["skipped"]` and named, with one warning per file).
    - `io_threads`: reads from the source (through level 1) at once, ahead of the reader;
      `lookahead`: how many decoded samples the prefetcher may hold that the reader has not
      taken.
    - `placement`: override the node / local rank read from hvdx's topology.

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
        if channels not in (1, 3, 4):
            raise ValueError(f"channels must be 1, 3 or 4, got {channels}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.resolution = normalize_resolution(resolution)
        self.channels = channels
        self.seed, self.split_seed = int(seed), int(split_seed)
        self.remainder, self.on_error = remainder, on_error
        self.lookahead = lookahead
        self._io_threads = io_threads
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

        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hvdx-datacache")
        self._read_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hvdx-datacache-read")
        if isinstance(self.catalog, ImageFolder):
            self.part = node_part(self.catalog.ids(), p.num_nodes, p.node, self.split_seed)
            sizes = [len(node_part(self.catalog.ids(), p.num_nodes, j, self.split_seed)) for j in range(p.num_nodes)]
        else:
            shards = list(range(len(self.catalog.shards)))
            if len(shards) < p.num_nodes:
                raise ValueError(f"tfrecords: {len(shards)} file(s) cannot be dealt to {p.num_nodes} nodes")
            dealt = np.random.default_rng(self.split_seed).permutation(len(shards))[p.node::p.num_nodes]
            mine = [shards[i] for i in dealt]
            self.part = np.sort(self.catalog.index(sorted(mine), self.disk))
            sizes = _node_sizes(len(self.part), p)
        self.per_rank = samples_per_rank(sizes, p.local_size, remainder)
        if self.per_rank == 0:
            raise ValueError(f"the data set's node parts ({sizes} samples) are too small for {p.local_size} "
                             f"rank(s) per node with remainder={remainder!r}")

        if memory_bytes is None:
            os.makedirs(store_dir, exist_ok=True)
            st = os.statvfs(store_dir)
            memory_bytes = max(2**24, st.f_bavail * st.f_frsize // 2)
        name = f"{self.catalog.location[:16]}-node{p.node}"
        self.store = NodeStore(os.path.join(store_dir, name), meta={
            "location": self.catalog.location, "fingerprint": self.fingerprint, "decoder": DECODER,
            "node": p.node, "num_nodes": p.num_nodes, "split_seed": self.split_seed}, memory_bytes=memory_bytes)
        if p.local_rank == 0:
            self._tidy(store_dir)

        self._lock = threading.Lock()
        self._inflight: Dict[Tuple[int, object], Tuple[Future, Callable[[], None]]] = {}
        self._taken: set = set()  # samples the reader has asked for (the prefetcher skips them)
        self._leftovers: Dict[Tuple[int, object], Future] = {}  # leftovers being put by the prefetcher
        self._decode_slots = threading.BoundedSemaphore(os.cpu_count() or 1)
        self._feeder_stop: Optional[threading.Event] = None
        self._feeder_drain: Optional[threading.Event] = None  # set: the reader has its share, no gate
        self._feeder_thread: Optional[threading.Thread] = None
        self._slabs: Dict[Tuple[int, int], Optional[Slab]] = {}
        self._full_slabs: set = set()  # resolutions whose slab holds the whole part
        self._decode_fns: Dict[Tuple[int, int], Callable] = {}
        self.skipped: Dict[str, str] = {}
        self._bad: set = set()

    def _tidy(self, store_dir: str) -> None:
        """Removes the stores this job replaces (this data set's stores of nodes it no longer
        has) and warns once about the other stores in `store_dir` that no process uses."""
        stale = []
        for info in list_stores(store_dir):
            if info.path == self.store.path or info.in_use:
                continue
            meta = info.meta or {}
            if meta.get("location") == self.catalog.location:
                if int(meta.get("node", 0)) >= self.placement.num_nodes and remove_store(info.path):
                    log.info("hvdx.data: removed %s (node %s of an earlier job)", info.path, meta.get("node"))
                continue  # a node of this job that has not opened its store yet
            stale.append(info)
        if stale:
            warnings.warn(
                f"hvdx.data: {store_dir} holds {len(stale)} stale node store(s) of other data sets that no process "
                f"uses ({sum(i.bytes for i in stale) / 2**20:.1f} MiB of memory, which also shrinks the default "
                f"memory_bytes): {', '.join(i.name for i in stale)}; list them with `python -m hvdx.data list "
                f"--store-dir {store_dir}` and remove them with `python -m hvdx.data clear --store-dir {store_dir}`",
                RuntimeWarning, stacklevel=3)

    # -- sizes -------------------------------------------------------------------------------

    @property
    def samples_per_rank(self) -> int:
        """Samples every rank reads per epoch (the same on every rank)."""
        return self.per_rank

    def steps_per_epoch(self, batch_size: int, drop_remainder: bool = False) -> int:
        """Batches every rank gets per epoch from `dataset(batch_size, drop_remainder=...)`."""
        _check_batch_size(batch_size)
        return self.per_rank // batch_size if drop_remainder else math.ceil(self.per_rank / batch_size)

    @property
    def stats(self) -> dict:
        """Counters of both levels and of skipped files."""
        return {"disk": dict(self.disk.stats), "store": dict(self.store.stats), "skipped": len(self.skipped)}

    def share(self, epoch: int) -> np.ndarray:
        """This rank's samples of `epoch`, in reading order."""
        p = self.placement
        return epoch_share(self.part, epoch, self.seed, p.local_rank, p.local_size, self.per_rank)[0]

    # -- loading: level 2, else level 1 + decode (ahead of the reader), then put ----------------

    def _decode(self, sample: int, resolution) -> Optional[Tuple[np.ndarray, int]]:
        """`sample` read through level 1 and decoded; None if it is undecodable and skipped.
        Any number of threads may wait on the source; at most one decode per core runs at once."""
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

    def _decode_and_put(self, sample: int, resolution) -> None:
        decoded = self._decode(sample, resolution)
        if decoded is not None:
            self.store.put_many([(sample_key(sample, resolution, self.channels), *decoded)])

    def _slab(self, resolution) -> Optional[Slab]:
        """The node's slab at `resolution` (None: no fixed resolution, or no room for it)."""
        if resolution is None:
            return None
        with self._lock:
            if resolution not in self._slabs:
                self._slabs[resolution] = self.store.slab(resolution, self.channels, self.part)
            return self._slabs[resolution]

    def _start_epoch(self, epoch: int, resolution) -> Tuple[np.ndarray, bool, List[int]]:
        """(this rank's order of `epoch`, whether all of it is in the resolution's slab, the
        leftovers (remainder="drop") this rank decodes into the store this epoch); starts
        preparing the missing samples in that order."""
        p = self.placement
        share, leftover = epoch_share(self.part, epoch, self.seed, p.local_rank, p.local_size, self.per_rank)
        slab = self._slab(resolution)
        if self._feeder_stop is not None:
            self._feeder_stop.set()
        with self._lock:
            self._taken.clear()
        share_list = list(dict.fromkeys(int(s) for s in share))  # pad may repeat a sample
        leftover_list = [int(s) for s in leftover] if not self.store.full else []
        wanted = share_list + leftover_list
        if resolution in self._full_slabs:  # the whole part is in the slab: no index look-ups per epoch
            where = np.full(len(wanted), 2, np.int8)
        else:
            where = self.store.locate(sample_key(s, resolution, self.channels) for s in wanted)
            if slab is not None and np.all(where == 2) and np.all(
                    self.store.locate(sample_key(int(s), resolution, self.channels) for s in self.part) == 2):
                self._full_slabs.add(resolution)  # slab slots are never taken back
        missing = [(s, j >= len(share_list)) for j, (s, w) in enumerate(zip(wanted, where))
                   if not w and s not in self._bad]
        if missing:
            stop, drain = threading.Event(), threading.Event()
            self._feeder_stop, self._feeder_drain = stop, drain
            feed = self._feed if resolution is not None else self._feed_threads
            self._feeder_thread = threading.Thread(target=feed, args=(missing, resolution, stop, drain), daemon=True,
                                                   name="hvdx-datacache-feeder")
            self._feeder_thread.start()
        in_slab = slab is not None and bool(np.all(where[:len(share_list)] == 2))
        return share.astype(np.int64), in_slab, [s for s, left in missing if left]

    def _feed_threads(self, missing: List[Tuple[int, bool]], resolution, stop: threading.Event,
                      drain: threading.Event) -> None:
        """`_feed` for samples of no fixed resolution (they cannot be batched): every sample
        read and decoded by a Python worker (`io_threads` of them, at most one decode per core)."""
        slots = threading.Semaphore(self.lookahead)
        for sample, leftover in missing:
            while not drain.is_set() and not slots.acquire(timeout=0.1):  # a reader that stopped frees none
                if stop.is_set():
                    return
            key = (sample, resolution)
            with self._lock:
                if stop.is_set():
                    return
                if key in self._inflight or key in self._taken or key in self._leftovers:
                    continue
                if leftover:
                    future = self._pool.submit(self._decode_and_put, sample, resolution)
                    future.add_done_callback(lambda _: slots.release())
                    self._leftovers[key] = future
                    continue
                self._inflight[key] = (self._pool.submit(self._decode, sample, resolution), slots.release)

    def _feed(self, missing: List[Tuple[int, bool]], resolution, stop: threading.Event,
              drain: threading.Event) -> None:
        """Clairvoyant prefetch (beyond the paper): read and decode the epoch's missing samples
        in the order the reader will want them, at most `lookahead` ahead of it. Leftovers
        (remainder="drop") are put into the store here (the reader waits for them, and their
        errors, after the epoch's last batch); the others are handed to the reader, which puts
        a whole batch in one transaction.

        Reading and decoding run in a tf.data pipeline of their own (`_decoded`: TensorFlow's
        threads, no Python per sample where the files are on a local disk, the same decode
        graph as a plain tf.data pipeline), on a private thread pool so that the reader
        waiting in its own pipeline never holds threads this one needs. A sample whose read
        or decode fails goes through `_decode` (its file named, or skipped) and the pipeline
        resumes after it."""
        gate = threading.Condition()
        gate.ahead = 0  # samples decoded or being decoded that the reader has not taken
        order = []
        with self._lock:  # every sample gets its future now: the reader waits on it, never decodes twice
            for sample, leftover in missing:
                key = (sample, resolution)
                if key in self._inflight or key in self._taken or key in self._leftovers:
                    continue
                future: Future = Future()
                if leftover:
                    self._leftovers[key] = future
                else:
                    self._inflight[key] = (future, lambda: self._feed_gate_release(gate))
                order.append((sample, leftover, future))
        start = done = 0
        try:
            while start < len(order) and not stop.is_set():
                done = start
                try:
                    for images, labels in self._decoded([s for s, _, _ in order[start:]], resolution):
                        for image, label in zip(images, labels):  # views of the decoded block
                            s, leftover, future = order[done]
                            if not leftover:
                                with gate:
                                    while gate.ahead >= self.lookahead and not drain.is_set() and not stop.is_set():
                                        gate.wait(0.1)
                                    gate.ahead += 1
                            if stop.is_set():
                                break
                            if leftover:
                                self.store.put_many([(sample_key(s, resolution, self.channels), image, int(label))])
                                future.set_result(None)
                            else:
                                future.set_result((image, int(label)))
                            done += 1
                        if stop.is_set():
                            break
                except (tf.errors.OpError, ValueError):
                    # a read or decode failed in the next block: its samples through Python (a bad
                    # file named, or skipped), then the pipeline again after them
                    for s, leftover, future in order[done:done + _FEED_BLOCK]:
                        _chain(future, self._pool.submit(self._decode_and_put if leftover else self._decode, s,
                                                         resolution))
                    done = min(len(order), done + _FEED_BLOCK)
                start = done if done > start or stop.is_set() else len(order)
        except BaseException as exc:  # unexpected: the reader must fail, not wait for ever
            for _, _, future in order:
                if not future.done():
                    future.set_exception(exc)
            raise
        if done < len(order):  # stopped: the reader of this epoch is gone, or the next epoch began
            with self._lock:
                for s, leftover, future in order[done:]:
                    if not future.done():
                        books = self._leftovers if leftover else self._inflight
                        if books.pop((s, resolution), None) is not None:
                            future.cancel()
                        else:  # the reader took it already: it waits on it
                            _chain(future, self._pool.submit(
                                self._decode_and_put if leftover else self._decode, s, resolution))

    @staticmethod
    def _feed_gate_release(gate: threading.Condition) -> None:
        with gate:
            gate.ahead -= 1
            gate.notify()

    def _decode_graph(self, resolution: Tuple[int, int]) -> Callable[[tf.Tensor], tf.Tensor]:
        """`decode_image` at `resolution` as a tf.function traced once per resolution (not once
        per epoch's prefetcher pipeline: tracing its graph costs a few hundred ms)."""
        with self._lock:
            fn = self._decode_fns.get(resolution)
            if fn is None:
                fn = tf.function(lambda data: decode_image(data, resolution, self.channels),
                                 input_signature=[tf.TensorSpec([], tf.string)]).get_concrete_function()
                self._decode_fns[resolution] = fn
            return fn

    def _decoded(self, samples: List[int], resolution):
        """(uint8 pixels at `resolution`, labels) of `samples`, in order, in blocks of
        `_FEED_BLOCK`, from a tf.data pipeline: files on a local disk read by `tf.io.read_file`,
        others through level 1 (`io_threads` Python reads at once, waiting on I/O: the private
        thread pool has a thread for each), decoded by `decode_image`'s graph, one per core.
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

            ds = tf.data.Dataset.from_tensor_slices(ids).map(fetch, num_parallel_calls=self._io_threads,
                                                             deterministic=True)
            threads += self._io_threads  # a read waiting on the source holds a thread

        decode = self._decode_graph((h, w))
        ds = ds.map(lambda i, data, label: (i, decode(data), label), num_parallel_calls=cores, deterministic=True)
        ds = ds.batch(_FEED_BLOCK).prefetch(2)  # one Python step per block of samples, not per sample
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        options.threading.max_intra_op_parallelism = 1
        for _, images, labels in ds.with_options(options):
            yield images.numpy(), labels.numpy()

    def _finish_leftovers(self, leftovers: Sequence[int], resolution) -> None:
        """Waits until the epoch's leftovers are in the store (decoding those the prefetcher
        has not started), so that their errors surface in the epoch that decodes them:
        ValueError naming the file with on_error="raise", a warning with "skip"."""
        if self._feeder_drain is not None:
            self._feeder_drain.set()  # the reader has taken its whole share: the prefetcher runs to its end
        if self._feeder_thread is not None:
            self._feeder_thread.join()  # every leftover has its future
        futures = []
        with self._lock:
            for sample in leftovers:
                future = self._leftovers.pop((sample, resolution), None)
                if future is None and not self.store.locate([sample_key(sample, resolution, self.channels)])[0]:
                    future = self._read_pool.submit(self._decode_and_put, sample, resolution)
                if future is not None:
                    futures.append(future)
        for future in futures:
            future.result()  # raises the decode's error, with the file's path

    def _take(self, sample: int, resolution) -> Optional[Future]:
        """The prefetched future of `sample`, removed from the prefetcher's books."""
        with self._lock:
            entry = self._inflight.pop((sample, resolution), None)
            self._taken.add((sample, resolution))
        if entry is None:
            return None
        entry[1]()  # its slot is free again
        return entry[0]

    def _complete(self, samples: List[int], resolution, got: List[Optional[Tuple[np.ndarray, int]]],
                  missing: Sequence[int]) -> List[Tuple[bytes, np.ndarray, int]]:
        """Fills `got[j]` for j in `missing` (prefetched, else read and decoded now; None if
        skipped); returns the new (key, image, label) items for the store. Every sample of the
        batch is marked taken (the read-ahead no longer prepares it)."""
        futures = {}
        for j, s in enumerate(samples):
            future = self._take(s, resolution)
            if j in missing:
                futures[j] = future or self._read_pool.submit(self._decode, s, resolution)
        new = []
        for j, future in futures.items():
            got[j] = future.result()  # raises its error, with the file's path
            if got[j] is not None:
                new.append((sample_key(samples[j], resolution, self.channels), *got[j]))
        return new

    def _replace_skipped(self, samples: List[int], ok: Sequence[bool]) -> List[int]:
        """The batch's ids with each skipped (undecodable) sample replaced by another of its batch."""
        if not any(ok):
            raise ValueError("hvdx.data: every sample of a batch is undecodable: "
                             + ", ".join(self.catalog.describe(s) for s in samples))
        return [s if ok[j] else samples[next(i for i in itertools.chain(range(j, len(ok)), range(j)) if ok[i])]
                for j, s in enumerate(samples)]

    def _read_into_slab(self, samples: np.ndarray, resolution, slab: Slab) -> np.ndarray:
        """Makes sure the samples of one batch are in the slab (decoding what the store lacks);
        returns the ids to gather (a skipped sample replaced by another of its batch)."""
        samples = [int(s) for s in samples]
        keys = [sample_key(s, resolution, self.channels) for s in samples]
        where = self.store.locate(keys)
        got: List[Optional[Tuple[np.ndarray, int]]] = [None] * len(samples)
        in_values = [j for j, w in enumerate(where) if w == 1]  # stored without the slab: copy them in
        for j, sample in zip(in_values, self.store.get_many([keys[j] for j in in_values])):
            if sample is not None:
                slab.write(int(slab.slots([samples[j]])[0]), *sample)
        missing = [j for j, w in enumerate(where) if w == 0]
        self.store.count_hits(len(samples) - len(missing), len(missing))
        self.store.put_many(self._complete(samples, resolution, got, missing))  # pixels into the slab
        if not missing or all(got[j] is not None for j in missing):
            return np.asarray(samples, np.int64)
        ok = [w != 0 or got[j] is not None for j, w in enumerate(where)]
        return np.asarray(self._replace_skipped(samples, ok), np.int64)

    def _read_block(self, samples: np.ndarray, resolution) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The samples of one batch without a slab: from the store's values, else prefetched,
        else read and decoded now."""
        samples = [int(s) for s in samples]
        keys = [sample_key(s, resolution, self.channels) for s in samples]
        if resolution is not None:  # the common case, all hits: one copy into the batch
            batch = self.store.get_batch(keys, (*resolution, self.channels))
            if batch is not None:
                for s in samples:
                    self._take(s, resolution)
                return batch[0], batch[1], np.asarray(samples, np.int64)
        got: List[Optional[Tuple[np.ndarray, int]]] = self.store.get_many(keys)
        self.store.put_many(self._complete(samples, resolution, got, [j for j, g in enumerate(got) if g is None]))
        ids = self._replace_skipped(samples, [g is not None for g in got])
        by_id = {s: g for s, g in zip(samples, got) if g is not None}
        images = np.stack([by_id[s][0] for s in ids])
        labels = np.asarray([by_id[s][1] for s in ids], np.int64)
        return images, labels, np.asarray(ids, np.int64)

    # -- the pipeline ----------------------------------------------------------------------------

    def dataset(self, batch_size: int, *, augment: Optional[Callable[[tf.Tensor], tf.Tensor]] = None,
                epochs: Optional[int] = 1, first_epoch: int = 0,
                resolution: Union[None, int, Tuple[int, int], str] = "default",
                drop_remainder: bool = False, with_index: bool = False, compile_augment: bool = True,
                prefetch: int = tf.data.AUTOTUNE) -> tf.data.Dataset:
        """Batches (images uint8 [B, h, w, c], labels int64 [B]) (+ sample ids [B] with
        `with_index`) of this rank's share, `epochs` epochs per iteration (None: forever).

        Every iteration over the dataset continues with the next epoch (first_epoch, first_epoch
        + 1, ...), so Model.fit's per-epoch iterations each get a new order. `augment(image)`
        runs per sample after the cache (`tf.map_fn` over each batch, so random ops draw per
        sample), compiled with XLA (`compile_augment`, the default: one fused computation per
        batch instead of a dozen small kernels per sample) unless it uses an op XLA lacks (then
        with a warning it runs uncompiled; float arithmetic may round differently under XLA).
        `resolution` overrides the cache's (progressive resizing: one dataset per phase; each
        resolution has its own keys in the store and its own slab).
        """
        _check_batch_size(batch_size)
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        res = self.resolution if resolution == "default" else normalize_resolution(resolution)
        counter = itertools.count(first_epoch)
        counter_lock = threading.Lock()
        h, w = res if res is not None else (None, None)
        c = self.channels
        steps = self.steps_per_epoch(batch_size, drop_remainder)
        usable = self.per_rank - self.per_rank % batch_size if drop_remainder else self.per_rank
        slab = self._slab(res)
        if res is not None:
            self._decode_graph(res)  # traced now, not in epoch 1
        plans: Dict[int, Tuple[np.ndarray, bool, np.ndarray, List[int]]] = {}
        finishing: set = set()  # epochs whose last batch is being read: their leftovers follow it

        def batch_of(state: np.ndarray, step: np.ndarray) -> Tuple[int, np.ndarray, bool, np.ndarray]:
            """(epoch, the batch's samples, whether the epoch is all in the slab, their slots).
            The first batch of an epoch takes the next epoch number and plans it."""
            k = int(step) % steps
            if k == 0:
                with counter_lock:
                    epoch = next(counter)
                samples, in_slab, leftovers = self._start_epoch(epoch, res)
                samples = samples[:usable]
                slots = slab.slots(samples) if in_slab else samples
                with counter_lock:
                    plans[epoch] = (samples, in_slab, slots, leftovers)
                    for old in [e for e in plans if e < epoch - 64]:  # iterations abandoned mid-epoch
                        del plans[old]
                if in_slab:
                    self.store.count_hits(len(samples))
            else:
                epoch = int(state)
            samples, in_slab, slots, leftovers = plans[epoch]
            if k == steps - 1 and leftovers:  # after this batch: their decode errors belong to this epoch
                finishing.add(epoch)
            part = slice(k * batch_size, (k + 1) * batch_size)
            return epoch, samples[part], in_slab, slots[part]

        def finish(epoch: int) -> None:
            if epoch in finishing:
                finishing.discard(epoch)
                self._finish_leftovers(plans[epoch][3], res)

        def slab_step(state: np.ndarray, step: np.ndarray):
            epoch, samples, in_slab, slots = batch_of(state, step)
            if not in_slab:
                samples = self._read_into_slab(samples, res, slab)
                slots = slab.slots(samples)
            finish(epoch)
            # the slab's arrays are zero-copy views of the node's mapping: TensorFlow takes them
            # over without copying, and tf.gather copies out only the batch
            return np.int64(epoch), samples, slots, slab.pixels, slab.labels

        def read_step(state: np.ndarray, step: np.ndarray):
            epoch, samples, _, _ = batch_of(state, step)
            images, labels, ids = self._read_block(samples, res)
            finish(epoch)
            return np.int64(epoch), ids, images, labels

        # One Python call per batch (sequential, in a scan whose state is the iteration's epoch);
        # with a slab it only plans (and in epoch 1 fills) and the pixels are gathered by TF.
        @tf.autograph.experimental.do_not_convert
        def from_slab(state: tf.Tensor, step: tf.Tensor):
            epoch, ids, slots, pixels, labels = tf.numpy_function(
                slab_step, [state, step], [tf.int64, tf.int64, tf.int64, tf.uint8, tf.int64], stateful=True)
            pixels.set_shape([None, h, w, c])
            return _batch(epoch, tf.gather(pixels, slots), tf.gather(labels, slots), ids)

        @tf.autograph.experimental.do_not_convert
        def from_values(state: tf.Tensor, step: tf.Tensor):
            epoch, ids, images, labels = tf.numpy_function(
                read_step, [state, step], [tf.int64, tf.int64, tf.uint8, tf.int64], stateful=True)
            images.set_shape([None, h, w, c])
            return _batch(epoch, images, labels, ids)

        def _batch(epoch: tf.Tensor, images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
            epoch.set_shape([])
            images.set_shape([None, h, w, c])  # (a gather by slots of unknown shape has none)
            labels.set_shape([None])
            ids.set_shape([None])
            return epoch, ((images, labels, ids) if with_index or augment is not None else (images, labels))

        total = steps * epochs if epochs is not None else 2**62
        read = from_slab if slab is not None else from_values
        ds = tf.data.Dataset.range(total).scan(tf.constant(-1, tf.int64), read)
        if augment is not None:  # per sample, over the batch (no unbatching and batching again), in parallel
            per_batch = _batch_augment(augment, (batch_size, h, w, c), compile_augment)

            @tf.autograph.experimental.do_not_convert
            def augmented(images: tf.Tensor, labels: tf.Tensor, ids: tf.Tensor):
                images = per_batch(images)
                return (images, labels, ids) if with_index else (images, labels)

            ds = ds.map(augmented, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.prefetch(prefetch)

    def close(self) -> None:
        """Stops the prefetchers and closes the store's handle (both levels stay for the
        node's other ranks and later runs). Datasets made by this cache stop working."""
        if self._feeder_stop is not None:
            self._feeder_stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def __repr__(self) -> str:
        p = self.placement
        return (f"DataCache({len(self.part)} samples on node {p.node}/{p.num_nodes}, {self.per_rank} per rank, "
                f"resolution={self.resolution}, disk={self.disk.directory if self.disk.keep else None!r}, "
                f"store={self.store.path!r})")


def _chain(target: Future, source: Future) -> None:
    """`target` gets `source`'s result or exception when it is done."""
    def copy(done: Future) -> None:
        if target.done():
            return
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())
    source.add_done_callback(copy)


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def _batch_augment(augment: Callable, shape: Tuple, compile_augment: bool) -> Callable[[tf.Tensor], tf.Tensor]:
    """`augment` applied to every sample of a batch of `shape` ([B, h, w, c]): `tf.map_fn`
    (a random op draws per sample), compiled with XLA when asked and XLA has every op (a
    batch then runs as one fused computation; compiled on the first batch of each shape)."""
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
                          RuntimeWarning, stacklevel=3)
    return tf.function(per_batch, input_signature=signature)


def _node_sizes(own: int, placement: Placement) -> List[int]:
    """Every node's part size (TFRecord parts are known only to their node): an allgather
    over Horovod when the job has several nodes."""
    if placement.num_nodes == 1:
        return [own]
    import horovod.tensorflow as hvd

    if not hvd.is_initialized():
        raise ValueError("tfrecords on several nodes need Horovod initialized (hvdx.init()) to agree on sizes")
    entries = hvd.allgather_object((placement.node, own), name="hvdx.data.node_sizes")
    return [size for _, size in sorted(dict(entries).items())]
