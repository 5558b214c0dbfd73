"""Level 2 of DataCache (shi2021 sec. 4.1, Fig. 5): decoded samples in node memory.

The paper keeps pre-processed samples in a key-value store keyed by the sample index; hvdx
keys them by (sample index, resolution, channels), since progressive resizing changes the
resolution per phase and a run may read the same data set with another channel count.
Whatever else changes the stored bytes is the store's identity (its metadata, below): the
value format, the hvdx version, the data set's fingerprint (file names, sizes, mtimes) and
the decoder's identity (resizing method and rounding); pixels are always uint8.

The store is one LMDB environment on /dev/shm per node: memory-mapped, so the
node's local ranks share one copy instead of holding one each, and filled by all of them at
once (LMDB serialises writers with its own lock; readers never block).

A value is a sample after decoding and resizing, before augmentation: a 20-byte header
(label as int64, height, width, channels as uint32) then the uint8 pixels; or the header
alone when the pixels are in the resolution's slab.

Slabs (the read path from epoch 2 on): samples of one resolution have one size, so the
node's part at that resolution can live in one flat file beside the LMDB environment, slot
j holding the part's j-th sample (pixels [n, height, width, channels], then the labels as
int64 [n]). A slab is allocated whole when it is created (`posix_fallocate`: a full
/dev/shm fails there, never later with a SIGBUS) if the memory budget holds it, written with
`pwrite` and mapped read-only: a batch is one `tf.gather` over a zero-copy tensor of the
mapping (no Python code touches the pixels, no rank holds a copy of them). LMDB stays the
index: a slab slot counts only once its header-only entry is committed, after its pixels
and label are written (LMDB's commit publishes them to the node's other processes). Without a slab (no fixed resolution, or a
budget too small for the whole part) the pixels go into the LMDB values.

The environment's metadata (format, hvdx version, data-set fingerprint, decoder, and the
node's part: node, number of nodes, split seed) is checked when it is opened; a store of
another data set, version or split is emptied and rebuilt (its name stays: the run replaces
it). The metadata is also written to `STORE.json` in the store's directory, for listing.

Stores outlive their runs (the node's other ranks and later runs reuse them). Every process
that has a store open holds a shared flock on `<store>.users`: `list_stores` tells stores in
use from stale ones, and `remove_store` removes a store only when no process has it open
(`python -m hvdx.data list|clear`). `memory_bytes` bounds it: when it is
full, writes stop with one warning and samples are decoded again when read (read-through).
This module does not import TensorFlow, and imports lmdb only when a store is opened.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import mmap
import os
import struct
import threading
import warnings
import shutil
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from hvdx.data.pages import huge_pages

__all__ = ["DEFAULT_STORE_DIR", "NodeStore", "Sample", "Slab", "StoreInfo", "list_stores", "remove_store",
           "sample_key", "tidy_stores"]

DEFAULT_STORE_DIR = "/dev/shm/hvdx-datacache"

FORMAT = 3  # 3: the key holds the channel count
_HEADER = struct.Struct("<qIII")
_META_KEY = b"\x00meta"
_KEY_SIZE = struct.calcsize(">QIII")  # a sample's key (`sample_key`); other keys are the store's own
_INDEX_BYTES = 128  # LMDB bytes per header-only entry, kept free beside a slab
#: A slab this large on 4 KiB pages is named in a log line (INFO) when a process opens it.
_MAPPING_NOTE_BYTES = 2**30
#: Stores of other data sets that no process uses are named in a RuntimeWarning once they
#: hold this share of their file system (they shrink every job's default memory_bytes);
#: smaller ones in a log line only: a job's other data set (its validation set, opened a
#: moment later) or a finished job's, kept so that a rerun starts warm.
STALE_WARNING_SHARE = 0.1
log = logging.getLogger(__name__)

Sample = Tuple[np.ndarray, int]
"""A decoded sample: uint8 pixels [height, width, channels] and its label."""

_envs: Dict[str, object] = {}  # LMDB allows one Environment per path per process
_envs_lock = threading.Lock()


def sample_key(index: int, resolution: Optional[Tuple[int, int]], channels: int = 3) -> bytes:
    """The store's key of sample `index` at `resolution` ((height, width), None: as decoded)
    with `channels` channels: every property of a sample's bytes that a run chooses."""
    h, w = resolution or (0, 0)
    return struct.pack(">QIII", index, h, w, channels)


