"""Level 1 of DataCache (shi2021 sec. 4.1, Fig. 5): a local-disk copy of every file read.

The first read of a file from its source also stores it under a local directory; later
reads, in this run and in later runs (hyper-parameter sweeps, restarts), read the copy.

- One writer per file per machine: the writer holds an flock on one of 256 lock files
  (chosen by the file's key), re-checks, fetches, and publishes atomically (temp file +
  rename). Other processes or threads wanting the same file wait and then read the copy.
- Every copy is the source's bytes followed by a 16-byte trailer (magic, size, CRC32 of
  the bytes, as fetched): a copy whose size or checksum does not match is fetched again.
- `max_bytes` bounds the directory: least recently used copies (by mtime, touched on
  every hit) leave first, down to 90 % of the bound.
- A full disk (or any failure to write) degrades to reading through, with one warning.
- A copy's name is a hash of the source path and its stamp (the caller's size and mtime
  of the file): a file replaced in place under the same name is fetched again.
- `CACHE.json` records the data set's fingerprint and hvdx's version; a directory written
  for another data set or another version is emptied and rebuilt.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import warnings
import zlib
from contextlib import contextmanager
from typing import Iterator, Optional

from hvdx.data.source import GFileSource, Source

__all__ = ["DiskCache", "FORMAT", "default_cache_dir"]

FORMAT = 2  # 2: copies named by path and stamp
_TRAILER = struct.Struct("<4sQI")  # magic, size of the source's bytes, CRC32 of them
_MAGIC = b"HVDC"
_LOW_WATER = 0.9
log = logging.getLogger(__name__)


def default_cache_dir() -> str:
    """Level 1's default base directory: `$HVDX_DATACACHE_DIR`, else node-local scratch,
    `$TMPDIR/hvdx-datacache-<uid>` (/tmp when TMPDIR is unset). Not ~/.cache: home
    directories of clusters are often on NFS, the storage level 1 is there to avoid."""
    explicit = os.environ.get("HVDX_DATACACHE_DIR")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"hvdx-datacache-{os.getuid()}")


def _version() -> str:
    """The running hvdx's version (read at each call: a test may change it)."""
    from hvdx import version

    return version.__version__


