"""PowerSGD and the low-bit compressor on every rank of an m x n job (tests/test_powersgd.py,
tests/test_lowbit.py, tests/test_wire.py):

- PowerSGD: an average of rank <= r comes back exact, hierarchical (node sum, factors
  across nodes, node gather; also a bucket of fewer matrices than local ranks), flat, and
  flat over a process set (each node's ranks);
  flat, the ranks' outputs plus all their residuals are all their gradients (Alg. 2); Q is
  the same on every rank.
- LowBit: the hierarchical 8-bit average is within half a quantization step per node of
  the exact mean; flat, outputs plus residuals are the gradients.
- Both, and HiTopK with 8-bit values (`value_bits`, tests/test_wire.py): model.fit under mixed_float16 with backward_passes_per_step=2 on the digits keeps
  identical weights on every rank and lowers the loss; a checkpoint written on each rank
  restores that rank's residuals (and the shared Q).
"""
import shutil
import tempfile

import numpy as np
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.comm.memory import commit
from tests.multirank.check_comm import gather_rows
from tests.multirank.check_training_path import digits, digits_model, same_on_every_rank


def _aggregate(strategy, grads, name):
    pieces = [tf.reshape(tf.constant(g, tf.float32), [-1]) for g in grads]
    outputs, result = strategy.aggregate_pieces(pieces, name, shapes=[g.shape for g in grads])
    commit(result.updates, result.finite)
    return [o.numpy().reshape(g.shape) for o, g in zip(outputs, grads)]


def check_powersgd_exact_and_feedback(topo) -> dict:
    out = {}
    rng = np.random.default_rng(topo.rank)
    right = np.random.default_rng(99).standard_normal((3, 40))  # a common row space: the mean has rank 3
    for mode, hierarchical in (("hierarchical", None), ("flat", False)):
        strategy = comm.PowerSGD(rank=3, hierarchical=hierarchical)
        grads = [rng.standard_normal((96, 3)) @ right, rng.standard_normal((50, 3)) @ right[:, :30],
                 rng.standard_normal(17)]
        everyone = [gather_rows(tf.constant(g.ravel(), tf.float32), f"psgd.{mode}.{j}") for j, g in enumerate(grads)]
        got = _aggregate(strategy, grads, f"exact_{mode}")
        for j, g in enumerate(grads):
            np.testing.assert_allclose(got[j].ravel(), everyone[j].mean(axis=0), rtol=1e-3, atol=1e-3)
        assert same_on_every_rank(got, f"psgd.same.{mode}")
        out[f"exact_{mode}"] = True
    # a process set (each node's ranks): flat over it, the set's mean
    in_node = comm.PowerSGD(rank=3, process_set=topo.local_set)
    grads = [rng.standard_normal((96, 3)) @ right]
    everyone = gather_rows(tf.constant(grads[0].ravel(), tf.float32), "psgd.set")
    (got,) = _aggregate(in_node, grads, "in_node")
    np.testing.assert_allclose(got.ravel(), everyone[list(topo.local_ranks)].mean(axis=0), rtol=1e-3, atol=1e-3)
    out["process_set"] = True
    # one matrix in the bucket: a share of nothing on one local rank
    single = comm.PowerSGD(rank=2)
    g = rng.standard_normal((64, 2)) @ right[:2, :32]
    (got,) = _aggregate(single, [g], "single")
    np.testing.assert_allclose(got.ravel(), gather_rows(tf.constant(g.ravel(), tf.float32), "psgd.single").mean(0),
                               rtol=1e-3, atol=1e-3)
    traced = comm.PowerSGD(rank=2)
    step = tf.function(lambda x: traced.aggregate_pieces([x], "single_traced", shapes=[g.shape])[0][0])
    np.testing.assert_allclose(step(tf.constant(g.ravel(), tf.float32)).numpy(), got.ravel(), rtol=1e-4, atol=1e-4)
    out["single_matrix"] = True  # eager and in a tf.function (where nothing of the empty share is pruned)
    flat = comm.PowerSGD(rank=2, hierarchical=False)
    sent, total = 0.0, 0.0
    for step in range(3):
        g = np.random.default_rng(10 * step + topo.rank).standard_normal((48, 36))
        sent = sent + _aggregate(flat, [g], "feedback")[0]
        total = total + gather_rows(tf.constant(g.ravel(), tf.float32), f"psgd.fb.{step}").sum(axis=0)
    residuals = gather_rows(flat.memory.variables_by_name["feedback"].value(), "psgd.fb.r").sum(axis=0)
    np.testing.assert_allclose(topo.size * sent.ravel() + residuals, total, atol=1e-3)
    out["feedback"] = True
    out["q_same"] = same_on_every_rank([q.numpy() for q in flat.q_vectors.values()], "psgd.q")
    return out