def parse_key(key: bytes) -> Tuple[int, Optional[Tuple[int, int]], int]:
    """(sample index, resolution, channels) of a store key (`sample_key`'s inverse)."""
    index, h, w, c = struct.unpack(">QIII", key)
    return index, ((h, w) if h or w else None), c


def encode_sample(image: np.ndarray, label: int) -> bytes:
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"image must be uint8 [height, width, channels], got {image.dtype} {image.shape}")
    return _HEADER.pack(int(label), *image.shape) + np.ascontiguousarray(image).tobytes()


def _aligned_empty(shape: Tuple[int, ...], alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 array whose data is `alignment`-byte aligned: TensorFlow then
    takes it over from a numpy_function without copying it."""
    size = int(np.prod(shape))
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + size].reshape(shape)


_MADV_POPULATE_READ = 22  # Linux 5.14+; not in Python 3.11's mmap module


def _populate(address: int, size: int, keep_alive: mmap.mmap) -> None:
    """Maps a read-only mapping's pages into the page table (madvise MADV_POPULATE_READ,
    through ctypes: the GIL is released meanwhile). Best effort: an older kernel says EINVAL."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), ctypes.c_int(_MADV_POPULATE_READ))
    except (OSError, AttributeError):
        pass
    del keep_alive


class Slab:
    """The node part's samples at one resolution in one flat file: slot j holds sample
    `part[j]` (pixels at j * height * width * channels, its label in the int64 array after
    the pixels, page-aligned). Create with `Slab.create`, open with `Slab(path, part, shape)`."""

    def __init__(self, path: str, part: np.ndarray, shape: Tuple[int, int, int]) -> None:
        self.path = path
        self.part = np.asarray(part, np.int64)
        if self.part.ndim != 1 or np.any(np.diff(self.part) <= 0):
            raise ValueError("part must be a sorted 1-d array of distinct sample indices")
        self.shape = tuple(int(v) for v in shape)
        n = len(self.part)
        self.sample_bytes = int(np.prod(self.shape))
        self.labels_offset = -(-n * self.sample_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = self.labels_offset + 8 * n
        self._fd = os.open(path, os.O_RDWR)
        if os.fstat(self._fd).st_size != self.size:
            os.close(self._fd)
            raise ValueError(f"slab {path} has {os.path.getsize(path)} bytes, expected {self.size}")
        # Read-only mapping: writes go through pwrite. Page-aligned, so TensorFlow takes the
        # arrays over from a numpy_function without copying them.
        self._map = mmap.mmap(self._fd, self.size, prot=mmap.PROT_READ)
        self.pixels = np.frombuffer(self._map, np.uint8, count=n * self.sample_bytes).reshape(n, *self.shape)
        self.labels = np.frombuffer(self._map, np.int64, count=n, offset=self.labels_offset)
        # The pages are in memory (the node's /dev/shm) but not yet in this process's page
        # table: mapping them in the background, while the job builds its model, spares the
        # first epoch one page fault per 64 KiB (a restarted job: ~60 ms per GiB here).
        threading.Thread(target=_populate, args=(self.pixels.ctypes.data, self.size, self._map),
                         name="hvdx-slab-populate", daemon=True).start()

    @staticmethod
    def file_size(n: int, shape: Tuple[int, int, int]) -> int:
        """Bytes of a slab of `n` samples of `shape`: the pixels, page-aligned, then the labels."""
        pixels = n * int(np.prod(shape))
        return -(-pixels // mmap.PAGESIZE) * mmap.PAGESIZE + 8 * n

    @classmethod
    def create(cls, path: str, part: np.ndarray, shape: Tuple[int, int, int]) -> "Slab":
        """A new slab at `path`, its memory allocated whole (OSError ENOSPC if it does not fit),
        published by an atomic rename (the caller holds the store's lock)."""
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, cls.file_size(len(part), shape))
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        return cls(path, part, shape)

    def slots(self, samples: Sequence[int]) -> np.ndarray:
        """The slot of each sample (-1 for one outside the part)."""
        samples = np.asarray(samples, np.int64)
        slots = np.searchsorted(self.part, samples)
        inside = slots < len(self.part)
        inside[inside] = self.part[slots[inside]] == samples[inside]
        return np.where(inside, slots, -1)

    def write(self, slot: int, image: np.ndarray, label: int) -> None:
        """Writes one sample's pixels and label (visible to the node's other processes at once;
        they read it only after its LMDB entry is committed)."""
        if image.shape != self.shape or image.dtype != np.uint8:
            raise ValueError(f"image must be uint8 {self.shape}, got {image.dtype} {image.shape}")
        if not 0 <= slot < len(self.part):
            raise ValueError(f"slot must be in [0, {len(self.part)}), got {slot}")
        for data, offset in ((np.ascontiguousarray(image).reshape(-1).data, slot * self.sample_bytes),
                             (struct.pack("<q", int(label)), self.labels_offset + 8 * slot)):
            if os.pwrite(self._fd, data, offset) != len(data):  # the file is allocated: never short
                raise OSError(f"short write to slab {self.path}")

    def close(self) -> None:
        """Closes the file; the mapping goes when the last array over it does."""
        os.close(self._fd)

    def __repr__(self) -> str:
        return f"Slab({self.path!r}, {len(self.part)} x {self.shape})"


def _open_env(path: str, map_size: int):
    import lmdb

    with _envs_lock:
        env = _envs.get(path)
        if env is None:
            # sync/metasync off: the store lives in memory and is rebuilt if damaged;
            # writemap off: a full /dev/shm is an error from write(), never a SIGBUS.
            env = lmdb.open(path, map_size=map_size, subdir=True, sync=False, metasync=False,
                            readahead=False, meminit=False, max_readers=512, lock=True)
            _envs[path] = env
        return env


class NodeStore:
    """The node's store of decoded samples at `path` (a directory, normally on /dev/shm).

    `meta` identifies what it holds (data set fingerprint, the node's part); a store found
    with other metadata, or written by another hvdx version, is emptied first.
    """

    def __init__(self, path: str, meta: dict, memory_bytes: int) -> None:
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0, got {memory_bytes}")
        from hvdx import version

        self.path = os.path.abspath(path)
        self.meta = {"format": FORMAT, "hvdx": version.__version__, **meta}
        self.memory_bytes = int(memory_bytes)
        self.full = False
        self.rebuilt = False
        self.stats = {"hits": 0, "misses": 0, "puts": 0}
        self._stats_lock = threading.Lock()
        self._slabs: Dict[Tuple[int, int, int], Slab] = {}  # by (height, width, channels)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._users: Optional[int] = _hold_shared(self.path + ".users")  # in use: `remove_store` leaves it alone
        os.makedirs(self.path, exist_ok=True)
        with open(self.path + ".lock", "a+") as lock:  # the node's ranks open it one at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.env = _open_env(self.path, self.memory_bytes)
            self._check_meta()
            _write_json(os.path.join(self.path, "STORE.json"), self.meta)

    def _check_meta(self) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(_META_KEY)
            found = json.loads(raw) if raw is not None else None
            if found == self.meta:
                return
            if found is not None or txn.stat()["entries"] > 0:
                log.warning("hvdx.data: node store %s holds %s; rebuilding it for %s", self.path, found, self.meta)
                self.rebuilt = True
                txn.drop(self.env.open_db(txn=txn), delete=False)
                for slab in glob.glob(os.path.join(self.path, "slab-*")):
                    os.unlink(slab)  # a process still mapping it keeps its pages until it unmaps
            txn.put(_META_KEY, json.dumps(self.meta).encode())

    def slab(self, resolution: Tuple[int, int], channels: int, part: np.ndarray,
             create: bool = True) -> Optional[Slab]:
        """The slab of `part` (the node's sorted sample indices) at `resolution`: opened if a
        rank of the node made it, else made if `create` and the memory budget (less what the
        store holds) fits it whole; None (samples then go into LMDB values) if it does not,
        or if it does not exist and not `create`."""
        h, w = resolution
        shape = (h, w, channels)
        found = self._slabs.get(shape)
        if found is not None:
            return found if found.shape == shape and np.array_equal(found.part, part) else None
        path = os.path.join(self.path, f"slab-{h}x{w}x{channels}-n{len(part)}")
        with open(self.path + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(path):
                slab = Slab(path, part, shape)
            elif not create:
                return None
            else:
                free = self.memory_bytes - self.memory_used()
                size = Slab.file_size(len(part), shape)
                if size + _INDEX_BYTES * len(part) > free:
                    log.warning("hvdx.data: node store %s: a slab of %d bytes at %s does not fit the budget "
                                "(%d bytes left); samples go into LMDB values", self.path, size, resolution, free)
                    return None
                try:
                    slab = Slab.create(path, part, shape)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                        raise
                    log.warning("hvdx.data: node store %s: no room for a slab of %d bytes (%s); samples go "
                                "into LMDB values", self.path, size, exc)
                    return None
        if slab.size >= _MAPPING_NOTE_BYTES and not huge_pages(self.path):
            log.info("hvdx.data: the %.1f GiB slab %s has 4 KiB pages: every process that maps it (a restarted "
                     "job's every rank) builds a page-table entry per 4 KiB, 2 MiB of page table per GiB; a store_dir "
                     "on a tmpfs mounted with huge=within_size needs 512 times fewer (docs/datacache.md, "
                     "\"Huge pages\")", slab.size / 2**30, path)
        self._slabs[shape] = slab
        return slab

    def _slab_of(self, key: bytes) -> Tuple[Optional[Slab], int]:
        """(the slab holding `key`'s sample in this process, its slot), or (None, -1)."""
        if not self._slabs:
            return None, -1
        index, resolution, channels = parse_key(key)
        slab = self._slabs.get((*resolution, channels)) if resolution else None
        if slab is None:
            return None, -1
        return slab, int(slab.slots([index])[0])

    def locate(self, keys: Iterable[bytes]) -> np.ndarray:
        """Per key: 0 missing, 1 in an LMDB value, 2 in a slab (read in one transaction)."""
        with self.env.begin(buffers=True) as txn:
            return np.asarray([0 if v is None else 2 if len(v) == _HEADER.size else 1
                               for v in (txn.get(k) for k in keys)], np.int8)

    @staticmethod
    def _complete_key(slab: Slab) -> bytes:
        return b"\x00slab-complete-" + os.path.basename(slab.path).encode()

    def slab_complete(self, slab: Slab) -> bool:
        """Whether `mark_slab_complete(slab)` was called on this store (by any process)."""
        with self.env.begin(buffers=True) as txn:
            return txn.get(self._complete_key(slab)) is not None

    def mark_slab_complete(self, slab: Slab) -> None:
        """Records that every slot of `slab` is filled (for the node's other and later
        processes); ignored once the store is full."""
        import lmdb

        try:
            with self.env.begin(write=True) as txn:
                txn.put(self._complete_key(slab), b"1")
        except (lmdb.MapFullError, lmdb.DiskError, lmdb.Error):
            pass  # only a shortcut: a later process looks the samples up instead

    def count_hits(self, hits: int, misses: int = 0) -> None:
        """Counts samples found in (or missing from) the store that `get_many`/`get_batch` did
        not read (the slab's are gathered by TensorFlow)."""
        with self._stats_lock:
            self.stats["hits"] += hits
            self.stats["misses"] += misses

    def _pixels(self, key: bytes, value, shape: Tuple[int, int, int]) -> np.ndarray:
        """The pixels of an entry: from its value, or from its slab (header-only entry)."""
        if len(value) > _HEADER.size:
            return np.frombuffer(value, np.uint8, count=int(np.prod(shape)), offset=_HEADER.size).reshape(shape)
        slab, slot = self._slab_of(key)
        if slab is None or slot < 0 or slab.shape != shape:
            raise ValueError(f"hvdx.data: node store {self.path}: entry {parse_key(key)} is in a slab this "
                             "process has not opened")
        return slab.pixels[slot]

    def get_many(self, keys: Sequence[bytes]) -> List[Optional[Sample]]:
        """The samples under `keys` (None where missing), read in one transaction.

        The returned pixels are copies, valid after the transaction ends.
        """
        out: List[Optional[Sample]] = []
        with self.env.begin(buffers=True) as txn:
            for key in keys:
                value = txn.get(key)
                if value is None:
                    out.append(None)
                else:
                    label, h, w, c = _HEADER.unpack_from(value)
                    out.append((self._pixels(key, value, (h, w, c)).copy(), label))
        hits = sum(v is not None for v in out)
        with self._stats_lock:
            self.stats["hits"] += hits
            self.stats["misses"] += len(out) - hits
        return out

    def get_batch(self, keys: Sequence[bytes], shape: Tuple[int, int, int]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """(images [len(keys), *shape], labels) if every key is present with that shape, read
        in one transaction straight into the batch; else None (nothing counted)."""
        images = _aligned_empty((len(keys), *shape))
        labels = np.empty(len(keys), np.int64)
        size = int(np.prod(shape))
        with self.env.begin(buffers=True) as txn:
            for j, key in enumerate(keys):
                value = txn.get(key)
                if value is None or len(value) not in (_HEADER.size, _HEADER.size + size):
                    return None
                label, h, w, c = _HEADER.unpack_from(value)
                if (h, w, c) != tuple(shape):
                    return None
                labels[j] = label
                images[j] = self._pixels(key, value, shape)
        with self._stats_lock:
            self.stats["hits"] += len(keys)
        return images, labels

    def contains(self, keys: Iterable[bytes]) -> List[bool]:
        with self.env.begin(buffers=True) as txn:
            return [txn.get(key) is not None for key in keys]

    def put_many(self, items: Sequence[Tuple[bytes, np.ndarray, int]]) -> bool:
        """Stores (key, image, label) items: pixels of a sample with an open slab go into its
        slot, then every entry goes into LMDB in one transaction (which publishes the slots).
        False (and one warning) once the memory budget is exhausted, after which no LMDB entry
        is written (slab slots still are: this process reads them; the others decode again)."""
        import lmdb

        values = []
        for key, image, label in items:  # slab pixels first: the LMDB commit publishes them
            slab, slot = self._slab_of(key)
            if slab is not None and slot >= 0 and image.shape == slab.shape and image.dtype == np.uint8:
                slab.write(slot, image, label)
                values.append(_HEADER.pack(int(label), *image.shape))
            else:
                values.append(encode_sample(image, label))
        if self.full or not items:
            return not self.full
        try:
            with self.env.begin(write=True) as txn:
                for (key, _, _), value in zip(items, values):
                    txn.put(key, value, overwrite=False)
        except (lmdb.MapFullError, lmdb.DiskError, lmdb.Error) as exc:
            self.full = True
            warnings.warn(f"hvdx.data: node store {self.path} is full ({exc.__class__.__name__}: {exc}; "
                          f"memory_bytes={self.memory_bytes}): samples not yet in it are decoded again "
                          "whenever they are read", RuntimeWarning, stacklevel=2)
            return False
        with self._stats_lock:
            self.stats["puts"] += len(items)
        return True

    def keys(self) -> List[bytes]:
        """Every sample key in the store (not the store's own keys: metadata, slab markers)."""
        with self.env.begin() as txn:
            return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False) if len(k) == _KEY_SIZE]

    def memory_used(self) -> int:
        """Bytes the store occupies in memory (its files' allocated blocks on /dev/shm: the
        LMDB environment and the slabs)."""
        files = [os.path.join(self.path, "data.mdb")] + glob.glob(os.path.join(self.path, "slab-*"))
        total = 0
        for f in files:
            try:
                total += os.stat(f).st_blocks * 512
            except FileNotFoundError:  # a slab being published or removed
                pass
        return total

    def close(self) -> None:
        """Closes this process' handle (every NodeStore of this path in the process shares it).
        The store stays on /dev/shm for the node's other ranks and later runs."""
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()
        with _envs_lock:
            if _envs.get(self.path) is self.env:
                del _envs[self.path]
        self.env.close()
        if self._users is not None:
            os.close(self._users)  # releases the shared flock
            self._users = None

    def __repr__(self) -> str:
        return f"NodeStore({self.path!r}, {self.memory_bytes} bytes)"


# -- the stores of a directory: in use or stale, listing and removal ---------------------------

def _hold_shared(path: str) -> int:
    """An fd holding a shared flock on `path` (the file a remover locks exclusively); retried
    if a remover unlinked the file between our open and our lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@dataclass(frozen=True)
class StoreInfo:
    """A node store found in a directory: its path, bytes in memory, whether a process has it
    open, and its metadata (`STORE.json`; None for a store of an older hvdx)."""

    path: str
    bytes: int
    in_use: bool
    meta: Optional[dict]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _in_use(path: str) -> bool:
    try:
        fd = os.open(path + ".users", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases our lock if we got it


def _allocated(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def list_stores(directory: str) -> List[StoreInfo]:
    """Every node store in `directory` (a sub-directory holding an LMDB environment), sorted
    by name; [] if the directory does not exist."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(os.path.join(path, "data.mdb")):
            continue
        try:
            with open(os.path.join(path, "STORE.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = None
        out.append(StoreInfo(path, _allocated(path), _in_use(path), meta))
    return out


def remove_store(path: str) -> bool:
    """Removes the node store at `path` (its directory and lock files) unless a process has it
    open; True if it was removed. Its memory is freed once no process maps it."""
    path = os.path.abspath(path)
    try:
        fd = os.open(path + ".users", os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        for suffix in (".lock", ".users"):  # a later opener makes new ones (see _hold_shared)
            try:
                os.unlink(path + suffix)
            except FileNotFoundError:
                pass
        return not os.path.exists(path)
    finally:
        os.close(fd)


def tidy_stores(directory: str, own: str, location: str, num_nodes: int) -> None:
    """Removes the stores in `directory` that a job with store `own` replaces (stores of data
    set `location` that no process uses, made for another node count or for nodes >=
    `num_nodes`, which the job no longer has) and names the stores
    of other data sets there that no process uses: in a RuntimeWarning once they hold
    STALE_WARNING_SHARE of the file system, else in a log line (hvdx.data, INFO)."""
    stale = []
    for info in list_stores(directory):
        if info.path == own or info.in_use:
            continue
        meta = info.meta or {}
        if meta.get("location") == location:
            other = int(meta.get("node", 0)) >= num_nodes or int(meta.get("num_nodes", num_nodes)) != num_nodes
            if other and remove_store(info.path):
                log.info("hvdx.data: removed %s (node %s of an earlier job)", info.path, meta.get("node"))
            continue  # a node of this job that has not opened its store yet
        stale.append(info)
    if not stale:
        return
    held = sum(i.bytes for i in stale)
    message = (f"hvdx.data: {directory} holds {len(stale)} stale node store(s) of other data sets that no process "
               f"uses ({held / 2**20:.1f} MiB of memory, which also shrinks the default memory_bytes): "
               f"{', '.join(i.name for i in stale)}; list them with `python -m hvdx.data list --store-dir "
               f"{directory}` and remove them with `python -m hvdx.data clear --store-dir {directory}`")
    st = os.statvfs(directory)
    if held >= STALE_WARNING_SHARE * st.f_blocks * st.f_frsize:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        log.info("%s", message)
