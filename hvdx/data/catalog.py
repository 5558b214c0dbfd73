"""What a DataCache data set holds: its samples, where each one's bytes are, and its label.

Two inputs (shi2021 sec. 4.1 caches ImageNet):

- `ImageFolder`: an ImageNet-style tree, one sub-folder per class (labels are the sorted
  class names' positions), image files inside; one sample per file.
- `TFRecordShards`: TFRecord files of `tf.train.Example`s holding the encoded image and
  its label (ImageNet's `image/encoded` and `image/class/label` by default); one sample
  per record, numbered shard * 2**32 + record. A shard is fetched whole through level 1,
  its records located by their length headers, and read from the local copy.

The fingerprint (a hash of the kind, root, file list and every file's size and mtime)
identifies the data set's content in the node store's metadata: a file replaced in place
changes it, and the store is rebuilt. The location (a hash of the kind and root) names the
caches: a later run over the same folder replaces the earlier run's store instead of adding
one beside it. Each file's stamp (size and mtime) names its level-1 copy.
"""
from __future__ import annotations

import hashlib
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvdx.data.disk import DiskCache
from hvdx.data.source import Source

__all__ = ["ImageFolder", "TFRecordShards", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
RECORD_STRIDE = 2**32


def _fingerprint(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


@dataclass
class ImageFolder:
    """The image files under `root`, one sub-folder per class."""

    root: str
    source: Source
    extensions: Sequence[str] = IMAGE_EXTENSIONS
    classes: List[str] = field(init=False)
    paths: List[str] = field(init=False)
    labels: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        root = self.root.rstrip("/")
        if not self.source.isdir(root):
            raise ValueError(f"root {self.root!r} is not a directory")
        names = [c.rstrip("/") for c in self.source.listdir(root)]
        self.classes = [c for c in names if self.source.isdir(f"{root}/{c}")]
        if not self.classes:
            raise ValueError(f"root {self.root!r} has no class sub-folders (expected root/<class>/<image>)")
        paths, labels, stamps = [], [], []
        exts = tuple(e.lower() for e in self.extensions)
        for label, name in enumerate(self.classes):
            for f in self.source.listdir(f"{root}/{name}"):
                if f.lower().endswith(exts):
                    path = f"{root}/{name}/{f}"
                    paths.append(path)
                    labels.append(label)
                    stamps.append("%d:%d" % self.source.stat(path))
        if not paths:
            raise ValueError(f"root {self.root!r} holds no files ending in {list(exts)}")
        self.paths, self.labels, self.stamps = paths, np.asarray(labels, np.int64), stamps
        self.location = _fingerprint("folder", root)
        self.fingerprint = _fingerprint("folder", root, self.classes, [p[len(root):] for p in paths], stamps)

    def __len__(self) -> int:
        return len(self.paths)

    def ids(self) -> np.ndarray:
        return np.arange(len(self.paths), dtype=np.int64)

    def describe(self, sample: int) -> str:
        return self.paths[sample]

    def read(self, sample: int, disk: DiskCache) -> Tuple[bytes, Optional[int]]:
        """The encoded image of `sample` and its label."""
        return disk.read(self.paths[sample], self.stamps[sample]), int(self.labels[sample])


_LEN = struct.Struct("<QI")


def record_offsets(blob: bytes, name: str) -> List[Tuple[int, int]]:
    """(offset, length) of each record's payload in a TFRecord file's bytes."""
    out, pos = [], 0
    while pos < len(blob):
        if pos + _LEN.size > len(blob):
            raise ValueError(f"truncated TFRecord file {name}: a header is cut at byte {pos}")
        length, _ = _LEN.unpack_from(blob, pos)
        start = pos + _LEN.size
        if start + length + 4 > len(blob):
            raise ValueError(f"truncated TFRecord file {name}: record at byte {pos} needs {length} bytes")
        out.append((start, length))
        pos = start + length + 4
    return out


@dataclass
class TFRecordShards:
    """The records of the TFRecord files matching `pattern` (a glob, or a list of paths)."""

    pattern: object
    source: Source
    image_key: str = "image/encoded"
    label_key: str = "image/class/label"
    shards: List[str] = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.pattern, (list, tuple)):
            self.shards = sorted(str(p) for p in self.pattern)
        else:
            self.shards = self.source.glob(str(self.pattern))
        if not self.shards:
            raise ValueError(f"pattern {self.pattern!r} matches no TFRecord file")
        self.stamps = ["%d:%d" % self.source.stat(p) for p in self.shards]
        folders = sorted({os.path.dirname(p) for p in self.shards})
        self.location = _fingerprint("tfrecord", folders, self.image_key, self.label_key)
        self.fingerprint = _fingerprint("tfrecord", self.shards, self.image_key, self.label_key, self.stamps)
        self._index: Dict[int, List[Tuple[int, int]]] = {}
        self._blobs: Dict[int, bytes] = {}  # shards kept in memory when level 1 cannot keep them
        self._lock = threading.Lock()

    def index(self, shards: Sequence[int], disk: DiskCache) -> np.ndarray:
        """Fetches `shards` (through level 1) and returns their sample ids."""
        ids = []
        for s in shards:
            blob = disk.read(self.shards[s], self.stamps[s])
            offsets = record_offsets(blob, self.shards[s])
            with self._lock:
                self._index[s] = offsets
                if disk.keep and not os.path.exists(disk.path_of(self.shards[s], self.stamps[s])):
                    self._blobs[s] = blob
            ids.extend(s * RECORD_STRIDE + r for r in range(len(offsets)))
        return np.asarray(ids, np.int64)

    def describe(self, sample: int) -> str:
        shard, record = divmod(int(sample), RECORD_STRIDE)
        return f"{self.shards[shard]} record {record}"

    def read(self, sample: int, disk: DiskCache) -> Tuple[bytes, Optional[int]]:
        """The Example's encoded image and label (from the local copy of its shard)."""
        import tensorflow as tf

        shard, record = divmod(int(sample), RECORD_STRIDE)
        offset, length = self._index[shard][record]
        blob = self._blobs.get(shard)
        if blob is not None:
            payload = blob[offset:offset + length]
        else:
            # the level-1 copy, or the file itself when it is on a local disk (no copies kept)
            local = disk.path_of(self.shards[shard], self.stamps[shard]) if disk.keep else self.shards[shard]
            try:
                with open(local, "rb") as f:
                    f.seek(offset)
                    payload = f.read(length)
                if len(payload) != length:
                    raise OSError("short read")
            except OSError:  # the copy was evicted or damaged: fetch the shard again
                payload = disk.read(self.shards[shard], self.stamps[shard])[offset:offset + length]
        example = tf.train.Example.FromString(payload)
        feature = example.features.feature
        if self.image_key not in feature:
            raise ValueError(f"{self.describe(sample)} has no feature {self.image_key!r}")
        image = feature[self.image_key].bytes_list.value[0]
        label = None
        if self.label_key in feature:
            values = feature[self.label_key].int64_list.value
            label = int(values[0]) if values else None
        return image, label
