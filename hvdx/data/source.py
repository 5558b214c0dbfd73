"""Where DataCache reads training files from: the slow shared storage of shi2021 sec. 4.1.

A source reads a whole file by path. `GFileSource` reads any path `tf.io.gfile` can read
(local, NFS mounts, gs://, hdfs://); `CountingSource` counts what passes through another
source (tests check that the second epoch reads nothing); `SlowSource` adds the latency of
each open and the time of each MiB of a network file system (the benchmark's stand-in for
NFS, FUSE-free: it sleeps, so it costs no CPU and overlaps like real I/O).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Tuple

__all__ = ["CountingSource", "GFileSource", "SlowSource", "Source", "filesystem_type"]

# File systems on a disk (or in memory) of this machine: a local copy of their files saves
# nothing. Anything else (nfs, cifs, fuse.*, lustre, gpfs, ceph, 9p, ...) counts as remote.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs", "overlay",
                               "jfs", "reiserfs", "bcachefs", "nilfs2", "vfat", "exfat", "ntfs3"})


def filesystem_type(path: str) -> str:
    """The type of the file system holding local `path` (its longest mount point in
    /proc/mounts; "" if unknown)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return ""
    path = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


class Source:
    """Reads files by path. Subclasses implement `read` and may override `listdir`/`isdir`/
    `glob`/`stat`."""

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def stat(self, path: str) -> Tuple[int, int]:
        """(size in bytes, modification time in ns) of `path`: a file replaced in place
        changes them, and with them the data set's fingerprint (DataCache decodes it again)."""
        if "://" not in path:
            st = os.stat(path)
            return st.st_size, st.st_mtime_ns
        import tensorflow as tf

        st = tf.io.gfile.stat(path)
        return int(st.length), int(st.mtime_nsec)

    def is_local(self, path: str) -> bool:
        """Whether `path` is on a disk of this machine, where a level-1 copy saves nothing.
        False unless a source knows better (a wrapper that changes the cost of reads, such
        as `SlowSource` or a counting one, keeps level 1)."""
        return False

    def listdir(self, path: str) -> List[str]:
        import tensorflow as tf

        return sorted(tf.io.gfile.listdir(path))

    def isdir(self, path: str) -> bool:
        import tensorflow as tf

        return tf.io.gfile.isdir(path)

    def glob(self, pattern: str) -> List[str]:
        import tensorflow as tf

        return sorted(tf.io.gfile.glob(pattern))


class GFileSource(Source):
    """Any path `tf.io.gfile` can read."""

    def read(self, path: str) -> bytes:
        import tensorflow as tf

        with tf.io.gfile.GFile(path, "rb") as f:
            return f.read()

    def is_local(self, path: str) -> bool:
        """True for a path (no URL scheme) on a local file system (`LOCAL_FILESYSTEMS`)."""
        return "://" not in path and filesystem_type(path) in LOCAL_FILESYSTEMS

    def __repr__(self) -> str:
        return "GFileSource()"


class _Wrapper(Source):
    """A source that reads through `inner` (listing is `inner`'s)."""

    inner: Source

    def listdir(self, path: str) -> List[str]:
        return self.inner.listdir(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def glob(self, pattern: str) -> List[str]:
        return self.inner.glob(pattern)

    def stat(self, path: str) -> Tuple[int, int]:
        return self.inner.stat(path)


class CountingSource(_Wrapper):
    """Counts the reads (and bytes) that go through `inner`, per path; thread-safe."""

    def __init__(self, inner: Source | None = None) -> None:
        self.inner = inner or GFileSource()
        self._lock = threading.Lock()
        self.reads: Dict[str, int] = {}
        self.bytes_read = 0

    def read(self, path: str) -> bytes:
        data = self.inner.read(path)
        with self._lock:
            self.reads[path] = self.reads.get(path, 0) + 1
            self.bytes_read += len(data)
        return data

    @property
    def total_reads(self) -> int:
        with self._lock:
            return sum(self.reads.values())

    def reset(self) -> None:
        with self._lock:
            self.reads.clear()
            self.bytes_read = 0


class SlowSource(_Wrapper):
    """`inner` slowed to a network file system: `latency_s` per open plus 1/`mib_per_s` s per MiB.

    The delay is a sleep, so concurrent reads overlap as they do against a real server
    (`max_concurrent` caps how many are served at once, like a server's threads).
    """

    def __init__(self, inner: Source | None = None, latency_s: float = 0.005, mib_per_s: float = 100.0,
                 max_concurrent: int = 64) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if mib_per_s <= 0:
            raise ValueError(f"mib_per_s must be > 0, got {mib_per_s}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.inner = inner or GFileSource()
        self.latency_s = latency_s
        self.mib_per_s = mib_per_s
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def read(self, path: str) -> bytes:
        with self._slots:
            start = time.perf_counter()
            data = self.inner.read(path)
            delay = self.latency_s + len(data) / (self.mib_per_s * 2**20)
            time.sleep(max(0.0, delay - (time.perf_counter() - start)))
        return data


    def __repr__(self) -> str:
        return f"SlowSource(latency_s={self.latency_s}, mib_per_s={self.mib_per_s})"
