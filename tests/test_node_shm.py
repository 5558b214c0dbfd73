"""hvdx.node.shm_engine: the node-local shared-memory collectives (node_engine="shm").

Single-process tests: the segment's checks in this process, and plain processes
(tests/node_shm_worker.py, no Horovod) that map one segment as the ranks of a node: parity
with NumPy (chunked too), the order of many collectives in a graph, a rank killed while the
others wait, mismatched calls. The scenarios that can share processes do (one node of 2 and
one of 3, each process one TensorFlow start-up, each scenario on a fresh segment). The parity
of the strategies against Horovod on 2x2 and 3x2 is tests/multirank/check_node_shm.py's
(test_node_shm_strategies below).
"""
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hvdx import comm
from hvdx.node import shm_engine as node_shm
from tests import suite
from tests.harness import ROOT

#: 64 KiB slots: the larger collectives of the multi-rank check go in chunks.
SMALL_SLOTS = {"HVDX_NODE_SHM_SLOT_BYTES": "65536"}
WORKER = [sys.executable, str(ROOT / "tests" / "node_shm_worker.py")]


def _names(token):
    return sorted(p.name for p in node_shm.SHM_DIR.glob(f"{node_shm.PREFIX}{token}*"))


def _start(size, scenarios, slot_bytes=8192, timeout=60):
    """`size` worker processes that run `scenarios` (comma-separated), each on a fresh
    segment; (token, processes)."""
    token = f"test{secrets.token_hex(4)}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    procs = [subprocess.Popen([*WORKER, f"{node_shm.PREFIX}{token}", str(rank), str(size), str(slot_bytes), scenarios,
                               str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(size)]
    return token, procs


def _results(procs, timeout=240):
    """Every rank's JSON lines, a list per rank."""
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=timeout)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, f"rank {rank} (rc {proc.returncode}):\n{out}\n{err[-3000:]}"
        results.append(lines)
    return results


def _run(size, *scenarios):
    """`scenarios` on `size` worker processes, one after another on fresh segments (one
    TensorFlow start-up per process for all of them): {scenario: [rank 0's result, ...]}."""
    token, procs = _start(size, ",".join(scenarios))
    try:
        results = _results(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert _names(token) == [], "a node segment was left in /dev/shm"
    return {scenario: [lines[i] for lines in results] for i, scenario in enumerate(scenarios)}


@pytest.fixture(scope="module")
def two_ranks():
    """One node of 2 worker processes, for the scenarios of the tests below that need 2."""
    return _run(2, "parity", "mismatch_name", "mismatch_size", "mismatch_dtype", "dtype")


@pytest.fixture(scope="module")
def three_ranks():
    """One node of 3 worker processes, for the scenarios of the tests below that need 3."""
    return _run(3, "parity", "order")


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_equal_numpy_bit_for_bit_also_in_chunks(size, request):
    """All-to-all (node_slices' splits, the last slice shorter) and all-gather (per-rank
    counts, 2-D rows, empty) of sizes from 1 element to 4 MiB through 8 KiB slots (so that most
    run in many chunks), float32 and float64, eager and in a tf.function."""
    world = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[size])
    assert all(r["checked"] == 31 for r in world["parity"])


def test_many_buckets_in_a_graph_run_in_one_order_on_every_rank(three_ranks):
    """40 buckets of an all-to-all and an all-gather each, in a TF1 graph (no automatic
    control dependencies) whose inputs appear in a different order on each rank: the
    communicator's chain keeps one order (without it the ranks issue different collectives:
    the scenario "unordered" fails with the mismatch error)."""
    assert [r["buckets"] for r in three_ranks["order"]] == [40] * 3


def test_a_killed_rank_fails_the_waiting_ranks_naming_it_and_leaves_nothing_in_dev_shm():
    token, procs = _start(3, "die", timeout=30)
    try:
        line = procs[1].stdout.readline()  # rank 1: attached, one collective made, then sleeps
        assert "ready" in line, line
        time.sleep(0.5)  # ranks 0 and 2 wait in the next collective
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        results = [lines[-1] for lines in _results([procs[0], procs[2]])]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for result in results:
        assert f"node-local rank 1 (pid {procs[1].pid}) is gone" in result["error"], result
    assert results[0]["waited_s"] < 30
    assert _names(token) == []


@pytest.mark.parametrize("scenario, rank0, rank1", [
    ("mismatch_name", "all-to-all 'grads.a'", "all-to-all 'grads.b'"),
    ("mismatch_size", "all-to-all 'grads' (call #1, float32, 2000 elements",
     "all-to-all 'grads' (call #1, float32, 1000 elements"),
    ("mismatch_dtype", "all-to-all 'grads' (call #1, float32", "all-to-all 'grads' (call #1, float64"),
])
def test_ranks_that_disagree_fail_naming_both_ranks_and_calls(scenario, rank0, rank1, two_ranks):
    for result in two_ranks[scenario]:
        message = result["error"]
        assert f"node-local rank 0 called {rank0}" in message and f"node-local rank 1 called {rank1}" in message, message


def test_a_dtype_it_cannot_move_is_refused_when_the_op_is_built(two_ranks):
    for result in two_ranks["dtype"]:
        assert "node_engine='shm' moves float32" in result["error"] and "got string" in result["error"]


