"""Deep Gradient Compression's aids on every rank of an m x n job (tests/test_dgc.py).

- HiTopK with momentum correction, factor masking, residual decay and the density warm-up
  equals a NumPy simulation on the node slices (Algorithm 2 with DGC's accumulation: the
  node's summed slice is the gradient whose velocity is kept), step by step, velocities
  and residuals included. Factors are powers of two and buffers multiples of 1/8, so every
  sum is exact and MSTopK's selection can be compared index by index.
- The warm-up's stages too dense for pairs to pay (`dense_from`) average exactly and leave
  no residual or velocity, HiTopK's and NaiveAG's, traced.
- model.fit under mixed_float16 with every aid on (momentum correction from the wrapped
  SGD, local clipping, warm-up, decay) and backward_passes_per_step=2: every rank ends
  with the same weights, all finite; a checkpoint written on each rank restores that
  rank's own velocities and residuals.
"""
import shutil
import tempfile

import numpy as np
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.comm.memory import commit
from hvdx.node.collectives import node_slices
from tests.multirank.check_comm import gather_ragged, gather_rows, simulate_selection
from tests.multirank.check_training_path import digits, digits_model, same_on_every_rank


def by_name(opt) -> dict:
    """Every strategy's residuals and velocities, by strategy and buffer name."""
    return {f"{memory.name}/{name}": v for memory in opt.aggregator._memories
            for name, v in memory.variables_by_name.items()}


def check_simulation(topo, d: int = 64 * 16 + 5, steps: int = 6, momentum: float = 0.5, decay: float = 0.5):
    strategy = comm.HiTopK(density=0.05, momentum=momentum, residual_decay=decay, warmup_steps=4,
                           warmup_density=0.25)
    n, size = topo.local_size, topo.size
    slices = node_slices(d, n)
    padded_d = slices[-1][0] + slices[-1][1]
    stored = slices[0][1]
    for step in range(steps):
        rng = np.random.default_rng(3000 * step + topo.rank)
        grads = rng.integers(-8000, 8000, d) / 8
        all_grads = gather_rows(tf.constant(grads, tf.float32), f"dg.{step}")
        held = {"b": strategy.variables.get("b"), "b_velocity": strategy.velocities.get("b")}
        state = {key: v.value() if step else tf.zeros([stored]) for key, v in held.items()}
        before = {key: gather_rows(value, f"db.{key}.{step}") for key, value in state.items()}
        got = strategy(tf.constant(grads, tf.float32), name="b").numpy()
        chosen = gather_ragged(strategy.last_indices, f"di.{step}")
        held = {"b": strategy.variables["b"], "b_velocity": strategy.velocities["b"]}
        after = {key: gather_rows(v.value(), f"da.{key}.{step}") for key, v in held.items()}
        density = strategy.warmup.density(step)
        padded = np.zeros((size, padded_d))
        padded[:, :d] = all_grads
        total = np.zeros(padded_d)
        for node, ranks in enumerate(topo.node_ranks):
            for j, r in enumerate(ranks):
                offset, length = slices[j]
                piece = slice(offset, offset + length)
                g = padded[list(ranks), piece].sum(axis=0)
                u = momentum * before["b_velocity"][r][:length] + g
                v = decay * before["b"][r][:length] + u
                selected, residual_sim = simulate_selection(v, density, chosen[r])
                u[selected] = 0
                np.testing.assert_array_equal(after["b"][r][:length], residual_sim, err_msg=f"residual of {r}")
                np.testing.assert_array_equal(after["b_velocity"][r][:length], u, err_msg=f"velocity of {r}")
                total[piece][selected] += v[selected]
        np.testing.assert_allclose(got, total[:d] / size, rtol=1e-6, atol=1e-6)
    return steps


