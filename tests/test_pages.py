"""hvdx.data.pages: which store directories give a slab transparent huge pages (issue 45:
a restarted job's every rank maps its node's slab; with 4 KiB pages that costs one page-table
entry per 4 KiB, with huge pages 512 times fewer)."""
from __future__ import annotations

import pytest

from hvdx.data.pages import huge_pages, mount_of

# /proc/self/mountinfo of a node: / on ext4, /dev/shm a plain tmpfs, /mnt/hvdx a tmpfs with
# huge pages, /mnt/hvdx/advise one whose files get them only through a mapping that asks,
# and a mount point with a space in its name.
MOUNTINFO = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=24683664k
40 22 0:40 / /mnt/hvdx rw,relatime shared:20 - tmpfs hvdx rw,size=67108864k,huge=within_size
41 40 0:41 / /mnt/hvdx/advise rw,relatime shared:21 - tmpfs hvdx rw,size=1048576k,huge=advise
42 22 0:42 / /mnt/my\\040store rw,relatime - tmpfs tmpfs rw,huge=always
"""
NEVER = "always within_size advise [never] deny force"


@pytest.mark.parametrize("path, huge", [
    ("/mnt/hvdx", True),
    ("/mnt/hvdx/hvdx-datacache/store-node0of2", True),  # below the mount point
    ("/mnt/hvdx/advise/x", False),  # the innermost mount decides: huge=advise
    ("/mnt/hvdxx", False),  # a prefix of the name is not a parent
    ("/dev/shm/hvdx-datacache", False),
    ("/mnt/my store/x", True),  # \040 in mountinfo is a space
    ("/tmp", False),  # not a tmpfs
])
def test_huge_pages_come_from_the_innermost_tmpfs_mounted_with_huge_always_or_within_size(path, huge, monkeypatch):
    monkeypatch.setattr("os.path.exists", lambda p: True)
    monkeypatch.setattr("os.path.realpath", lambda p: p)
    assert huge_pages(path, mountinfo=MOUNTINFO, shmem_enabled=NEVER) is huge


def test_the_kernel_setting_forces_or_denies_huge_pages_on_every_tmpfs(monkeypatch):
    monkeypatch.setattr("os.path.exists", lambda p: True)
    monkeypatch.setattr("os.path.realpath", lambda p: p)
    force = "always within_size advise never deny [force]"
    deny = "always within_size advise never [deny] force"
    assert huge_pages("/dev/shm/x", mountinfo=MOUNTINFO, shmem_enabled=force)
    assert not huge_pages("/tmp/x", mountinfo=MOUNTINFO, shmem_enabled=force)  # ext4 stays ext4
    assert not huge_pages("/mnt/hvdx/x", mountinfo=MOUNTINFO, shmem_enabled=deny)
    assert huge_pages("/mnt/hvdx/x", mountinfo=MOUNTINFO, shmem_enabled="")  # no THP setting to read


def test_mount_of_names_the_mount_a_path_is_on_and_later_mounts_hide_earlier_ones():
    assert mount_of("/mnt/hvdx/a", MOUNTINFO) == ("/mnt/hvdx", "tmpfs", "rw,size=67108864k,huge=within_size")
    over = MOUNTINFO + "43 25 0:43 / /dev/shm rw - tmpfs tmpfs rw,huge=within_size\n"  # mounted over /dev/shm
    assert mount_of("/dev/shm/a", over)[2] == "rw,huge=within_size"
    assert mount_of("/x", "garbage\n\n1 2 3\n") is None


def test_the_running_system_is_read_and_a_directory_not_made_yet_is_judged_by_its_parent(tmp_path):
    assert isinstance(huge_pages("/dev/shm"), bool)
    assert huge_pages(str(tmp_path / "not" / "made")) == huge_pages(str(tmp_path))
    assert not huge_pages(str(tmp_path), mountinfo="")  # /proc unreadable: nothing is huge