def check_lowbit_bound_and_feedback(topo) -> dict:
    out = {}
    d = 3000
    g = np.random.default_rng(topo.rank).standard_normal(d).astype(np.float32)
    everyone = gather_rows(tf.constant(g), "lb.g")
    strategy = comm.LowBit(bits=8, chunk=256)
    got = strategy(tf.constant(g), "bound").numpy()
    # each node's summed slice is rounded by at most half a step of its chunk's scale
    node_sums = np.stack([everyone[list(ranks)].sum(axis=0) for ranks in topo.node_ranks])
    steps = np.abs(node_sums).max() / 127
    assert np.abs(got - everyone.mean(axis=0)).max() <= topo.num_nodes * steps / 2 / topo.size + 1e-5
    assert same_on_every_rank([got], "lb.same")
    out["bound"] = True
    flat = comm.LowBit(bits=4, chunk=64, hierarchical=False)
    sent, total = 0.0, 0.0
    for step in range(3):
        g = np.random.default_rng(10 * step + topo.rank).standard_normal(500).astype(np.float32)
        sent = sent + flat(tf.constant(g), "feedback").numpy()
        total = total + gather_rows(tf.constant(g), f"lb.fb.{step}").sum(axis=0)
    residuals = gather_rows(flat.memory.variables_by_name["feedback"].value(), "lb.fb.r").sum(axis=0)
    np.testing.assert_allclose(topo.size * sent + residuals, total, atol=1e-3)
    out["feedback"] = True
    return out


def _state(opt) -> dict:
    return {f"{memory.name}/{name}": v.numpy().copy() for memory in opt.aggregator._memories
            for name, v in memory.variables_by_name.items()}


def check_fit_and_checkpoint(topo, communication: str, **options) -> dict:
    """model.fit under mixed_float16, backward_passes_per_step=2; a checkpoint per rank.
    `options`: the strategy's (HiTopK's value_bits)."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    label = communication + "".join(f"_{k}{v}" for k, v in options.items())
    folder = tempfile.mkdtemp(prefix=f"hvdx-{label}-r{topo.rank}-")
    try:
        x, y = digits(topo.rank, topo.size)

        def make():
            return hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), communication=communication,
                                             backward_passes_per_step=2, **options)

        model, opt = digits_model(), make()
        model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=16, epochs=4, verbose=0,
                            callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
        weights = [w.numpy() for w in model.trainable_variables]
        state = _state(opt)
        path = tf.train.Checkpoint(model=model, optimizer=opt).write(f"{folder}/ckpt")
        again, fresh = make(), digits_model(seed=1)
        again.build(fresh.trainable_variables)
        tf.train.Checkpoint(model=fresh, optimizer=again).read(path)
        restored = _state(again)
        return {"loss": [float(v) for v in history.history["loss"]],
                "same_weights": same_on_every_rank(weights, f"{label}.w"),
                "finite": bool(all(np.isfinite(w).all() for w in weights)),
                "nonzero_residuals": int(sum(np.count_nonzero(v) for k, v in state.items() if "_q" not in k)),
                "restored": sorted(state) == sorted(restored) and all(
                    np.array_equal(state[k], restored[k]) for k in state),
                "state": sorted(state)}
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
        shutil.rmtree(folder, ignore_errors=True)
        hvdx.barrier()


def check_compressors(topo) -> dict:
    return {"powersgd": check_powersgd_exact_and_feedback(topo), "lowbit": check_lowbit_bound_and_feedback(topo),
            "fit": {**{name: check_fit_and_checkpoint(topo, name) for name in ("powersgd", "lowbit")},
                    "hitopk_value_bits8": check_fit_and_checkpoint(topo, "hitopk", value_bits=8)}}


CHECKS = {"compressors": check_compressors}
