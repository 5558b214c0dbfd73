"""The page size a node store's files get in memory: 4 KiB, or transparent huge pages.

A process that maps a slab (`hvdx.data.store.Slab`) builds one page-table entry per page of
it: with 4 KiB pages a restarted job's every rank pays that per GiB of slab (the kernel's
time, and 2 MiB of page table per GiB per process), with 2 MiB huge pages 512 times less.
Linux gives a tmpfs file huge pages when the tmpfs is mounted with `huge=always` or
`huge=within_size` (or `/sys/kernel/mm/transparent_hugepage/shmem_enabled` says `force`);
/dev/shm normally has neither. docs/datacache.md, "Huge pages"; benchmarks/README.md
measures the mapping. Linux only: elsewhere nothing is huge.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

__all__ = ["HUGE_MOUNT_OPTIONS", "huge_pages", "mount_of"]

#: tmpfs `huge=` values under which a file's pages are allocated huge by write and fallocate
#: (`advise` gives huge pages only to a mapping that asks, which a slab, written with pwrite, is not).
HUGE_MOUNT_OPTIONS = ("always", "within_size")

_MOUNTINFO = "/proc/self/mountinfo"
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (\\040 for a space) decoded."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: str, mountinfo: str) -> Optional[Tuple[str, str, str]]:
    """(mount point, file-system type, super-block options) of the mount holding `path` (an
    absolute, symlink-free path) in `mountinfo` (the text of /proc/self/mountinfo); the last
    of several mounts at one point is the visible one. None if no line parses."""
    best: Optional[Tuple[str, str, str]] = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 3:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else "")
    return best


def _selected(text: str) -> str:
    """The bracketed choice of a sysfs setting ("always [never] deny" -> "never")."""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def huge_pages(directory: str, *, mountinfo: Optional[str] = None, shmem_enabled: Optional[str] = None) -> bool:
    """Whether a file written under `directory` (or under its nearest existing parent) gets
    transparent huge pages: it is on a tmpfs mounted with huge=always or huge=within_size, or
    the kernel forces them on every tmpfs (shmem_enabled "force"), and does not deny them
    ("deny"). False off Linux or where /proc cannot be read.

    Args:
        directory: the store directory (DataCache's `store_dir`).
        mountinfo, shmem_enabled: the texts of /proc/self/mountinfo and of the sysfs setting
            (default: read from the running system).
    """
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    path = os.path.realpath(path)
    mountinfo = _read(_MOUNTINFO) if mountinfo is None else mountinfo
    if not mountinfo:
        return False
    mount = mount_of(path, mountinfo)
    if mount is None or mount[1] != "tmpfs":
        return False
    setting = _read(_SHMEM_ENABLED) if shmem_enabled is None else shmem_enabled
    forced = _selected(setting) if setting else ""
    if forced == "deny":
        return False
    options = dict(o.partition("=")[::2] for o in mount[2].split(","))
    return forced == "force" or options.get("huge") in HUGE_MOUNT_OPTIONS
