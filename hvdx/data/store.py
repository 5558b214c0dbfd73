"""Level 2 of DataCache (shi2021 sec. 4.1, Fig. 5): decoded samples in node memory.

The paper keeps pre-processed samples in a key-value store keyed by the sample index; hvdx
keys them by (sample index, resolution), since progressive resizing changes the resolution
per phase. The store is one LMDB environment on /dev/shm per node: memory-mapped, so the
node's local ranks share one copy instead of holding one each, and filled by all of them at
once (LMDB serialises writers with its own lock; readers never block).

A value is a sample after decoding and resizing, before augmentation: a 20-byte header
(label as int64, height, width, channels as uint32) then the uint8 pixels.

The environment's metadata (format, hvdx version, data-set fingerprint, and the node's
part: node, number of nodes, split seed) is checked when it is opened; a store of another
data set, version or split is emptied and rebuilt. `memory_bytes` bounds it: when it is
full, writes stop with one warning and samples are decoded again when read (read-through).
This module does not import TensorFlow, and imports lmdb only when a store is opened.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["NodeStore", "Sample", "sample_key"]

FORMAT = 1
_HEADER = struct.Struct("<qIII")
_META_KEY = b"\x00meta"
log = logging.getLogger(__name__)

Sample = Tuple[np.ndarray, int]
"""A decoded sample: uint8 pixels [height, width, channels] and its label."""

_envs: Dict[str, object] = {}  # LMDB allows one Environment per path per process
_envs_lock = threading.Lock()


def sample_key(index: int, resolution: Optional[Tuple[int, int]]) -> bytes:
    """The store's key of sample `index` at `resolution` ((height, width), None: as decoded)."""
    h, w = resolution or (0, 0)
    return struct.pack(">QII", index, h, w)


def encode_sample(image: np.ndarray, label: int) -> bytes:
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"image must be uint8 [height, width, channels], got {image.dtype} {image.shape}")
    return _HEADER.pack(int(label), *image.shape) + np.ascontiguousarray(image).tobytes()


def decode_sample(value: bytes) -> Sample:
    label, h, w, c = _HEADER.unpack_from(value)
    pixels = np.frombuffer(value, np.uint8, count=h * w * c, offset=_HEADER.size)
    return pixels.reshape(h, w, c), label


def _aligned_empty(shape: Tuple[int, ...], alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 array whose data is `alignment`-byte aligned: TensorFlow then
    takes it over from a numpy_function without copying it."""
    size = int(np.prod(shape))
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + size].reshape(shape)


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
        from hvdx.data import _hvdx_version

        self.path = os.path.abspath(path)
        self.meta = {"format": FORMAT, "hvdx": _hvdx_version(), **meta}
        self.memory_bytes = int(memory_bytes)
        self.full = False
        self.rebuilt = False
        self.stats = {"hits": 0, "misses": 0, "puts": 0}
        self._stats_lock = threading.Lock()
        os.makedirs(self.path, exist_ok=True)
        with open(self.path + ".lock", "a+") as lock:  # the node's ranks open it one at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.env = _open_env(self.path, self.memory_bytes)
            self._check_meta()

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
            txn.put(_META_KEY, json.dumps(self.meta).encode())

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
                    image, label = decode_sample(value)
                    out.append((image.copy(), label))
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
                if value is None or len(value) != _HEADER.size + size:
                    return None
                labels[j] = _HEADER.unpack_from(value)[0]
                images[j] = np.frombuffer(value, np.uint8, count=size, offset=_HEADER.size).reshape(shape)
        with self._stats_lock:
            self.stats["hits"] += len(keys)
        return images, labels

    def contains(self, keys: Iterable[bytes]) -> List[bool]:
        with self.env.begin(buffers=True) as txn:
            return [txn.get(key) is not None for key in keys]

    def put_many(self, items: Sequence[Tuple[bytes, np.ndarray, int]]) -> bool:
        """Stores (key, image, label) items in one transaction; False (and one warning) once
        the memory budget is exhausted, after which nothing more is written."""
        import lmdb

        if self.full or not items:
            return not self.full
        try:
            with self.env.begin(write=True) as txn:
                for key, image, label in items:
                    txn.put(key, encode_sample(image, label), overwrite=False)
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
        """Every sample key in the store (not the metadata)."""
        with self.env.begin() as txn:
            return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False) if k != _META_KEY]

    def memory_used(self) -> int:
        """Bytes the store occupies in memory (its file's allocated blocks on /dev/shm)."""
        st = os.stat(os.path.join(self.path, "data.mdb"))
        return st.st_blocks * 512

    def close(self) -> None:
        """Closes this process' handle (every NodeStore of this path in the process shares it).
        The store stays on /dev/shm for the node's other ranks and later runs."""
        with _envs_lock:
            if _envs.get(self.path) is self.env:
                del _envs[self.path]
        self.env.close()

    def __repr__(self) -> str:
        return f"NodeStore({self.path!r}, {self.memory_bytes} bytes)"