class DiskCache:
    """Local-disk copies of the files of one data set, under `directory`.

    `fingerprint` names the data set (DataCache passes a hash of its location); `source`
    is where misses are read from; `max_bytes` bounds the directory (None: unbounded);
    `keep=False` makes no copies (every read goes to the source, counted as read_through:
    DataCache's choice for a source already on a local disk) and creates nothing.
    """

    def __init__(self, directory: str, fingerprint: str, source: Optional[Source] = None,
                 max_bytes: Optional[int] = None, keep: bool = True) -> None:
        if not directory:
            raise ValueError("directory must be a non-empty path")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0 or None, got {max_bytes}")
        self.directory = os.path.abspath(directory)
        self.fingerprint = fingerprint
        self.source = source or GFileSource()
        self.max_bytes = max_bytes
        self.stats = {"hits": 0, "misses": 0, "refetched": 0, "evicted": 0, "read_through": 0}
        self._stats_lock = threading.Lock()
        self._writable = True
        self._warned = False
        self._files = os.path.join(self.directory, "files")
        self._locks = os.path.join(self.directory, "locks")
        self._bytes: Optional[int] = None  # this process' estimate of the directory's size
        self.keep = keep
        if not keep:
            self._writable, self._warned = False, True  # read through, silently
            return
        try:
            self._open()
        except OSError as exc:
            self._disable(f"cannot use the level-1 cache directory {self.directory} ({exc})")

    # -- opening: detect a directory of another data set or version -----------------------

    def _open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        meta = {"format": FORMAT, "hvdx": _version(), "fingerprint": self.fingerprint}
        meta_path = os.path.join(self.directory, "CACHE.json")
        with open(os.path.join(self.directory, ".open.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(meta_path) as f:
                    found = json.load(f)
            except (OSError, ValueError):
                found = None
            if found != meta:
                if found is not None or os.path.exists(self._files):
                    log.warning("hvdx.data: level-1 cache %s was written for %s; rebuilding it for %s",
                                self.directory, found, meta)
                for name in ("files", "locks"):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                tmp = f"{meta_path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(meta, f)
                os.replace(tmp, meta_path)
            os.makedirs(self._files, exist_ok=True)
            os.makedirs(self._locks, exist_ok=True)

    def _disable(self, why: str) -> None:
        self._writable = False
        if not self._warned:
            self._warned = True
            warnings.warn(f"hvdx.data: {why}; reading through to the source from now on", RuntimeWarning,
                          stacklevel=3)

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    # -- reading -----------------------------------------------------------------------------

    def path_of(self, path: str, stamp: str = "") -> str:
        """Where the copy of source file `path` with `stamp` (e.g. its size and mtime) lives
        (whether or not it exists)."""
        key = hashlib.sha1(f"{path}\0{stamp}".encode()).hexdigest()
        return os.path.join(self._files, key[:2], key)

    def read(self, path: str, stamp: str = "") -> bytes:
        """The bytes of source file `path`: the local copy made for the same `stamp` (the
        file's size and mtime when the caller listed it) if valid, else fetched (and kept)."""
        local = self.path_of(path, stamp)
        data = self._read_valid(local)
        if data is not None:
            self._count("hits")
            return data
        if not self._writable:
            self._count("read_through")
            return self.source.read(path)
        with self._file_lock(local):
            data = self._read_valid(local)  # another writer may have published it meanwhile
            if data is not None:
                self._count("hits")
                return data
            if os.path.exists(local):
                self._count("refetched")
                log.warning("hvdx.data: cached copy of %s is damaged; fetching it again", path)
            data = self.source.read(path)
            self._count("misses")
            self._write(local, data)
        return data

    def _read_valid(self, local: str) -> Optional[bytes]:
        try:
            with open(local, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        if len(blob) < _TRAILER.size:
            return None
        magic, size, crc = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
        data = blob[:-_TRAILER.size]
        if magic != _MAGIC or size != len(data) or crc != zlib.crc32(data):
            return None
        if self.max_bytes is not None:
            try:
                os.utime(local)  # least recently used leaves first
            except OSError:
                pass
        return data

    @contextmanager
    def _file_lock(self, local: str) -> Iterator[None]:
        stripe = os.path.basename(local)[:2]
        with open(os.path.join(self._locks, f"{stripe}.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- writing -----------------------------------------------------------------------------

    def _write(self, local: str, data: bytes) -> None:
        size = len(data) + _TRAILER.size
        try:
            if self.max_bytes is not None:
                self._make_room(size)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            tmp = f"{local}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.write(_TRAILER.pack(_MAGIC, len(data), zlib.crc32(data)))
                os.replace(tmp, local)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            if self._bytes is not None:
                self._bytes += size
        except OSError as exc:
            why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            self._disable(f"cannot write the level-1 cache {self.directory}: {why}")

    def _make_room(self, incoming: int) -> None:
        if self._bytes is None:
            self._bytes = self.size_bytes()
        if self._bytes + incoming <= self.max_bytes:
            return
        with open(os.path.join(self._locks, "evict.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = []
            for root, _, names in os.walk(self._files):
                for name in names:
                    if name.endswith(".tmp"):
                        continue
                    full = os.path.join(root, name)
                    try:
                        st = os.stat(full)
                    except OSError:
                        continue
                    entries.append((st.st_mtime, st.st_size, full))
            total = sum(size for _, size, _ in entries)
            target = _LOW_WATER * self.max_bytes - incoming
            for _, size, full in sorted(entries):
                if total <= target:
                    break
                try:
                    os.unlink(full)
                    total -= size
                    self._count("evicted")
                except OSError:
                    pass
            self._bytes = total

    def size_bytes(self) -> int:
        """Bytes held by the copies (trailers included)."""
        total = 0
        for root, _, names in os.walk(self._files):
            for name in names:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return total
