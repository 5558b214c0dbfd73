"""One process of the node shared-memory tests (tests/test_node_shm.py), without Horovod:
local rank RANK of SIZE on segment NAME (rank 0 creates it, the others attach once it exists,
rank 0 unlinks once all attached), then a scenario, then one JSON line on stdout; several
scenarios (comma-separated) run one after another, each on a fresh segment NAME-<i>.

    python tests/node_shm_worker.py NAME RANK SIZE SLOT_BYTES SCENARIO[,SCENARIO...] [TIMEOUT_S]

Scenarios: "parity" (all-to-all and all-gather of several sizes, checked against NumPy, eager
and in a tf.function), "order" (many collectives in a tf.function whose ops could run in any
order), "die" (rank 1 prints "ready" and sleeps until killed; the others wait in a collective),
"mismatch_name", "mismatch_size", "mismatch_dtype" (rank 1 issues another collective than
rank 0), "dtype" (a dtype the engine cannot move).
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvdx.node import shm_engine as node_shm  # noqa: E402
from hvdx.node.collectives import node_slices  # noqa: E402


def data(rank, length, seed, dtype=np.float32):
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.standard_normal(length).astype(dtype)


def wait_attached(segment, size):
    deadline = time.monotonic() + 60
    while segment.attached < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{segment.attached} of {size} attached")
        time.sleep(0.01)
    return segment


def attach(name, rank, size, slot_bytes):
    if rank == 0:
        segment = wait_attached(node_shm.Segment.create(name, size, slot_bytes), size)
        segment.unlink()
        return segment
    deadline = time.monotonic() + 60
    while True:
        try:
            return wait_attached(node_shm.Segment.attach(name, rank, size, slot_bytes), size)
        except node_shm.NodeShmError:  # not created (or its header not written) yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def expected_alltoall(rank, size, length, seed, dtype):
    slices = node_slices(length, size)
    total = slices[-1][0] + slices[-1][1]
    out = []
    for i in range(size):
        x = np.pad(data(i, length, seed, dtype), (0, total - length))
        offset, n = slices[rank]
        out.append(x[offset:offset + n])
    return np.concatenate(out)


def alltoall(comm, rank, size, length, seed, dtype=np.float32, name=None):
    slices = node_slices(length, size)
    total = slices[-1][0] + slices[-1][1]
    x = np.pad(data(rank, length, seed, dtype), (0, total - length))
    return comm.alltoall(x, [n for _, n in slices], name or f"a2a.{length}.{seed}")


def parity(comm, rank, size):
    checked = 0
    lengths = [1, 7, 100, 1000, 12345, 1 << 18, (1 << 20) + 3]
    for seed, length in enumerate(lengths):
        for dtype in (np.float32, np.float64):
            got = alltoall(comm, rank, size, length, seed, dtype).numpy()
            want = expected_alltoall(rank, size, length, seed, dtype)
            assert got.dtype == want.dtype and np.array_equal(got, want), (length, dtype)
            # all-gather with per-rank row counts (2-D rows of 3 too)
            rows = length // (rank + 1) + rank
            got = comm.allgather(data(rank, rows, seed, dtype), f"ag.{length}").numpy()
            want = np.concatenate([data(i, length // (i + 1) + i, seed, dtype) for i in range(size)])
            assert np.array_equal(got, want), (length, dtype)
            checked += 2
    got = comm.allgather(np.arange(6 * (rank + 1), dtype=np.int32).reshape(-1, 3) + rank, "ag.2d").numpy()
    want = np.concatenate([np.arange(6 * (i + 1), dtype=np.int32).reshape(-1, 3) + i for i in range(size)])
    assert got.shape == want.shape and np.array_equal(got, want)
    empty = comm.allgather(np.zeros([0], np.float32), "ag.empty").numpy()
    assert empty.shape == (0,)

    @tf.function
    def traced(x):
        return comm.alltoall(x, [n for _, n in node_slices(5000, size)], "a2a.traced")

    slices = node_slices(5000, size)
    total = slices[-1][0] + slices[-1][1]
    for step in range(3):
        x = np.pad(data(rank, 5000, 50 + step), (0, total - 5000))
        got = traced(tf.constant(x)).numpy()
        want = expected_alltoall(rank, size, 5000, 50 + step, np.float32)
        assert np.array_equal(got, want)
        checked += 1
    return {"checked": checked}


def order(comm, rank, size):
    """40 buckets, each an all-to-all then an all-gather of its own, in a TF1-style graph run
    by a Session (no automatic control dependencies there, unlike tf.function, which runs
    stateful ops in program order): each rank makes its buckets' inputs in another order (a
    sleep per bucket that depends on the rank), so that only the communicator's chain keeps the
    node's collectives in one order on every rank (comm.ordered=False: the control)."""
    buckets = 40
    lengths = [size * (16 + 4 * b) for b in range(buckets)]
    graph = tf.Graph()
    with graph.as_default():
        outs = []
        for b, n in enumerate(lengths):
            delay = 0.003 * ((b * (rank + 2) + 3 * rank) % 7)
            x = tf.compat.v1.py_func(lambda d=delay, b=b, n=n: (time.sleep(d), data(rank, n, b))[1], [], tf.float32,
                                     stateful=False)
            x = tf.ensure_shape(x, [n])
            received = comm.alltoall(x, [n // size] * size, f"bucket.{b}.a2a")
            outs.append(comm.allgather(received, f"bucket.{b}.ag"))
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        results = session.run(outs)
    for b, (n, got) in enumerate(zip(lengths, results)):
        part = n // size
        want = np.concatenate([np.concatenate([data(i, n, b)[j * part:(j + 1) * part] for i in range(size)])
                               for j in range(size)])
        assert np.array_equal(got, want), b
    return {"buckets": buckets}


def run(name, rank, size, slot_bytes, scenario, timeout):
    """One scenario on a fresh segment `name`; what it returns (an "error" on failure)."""
    segment = attach(name, rank, size, slot_bytes)
    comm = node_shm.NodeCommunicator(segment, timeout_s=timeout)
    comm.ordered = scenario != "unordered"  # the test's control: no chain
    result = {"rank": rank, "scenario": scenario}
    try:
        if scenario == "parity":
            result.update(parity(comm, rank, size))
        elif scenario in ("order", "unordered"):
            result.update(order(comm, rank, size))
        elif scenario == "die":
            alltoall(comm, rank, size, 100, 0)  # everybody attached and working
            if rank == 1:
                print(json.dumps({"rank": rank, "ready": True}), flush=True)
                time.sleep(600)
            t0 = time.monotonic()
            alltoall(comm, rank, size, 100, 1)
        elif scenario == "mismatch_name":
            alltoall(comm, rank, size, 100, 0, name=f"grads.{'b' if rank == 1 else 'a'}")
        elif scenario == "mismatch_size":
            alltoall(comm, rank, size, 1000 if rank == 1 else 2000, 0, name="grads")
        elif scenario == "mismatch_dtype":
            alltoall(comm, rank, size, 100, 0, np.float64 if rank == 1 else np.float32, name="grads")
        elif scenario == "dtype":
            try:
                comm.alltoall(tf.constant(["a", "b"]), [1] * (size - 1) + [2 - (size - 1)], "strings")
            except TypeError as exc:
                result["error"] = str(exc)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    except tf.errors.OpError as exc:
        result["error"] = exc.message
        if scenario == "die":
            result["waited_s"] = time.monotonic() - t0
    return result


def main(argv):
    """Each scenario of the comma-separated list in turn, the i-th on segment NAME-i (one
    process, one TensorFlow start-up, for several scenarios); a JSON line after each."""
    name, rank, size, slot_bytes = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    timeout = float(argv[5]) if len(argv) > 5 else 60.0
    for i, scenario in enumerate(argv[4].split(",")):
        print(json.dumps(run(f"{name}-{i}", rank, size, slot_bytes, scenario, timeout)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
