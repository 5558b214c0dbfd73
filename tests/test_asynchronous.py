"""hvdx.asynchronous: the shared segment's lifecycle, the shared model ops, the methods
(gimpel2010 Algorithm 1; kungurtsev2021's ASSM, PASSM, PASSM+), claim by claim."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.harness import ROOT

SEGMENT = [sys.executable, str(ROOT / "tests" / "asynchronous_segment.py")]
SHM = Path("/dev/shm")


def _start(*args):
    return subprocess.Popen(SEGMENT + list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _line(proc, timeout=30.0):
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"no output within {timeout} s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    assert line, f"process ended: {proc.stderr.read()}"
    return line.strip()


def _gone(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def _finish(*procs):
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


# -- the segment: removed after a normal end, a killed rank, Ctrl-C ----------------------------------
def test_segment_is_unlinked_once_every_process_attached():
    creator = _start("create", "3")
    name = _line(creator)
    path = SHM / name
    assert path.exists()
    others = [_start("attach", name) for _ in range(2)]
    try:
        for p in others:
            assert _line(p) == "attached 28.0"      # the creator's model, arange(8)
        assert _line(creator) == "unlinked"
        assert not path.exists()                      # no name left while all still run
    finally:
        _finish(creator, *others)
    assert [p.returncode for p in (creator, *others)] == [0, 0, 0]
    assert not path.exists()


def test_segment_is_removed_when_its_creator_is_killed_before_the_others_attached():
    creator = _start("create", "3")
    name = _line(creator)
    path = SHM / name
    try:
        assert path.exists()
        os.kill(creator.pid, signal.SIGKILL)          # no finally, no atexit: the watchdog unlinks
        assert _gone(path), f"{path} left behind by a killed creator"
    finally:
        _finish(creator)


def test_segment_is_removed_after_ctrl_c():
    creator = _start("create", "3")
    name = _line(creator)
    path = SHM / name
    attacher = _start("attach", name)
    try:
        assert _line(attacher).startswith("attached")
        os.killpg(creator.pid, signal.SIGINT)         # Ctrl-C reaches the creator's process group
        os.killpg(attacher.pid, signal.SIGINT)
        assert _gone(path), f"{path} left behind after Ctrl-C"
    finally:
        _finish(creator, attacher)


def test_a_killed_attacher_leaves_nothing_and_the_others_keep_the_model():
    creator = _start("create", "3")
    name = _line(creator)
    path = SHM / name
    first, second = _start("attach", name), _start("attach", name)
    try:
        assert _line(first).startswith("attached") and _line(second).startswith("attached")
        assert _line(creator) == "unlinked"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=20)
        assert not path.exists()
    finally:
        _finish(creator, first, second)
    assert second.returncode == 0 and creator.returncode == 0


def test_sweep_removes_segments_of_dead_creators_only(tmp_path):
    from tests.asynchronous_segment import shared
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{shared.PREFIX}{int(dead.stdout)}-abc"
    alive = tmp_path / f"{shared.PREFIX}{os.getpid()}-def"
    stale.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert shared.sweep(tmp_path) == [stale.name]
    assert alive.exists() and not stale.exists()


def test_attach_names_the_creator_when_the_segment_never_appears(tmp_path):
    from tests.asynchronous_segment import shared
    with pytest.raises(shared.SharedModelError, match="first rank"):
        shared.SharedModel.attach("hvdx-async-1-none", directory=tmp_path, timeout=0.2)