def test_segment_checks_sizes_ranks_and_cleans_up(tmp_path):
    name = f"{node_shm.PREFIX}unit{secrets.token_hex(4)}-0"
    segment = node_shm.Segment.create(name, 2, 8192, directory=tmp_path)
    assert segment.attached == 1 and (tmp_path / name).exists()
    with pytest.raises(node_shm.NodeShmError, match="serves 2 ranks with 8192-byte slots"):
        node_shm.Segment.attach(name, 1, 3, 8192, directory=tmp_path)
    with pytest.raises(node_shm.NodeShmError, match="HVDX_NODE_SHM_SLOT_BYTES"):
        node_shm.Segment.attach(name, 1, 2, 16384, directory=tmp_path)
    np.frombuffer(segment._mmap, np.int32, 2, 256)[1] = os.getppid()  # local rank 1 held by a live process
    with pytest.raises(node_shm.NodeShmError, match=f"already attached by pid {os.getppid()}"):
        node_shm.Segment.attach(name, 1, 2, 8192, directory=tmp_path)
    np.frombuffer(segment._mmap, np.int32, 2, 256)[1] = 0
    with pytest.raises(node_shm.NodeShmError, match="outside the node's 2 ranks"):
        node_shm.Segment.attach(name, 2, 2, 8192, directory=tmp_path)
    with pytest.raises(node_shm.NodeShmError, match="already exists|File exists"):
        node_shm.Segment.create(name, 2, 8192, directory=tmp_path)
    other = node_shm.Segment.attach(name, 1, 2, 8192, directory=tmp_path)
    assert segment.attached == 2 and other.address != segment.address
    segment.unlink()
    assert not (tmp_path / name).exists()
    with pytest.raises(node_shm.NodeShmError, match="did not create it or removed it"):
        node_shm.Segment.attach(name, 1, 2, 8192, directory=tmp_path)
    for bad in (1000, 0):
        with pytest.raises(ValueError, match="slot_bytes must be a multiple of 4096"):
            node_shm.Segment.create(name + "x", 2, bad, directory=tmp_path)
    with pytest.raises(ValueError, match="1 to 64 ranks"):
        node_shm.Segment.create(name + "x", 65, 8192, directory=tmp_path)


def test_sweep_removes_a_segment_whose_creator_died(tmp_path):
    """A creator killed between create and unlink leaves a name; the next create sweeps it."""
    code = ("import sys, os; from hvdx.node import shm_engine as node_shm; from pathlib import Path; "
            "node_shm.Segment.create(sys.argv[1], 2, 8192, directory=Path(sys.argv[2])); print('made', flush=True); "
            "os.kill(os.getpid(), 9)")
    name = f"{node_shm.PREFIX}swept{secrets.token_hex(4)}-0"
    subprocess.run([sys.executable, "-c", code, name, str(tmp_path)], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                   capture_output=True, timeout=120)
    assert (tmp_path / name).exists()
    assert node_shm.sweep(tmp_path) == [name] and not (tmp_path / name).exists()


def test_atexit_removes_a_segment_not_yet_unlinked(tmp_path):
    code = ("import sys; from hvdx.node import shm_engine as node_shm; from pathlib import Path; "
            "node_shm.Segment.create(sys.argv[1], 2, 8192, directory=Path(sys.argv[2])); sys.exit(3)")
    name = f"{node_shm.PREFIX}exit{secrets.token_hex(4)}-0"
    done = subprocess.run([sys.executable, "-c", code, name, str(tmp_path)], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, timeout=120)
    assert done.returncode == 3 and not (tmp_path / name).exists()


def test_node_engine_is_an_option_of_2dtar_and_hitopk_only():
    assert comm.registry.takers("node_engine") == ["hierarchical", "hitopk"]
    shm = comm.get("hitopk", node_engine="shm")
    assert repr(shm).endswith("node_engine='shm')") and comm.HiTopK.from_config(shm.get_config()).node_engine == "shm"
    assert "node_engine" not in comm.HiTopK().get_config() and comm.HiTopK().node_engine == "horovod"
    tar = comm.get("2dtar", node_engine="shm")
    assert repr(tar) == "Hierarchical(node_engine='shm')"
    assert comm.Hierarchical.from_config(tar.get_config()).node_engine == "shm"
    with pytest.raises(ValueError, match="node_engine must be one of"):
        comm.Hierarchical(node_engine="nccl")
    with pytest.raises(ValueError, match="does not take node_engine"):
        comm.get("naiveag", node_engine="shm")
    with pytest.raises(ValueError, match="warmup_steps"):
        comm.HiTopK(node_engine="shm", warmup_steps=10)


@suite.runs(suite.check("node_shm.parity", "2x2", env=SMALL_SLOTS), suite.check("node_shm.parity", "3x2", env=SMALL_SLOTS))
def test_node_shm_strategies(ranks):
    """On 2x2 and 3x2 (Gloo): the shm all-to-all and all-gather equal Horovod's bit for bit
    (tiny, unaligned and chunked sizes); 2DTAR and HiTopK with node_engine="shm" aggregate
    exactly what they do with "horovod"; a Keras fit with HiTopK(node_engine="shm") ends with
    the same weights on every rank."""
    weights = {rank: data["weights"] for rank, data in ranks.items()}
    for rank, data in ranks.items():
        assert data["collectives"] >= 10 and data["strategies"] == ["Hierarchical", "HiTopK"], (rank, data)
        assert data["weights"] == weights[0], f"rank {rank}'s weights differ from rank 0's after fit"
        assert data["leftover"] == [], data["leftover"]
