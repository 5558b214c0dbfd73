"""hvdx.shm: the shared-memory segment kit of the node engine and the shared model, claim by
claim, in this process (and in children that create a segment and die): the common header,
create / attach / unlink, the sweep of dead creators' segments, header mismatches refused,
alignment, pid_alive. The kinds' own tests: tests/test_node_shm.py, tests/test_asynchronous.py."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hvdx import shm
from tests.harness import ROOT


class ToyError(RuntimeError):
    pass


TOY = shm.Kind(prefix="hvdx-test-toy-", magic=b"HVDXTOY1", version=3, header_bytes=64, what="toy segment",
               creator="the toy's creator", error=ToyError)
# a kind whose names carry the creator's pid (as the shared model's)
NAMED = shm.Kind(prefix="hvdx-test-named-", magic=b"HVDXTOY2", version=1, header_bytes=64, what="named segment",
                 creator="the named creator", error=ToyError, pid_in_name=True)


class Toy(shm.Segment):
    """A segment of TOY: one u64 field after the common header, then `n` float32 values."""

    kind = TOY

    def _on_map(self):
        (self.n,) = np.frombuffer(self._mmap, np.uint64, 1, shm.HEADER_BYTES)
        self.values = np.frombuffer(self._mmap, np.float32, int(self.n), 64)

    @classmethod
    def create(cls, name, n, directory, **kw):
        def write(mm):
            np.frombuffer(mm, np.uint64, 1, shm.HEADER_BYTES)[0] = n
            np.frombuffer(mm, np.float32, n, 64)[:] = np.arange(n)
        return cls._create(name, 64 + 4 * n, write, directory=directory, **kw)

    def close(self):
        self.values = None
        super().close()


class Named(Toy):
    kind = NAMED


def _header(path):
    magic, version, creator, attached, ready, total = shm.HEADER.unpack(path.read_bytes()[:shm.HEADER_BYTES])
    return dict(magic=magic, version=version, creator=creator, attached=attached, ready=ready, total=total)


def _dead_pid():
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# -- the common header and the life of a segment -------------------------------------------------------
def test_create_writes_the_common_header_and_attach_counts_itself_and_sees_the_same_memory(tmp_path):
    made = Toy.create(TOY.name("a", 0), 10, tmp_path)
    path = tmp_path / "hvdx-test-toy-a-0"
    assert made.path == path and made.name == path.name and made.creator
    assert _header(path) == dict(magic=b"HVDXTOY1", version=3, creator=os.getpid(), attached=1, ready=1,
                                 total=64 + 40)
    other = Toy._attach(path.name, directory=tmp_path)
    assert not other.creator and made.attached == other.attached == 2 and other.creator_pid == os.getpid()
    other.values[3] = 42.0                    # one mapping, two views
    assert made.values[3] == 42.0 and other.address != made.address
    made.wait_attached(2, timeout=1)
    other.unlink()                            # not the creator: nothing happens
    assert path.exists()
    made.unlink()
    made.unlink()                             # idempotent
    assert not path.exists() and made.unlinked
    assert made.values[3] == 42.0             # the memory outlives the name
    for segment in (other, made):
        segment.close()
    with pytest.raises(ToyError, match="is closed"):
        made.address


def test_every_kind_of_hvdx_segment_starts_with_the_common_header(tmp_path):
    from hvdx.asynchronous.shared import SharedModel
    from hvdx.node import shm_engine as node_shm

    node = node_shm.Segment.create(node_shm.PREFIX + "hdr-0", 2, 8192, directory=tmp_path)
    model = SharedModel.create([3, 5], np.arange(8, dtype=np.float32), directory=tmp_path, watchdog=False)
    for segment, magic in ((node, b"HVDXNSM1"), (model, b"HVDXSHM1")):
        header = _header(segment.path)
        assert header["magic"] == magic and header["creator"] == os.getpid()
        assert header["attached"] == 1 and header["ready"] == 1 and header["total"] == segment.path.stat().st_size
    assert np.frombuffer(node._mmap, np.int32, 1, 256)[0] == os.getpid()   # local rank 0's pid, after it
    model.close()
    node.unlink()


def test_create_refuses_a_name_that_exists_and_leaves_it_alone(tmp_path):
    made = Toy.create("hvdx-test-toy-x", 4, tmp_path)
    with pytest.raises(ToyError, match="cannot create the toy segment .*File exists"):
        Toy.create("hvdx-test-toy-x", 4, tmp_path)
    assert Toy._attach("hvdx-test-toy-x", directory=tmp_path).values[2] == 2.0
    made.close()
    assert not (tmp_path / "hvdx-test-toy-x").exists()


def test_wait_attached_raises_the_kinds_error_after_its_timeout(tmp_path):
    made = Toy.create("hvdx-test-toy-w", 4, tmp_path)
    with pytest.raises(ToyError, match="1 of 3 processes attached to .* within 0.05 s"):
        made.wait_attached(3, timeout=0.05)
    made.close()


def test_the_atexit_hook_and_the_watchdog_remove_a_name_not_yet_unlinked(tmp_path):
    """A creator that exits (atexit), or is SIGKILLed with a watchdog, leaves no name."""
    code = ("import importlib.util, sys, time; from pathlib import Path\n"
            "spec = importlib.util.spec_from_file_location('kit', sys.argv[1])\n"
            "kit = sys.modules['kit'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(kit)\n"
            "class E(RuntimeError): pass\n"
            "class S(kit.Segment):\n"
            "    kind = kit.Kind('hvdx-test-exit-', b'HVDXTOY3', 1, 64, 'exit segment', 'its creator', E)\n"
            "S._create(sys.argv[2], 64, lambda mm: None, directory=Path(sys.argv[3]), watchdog=sys.argv[4] == 'dog')\n"
            "print('made', flush=True)\n"
            "if sys.argv[4] == 'dog': time.sleep(60)\n")
    run = [sys.executable, "-c", code, str(ROOT / "hvdx" / "shm.py")]
    done = subprocess.run(run + ["hvdx-test-exit-a", str(tmp_path), "exit"], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "made\n" and not (tmp_path / "hvdx-test-exit-a").exists()
    proc = subprocess.Popen(run + ["hvdx-test-exit-b", str(tmp_path), "dog"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "made\n" and (tmp_path / "hvdx-test-exit-b").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while (tmp_path / "hvdx-test-exit-b").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (tmp_path / "hvdx-test-exit-b").exists()
    finally:
        proc.kill()
        proc.wait()


# -- sweep ---------------------------------------------------------------------------------------------
def test_sweep_removes_the_segment_of_a_creator_that_died_and_keeps_the_others(tmp_path):
    """A child creates a segment and dies without unlinking (no atexit: os._exit); the next
    create (of that kind) sweeps it. A live creator's segment, a file whose header is not
    written yet and another kind's segment stay."""
    pid = os.fork()
    if pid == 0:
        try:
            Toy.create("hvdx-test-toy-dead", 4, tmp_path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    dead = tmp_path / "hvdx-test-toy-dead"
    assert dead.exists() and _header(dead)["creator"] == pid
    live = Toy.create("hvdx-test-toy-live", 4, tmp_path)            # this create swept the dead one
    assert not dead.exists()
    unwritten = tmp_path / "hvdx-test-toy-unwritten"
    unwritten.write_bytes(bytes(64))                                # created, header not written yet
    named = Named.create(NAMED.name(_dead_pid(), "x"), 4, tmp_path)  # another kind
    assert shm.sweep(TOY, tmp_path) == []
    assert live.path.exists() and unwritten.exists() and named.path.exists()
    live.close()
    named.close()


def test_sweep_reads_the_creator_from_the_name_where_the_kind_puts_it_there(tmp_path):
    """Names of a `pid_in_name` kind carry the creator: a dead creator's file is swept even
    before its header exists."""
    stale = tmp_path / NAMED.name(_dead_pid(), "abc")
    alive = tmp_path / NAMED.name(os.getpid(), "def")
    odd = tmp_path / NAMED.name("notapid", "ghi")
    for path in (stale, alive, odd):
        path.write_bytes(b"x")
    assert shm.sweep(NAMED, tmp_path) == [stale.name]
    assert alive.exists() and odd.exists() and not stale.exists()


# -- what attach refuses ---------------------------------------------------------------------------------
def test_attach_refuses_another_kind_another_layout_a_short_file_and_a_segment_not_ready(tmp_path):
    made = Named.create("hvdx-test-toy-other", 4, tmp_path)          # NAMED's magic under a TOY-like name
    with pytest.raises(ToyError, match=r"is not an hvdx toy segment of layout 3 \(magic b'HVDXTOY2', layout 1\)"):
        Toy._attach("hvdx-test-toy-other", directory=tmp_path)
    made.close()

    made = Toy.create("hvdx-test-toy-v", 4, tmp_path)
    np.frombuffer(made._mmap, np.uint32, 1, 8)[0] = 4                # a process of another hvdx wrote it
    with pytest.raises(ToyError, match=r"not an hvdx toy segment of layout 3 \(magic b'HVDXTOY1', layout 4\)"):
        Toy._attach("hvdx-test-toy-v", directory=tmp_path)
    np.frombuffer(made._mmap, np.uint32, 1, 8)[0] = 3
    np.frombuffer(made._mmap, np.uint32, 1, 20)[0] = 0               # not ready
    with pytest.raises(ToyError, match="is not ready: the toy's creator has not finished"):
        Toy._attach("hvdx-test-toy-v", directory=tmp_path)
    with pytest.raises(ToyError, match=r"toy segment .* did not become ready within 0.1 s: the toy's creator failed"):
        Toy._attach("hvdx-test-toy-v", directory=tmp_path, timeout=0.1)
    assert made.attached == 1                                        # none of them counted itself
    made.close()

    (tmp_path / "hvdx-test-toy-short").write_bytes(bytes(40))
    with pytest.raises(ToyError, match="is 40 bytes: not an hvdx toy segment"):
        Toy._attach("hvdx-test-toy-short", directory=tmp_path)
    with pytest.raises(ToyError, match="cannot open the toy segment .*: the toy's creator did not create it"):
        Toy._attach("hvdx-test-toy-missing", directory=tmp_path)


def test_admit_runs_under_the_lock_before_counting_and_its_refusal_is_not_retried(tmp_path):
    made = Toy.create("hvdx-test-toy-admit", 4, tmp_path)
    seen = []

    def refuse(segment):
        seen.append(segment.attached)
        raise ToyError("not this one")

    with pytest.raises(ToyError, match="not this one"):
        Toy._attach("hvdx-test-toy-admit", directory=tmp_path, timeout=5, admit=refuse)
    assert seen == [1] and made.attached == 1
    Toy._attach("hvdx-test-toy-admit", directory=tmp_path, admit=lambda segment: seen.append(segment.attached))
    assert seen == [1, 1] and made.attached == 2
    made.close()


# -- alignment, pid_alive ---------------------------------------------------------------------------------
def test_align_and_the_layouts_of_both_kinds(tmp_path):
    from hvdx.asynchronous import shared
    from hvdx.node import shm_engine as node_shm

    assert [shm.align(x) for x in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert shm.align(4097, shm.PAGE) == 8192 and shm.HEADER.size == shm.HEADER_BYTES == 32
    made = Toy.create("hvdx-test-toy-al", 4, tmp_path)
    assert made.address % shm.PAGE == 0                              # what the ops check (kAlign)
    made.close()
    begins, records, data, total = shared._layout([3, 5, 7])
    assert records == shm.align(64 + 8 * 4) and data % shm.ALIGN == 0 and total == data + 4 * 15
    node = node_shm.Segment.create(node_shm.PREFIX + "al-0", 3, 8192, directory=tmp_path)
    assert node.path.stat().st_size % shm.PAGE == 0 and (node.num_ranks, node.slot_bytes) == (3, 8192)
    node.unlink()


def test_pid_alive_is_false_for_a_dead_a_zombie_and_a_non_positive_pid():
    assert shm.pid_alive(os.getpid()) and shm.pid_alive(1)
    assert not shm.pid_alive(_dead_pid())
    assert not shm.pid_alive(0) and not shm.pid_alive(-1) and not shm.pid_alive(2 ** 40)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 20
        while shm.pid_alive(pid) and time.monotonic() < deadline:    # exited, not yet reaped: a zombie
            time.sleep(0.01)
        assert not shm.pid_alive(pid) and os.path.exists(f"/proc/{pid}")
    finally:
        os.waitpid(pid, 0)
