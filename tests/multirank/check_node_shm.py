"""Every rank checks node_engine="shm" (hvdx.node.shm_engine) against Horovod's node collectives.

- the shm all-to-all (node_slices' splits) and all-gather (per-rank lengths) equal
  hvd.alltoall / hvd.allgather over the node's set bit for bit, on sizes from 1 element to
  several slots (the check runs with 64 KiB slots, so the large ones go in chunks);
- 2DTAR (flat_below=0) and HiTopK give bit for bit the same aggregated gradients with
  "shm" as with "horovod": eager on one buffer for three steps (HiTopK's residuals
  included), and through the aggregator in a tf.function with several buckets;
- a Keras fit of a few steps with HiTopK(node_engine="shm") ends with the same weights on
  every rank (the test compares the digests), and the segment's name is gone from /dev/shm.
"""
import hashlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.node import shm_engine as node_shm
from hvdx.node.collectives import node_slices
from tests.multirank import digits


def _collectives(topo) -> int:
    n, checked = topo.local_size, 0
    engine = node_shm.communicator(topo)
    for seed, d in enumerate([1, 7, 33, 1000, 4099, 100_003]):  # tiny, unaligned, > a 64 KiB slot
        rng = np.random.default_rng(1000 * seed + topo.rank)
        slices = node_slices(d, n)
        total = slices[-1][0] + slices[-1][1]
        x = tf.constant(np.pad(rng.standard_normal(d).astype(np.float32), (0, total - d)))
        want, _ = hvd.alltoall(x, splits=[size for _, size in slices], process_set=topo.local_set, name=f"ns.a2a.{d}")
        got = engine.alltoall(x, [size for _, size in slices], f"ns.a2a.{d}")
        assert np.array_equal(got.numpy(), want.numpy()), f"all-to-all of {d}"
        rows = tf.constant(rng.standard_normal(d // (topo.local_rank + 1) + topo.local_rank).astype(np.float32))
        want = hvd.allgather(rows, process_set=topo.local_set, name=f"ns.ag.{d}")
        got = engine.allgather(rows, f"ns.ag.{d}")
        assert np.array_equal(got.numpy(), want.numpy()), f"all-gather of {d}"
        checked += 2
    return checked


def _exact(rng, shape) -> np.ndarray:
    """Multiples of 1/8 below 2^7: every sum is exact in any order (Horovod's fused allreduce
    of more than two ranks adds in an order that depends on timing, docs/comm.md)."""
    return (rng.integers(-1000, 1000, shape) / 8).astype(np.float32)


def _same_aggregation(topo, make) -> None:
    """`make(engine)` builds a strategy; both engines aggregate the same buffers to the same bits."""
    horovod, shm = make("horovod"), make("shm")
    for step in range(3):
        grads = tf.constant(_exact(np.random.default_rng(50 * step + topo.rank), 30_011))
        want = horovod(grads, name=f"eq.{step % 2}").numpy()
        got = shm(grads, name=f"eq.{step % 2}").numpy()
        assert np.array_equal(got, want), f"{shm!r} step {step}: max diff {np.abs(got - want).max()}"
    # several buckets in one traced step (the aggregator's order is the chain's)
    model = digits.mlp(seed=3, width=48)
    variables = model.trainable_variables
    results = []
    for engine in ("horovod", "shm"):
        aggregator = hvdx.GradientAggregator(make(engine), bucket_bytes=1024)

        @tf.function
        def step(grads):
            return aggregator(grads, variables)

        outputs = []
        for k in range(2):
            rng = np.random.default_rng(100 * k + topo.rank)
            outputs.append([g.numpy() for g in step([tf.constant(_exact(rng, v.shape)) for v in variables])])
        results.append(outputs)
        assert len(aggregator.last_aggregation.buckets) >= 3
    for a, b in zip(*results):
        for ga, gb in zip(a, b):
            assert np.array_equal(ga, gb), f"{make('shm')!r} in a traced step with buckets"


def _fit_digest(topo) -> str:
    x_train, _, y_train, _ = digits.split()
    part = slice(topo.rank, None, topo.size)
    model = digits.mlp(seed=0)
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                    communication=comm.HiTopK(density=0.05, node_engine="shm"))
    model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x_train[part][:96], y_train[part][:96], batch_size=16, epochs=1, verbose=0,
              callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
    return hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.trainable_variables)).hexdigest()


def check_parity(topo):
    checked = _collectives(topo)
    _same_aggregation(topo, lambda engine: comm.Hierarchical(flat_below=0, node_engine=engine))
    _same_aggregation(topo, lambda engine: comm.HiTopK(density=0.05, node_engine=engine))
    weights = _fit_digest(topo)
    segment = node_shm.communicator(topo).segment
    return {"collectives": checked, "strategies": ["Hierarchical", "HiTopK"], "weights": weights,
            "leftover": [str(segment.path)] if segment.path.exists() else []}


CHECKS = {"parity": check_parity}