def check_dense_below(topo, steps: int = 3) -> int:
    """HiTopK(dense_below=64) on pieces [500, 40, 489]: the 40-element piece, which straddles
    two ranks' node slices, is the exact mean of every rank's every step and its residual
    stays zero; the large pieces stay sparse (at most k of each slice per rank sent)."""
    strategy = comm.HiTopK(density=0.02, dense_below=64)
    sizes = (500, 40, 489)
    for step in range(steps):
        grads = np.random.default_rng(10 * step + topo.rank).integers(-8000, 8000, sum(sizes)) / 8
        everyone = gather_rows(tf.constant(grads, tf.float32), f"dbw.{step}")
        pieces, result = strategy.aggregate_pieces(tf.split(tf.constant(grads, tf.float32), sizes), "w")
        commit(result.updates, result.finite)
        small = pieces[1].numpy()
        np.testing.assert_allclose(small, everyone[:, 500:540].mean(axis=0), rtol=1e-6)
        slices = node_slices(sum(sizes), topo.local_size)
        sparse = np.count_nonzero(np.concatenate([pieces[0].numpy(), pieces[2].numpy()]))
        assert 0 < sparse <= topo.num_nodes * sum(strategy.k(length) for _, length in slices), sparse
        residuals = gather_rows(strategy.variables["w"].value(), f"dbw.r.{step}")
        for r, j in ((r, ranks.index(r)) for ranks in topo.node_ranks for r in ranks):
            offset, length = slices[j]
            lo, hi = max(500, offset), min(540, offset + length)
            assert not residuals[r][lo - offset:hi - offset].any(), (r, step)
    return steps


def check_dense_warmup(topo) -> list:
    """The warm-up's dense stages (`dense_from`) inside a traced step, both sparse strategies,
    an aligned and a padded buffer: at density 1 (HiTopK, 2DTAR) and at 0.47 (NaiveAG, whose
    pairs go to all four ranks: dense from 0.25) the output is the exact mean of the ranks'
    gradients and every residual and velocity is zero; HiTopK's 0.47 stage is sparse again
    (a residual kept). Returns (strategy, d, dense steps exact, sparse step kept) per case."""
    out = []
    for cls in (comm.HiTopK, comm.SparseAllgather):
        for d in (64 * 16 + 5, 37):
            strategy = cls(density=0.05, momentum=0.5, warmup_steps=4, warmup_density=1.0)
            call = tf.function(lambda g, s=strategy: s(g, "w"))
            exact, kept = [], None
            for step in range(2):
                grads = np.random.default_rng(100 * step + topo.rank).integers(-8000, 8000, d) / 8
                everyone = gather_rows(tf.constant(grads, tf.float32), f"dw.{cls.__name__}.{d}.{step}")
                got = call(tf.constant(grads, tf.float32)).numpy()
                state = np.concatenate([strategy.variables["w"].numpy(), strategy.velocities["w"].numpy()])
                if strategy.warmup.density(step) >= strategy.dense_from():
                    exact.append(bool(np.allclose(got, everyone.mean(axis=0), rtol=1e-6) and not state.any()))
                else:
                    kept = bool(strategy.variables["w"].numpy().any())
            out.append([cls.__name__, d, exact, kept])
    return out


def check_aids(topo) -> dict:
    out = {"simulation_steps": check_simulation(topo), "dense_below_steps": check_dense_below(topo),
           "dense_warmup": check_dense_warmup(topo)}
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    folder = tempfile.mkdtemp(prefix=f"hvdx-dgc-r{topo.rank}-")
    try:
        x, y = digits(topo.rank, topo.size)
        model = digits_model()
        opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), communication="hitopk",
                                        density=0.05, momentum_correction=True, clip_norm=5.0, warmup_steps=6,
                                        residual_decay=0.9, backward_passes_per_step=2)
        model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
        weights = [w.numpy() for w in model.trainable_variables]
        out["weights_spread"] = 0.0 if same_on_every_rank(weights, "dgc.w") else 1.0
        state = {key: v.numpy().copy() for key, v in by_name(opt).items()}
        out["finite"] = bool(all(np.isfinite(w).all() for w in weights)) and all(
            np.isfinite(v).all() for v in state.values())
        path = tf.train.Checkpoint(model=model, optimizer=opt).write(f"{folder}/ckpt")
        again = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), communication="hitopk",
                                          density=0.05, momentum_correction=True, clip_norm=5.0, warmup_steps=6,
                                          residual_decay=0.9, backward_passes_per_step=2)
        fresh = digits_model(seed=1)
        again.build(fresh.trainable_variables)
        tf.train.Checkpoint(model=fresh, optimizer=again).read(path)
        restored = {key: v.numpy() for key, v in by_name(again).items()}
        out["restored_own_velocity"] = bool(any("velocity" in k for k in state) and sorted(state) == sorted(
            restored) and all(np.array_equal(state[k], restored[k]) for k in state) and any(
            np.any(v) for k, v in state.items() if "velocity" in k))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
        shutil.rmtree(folder, ignore_errors=True)
        hvdx.barrier()
    return out
CHECKS = {"aids": check_aids}
