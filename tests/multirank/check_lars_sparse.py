"""LARS under a sparse strategy on every rank of an m x n job (tests/test_lars_sparse.py).

- The local trust ratio: each rank scales its own gradient by eq. 11, the strategy
  accumulates the velocity of the average (momentum correction) and the step applies it with
  ratio 1. Eq. 11's ||g|| is the norm of the ranks' average gradient (trust_norms="average",
  from the all-reduced sketches: exact for these layers, within the sketch's width) or each
  rank's own (trust_norms="rank"). At density 1 without factor masking nothing is held back,
  so the weights equal a NumPy model of each rule on every rank, step by step.
- model.fit with hvdx's LARS under communication="hitopk" and its defaults (local trust
  ratio and momentum correction), mixed_float16 and backward_passes_per_step=2: every rank
  ends with the same finite weights, and a checkpoint written on each rank restores that
  rank's own velocities and residuals.
"""
import shutil
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.optimizers import LARS
from tests.multirank.check_training_path import digits, digits_model, same_on_every_rank

LR, MOMENTUM, DECAY, EETA = 0.5, 0.9, 1e-3, 0.01


def reference_trust(w: np.ndarray, g: np.ndarray) -> float:
    """Eq. 11 (You et al. 2017): eeta ||w|| / (||g|| + weight_decay ||w||)."""
    wn, gn = np.linalg.norm(w), np.linalg.norm(g)
    return EETA * wn / (gn + DECAY * wn) if wn > 0 and gn > 0 else 1.0


def check_rule(topo, norms: str, steps: int = 3) -> dict:
    shapes = [(12, 16), (16,)]  # at most the sketch's width (sketch.DEFAULT_WIDTH, 251) entries: exact norms
    rng = np.random.default_rng(7)
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    variables = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(start)]
    opt = hvdx.DistributedOptimizer(
        LARS(LR, momentum=MOMENTUM, weight_decay=DECAY, eeta=EETA),
        communication=comm.HiTopK(density=1.0, momentum=MOMENTUM, momentum_masking=False), local_trust_ratio=True,
        trust_norms=norms)
    weights = [w.astype(np.float64) for w in start]
    velocity = [np.zeros(s) for s in shapes]
    for step in range(steps):
        grads = [np.random.default_rng(100 * step + topo.rank).standard_normal(s).astype(np.float32) for s in shapes]
        everyone = [hvd.allgather(tf.constant(g[None]), name=f"lt.g{i}.{step}").numpy().astype(np.float64)
                    for i, g in enumerate(grads)]
        opt.apply_gradients(zip([tf.constant(g) for g in grads], variables))
        for i in range(len(shapes)):
            average = np.mean(everyone[i], axis=0)
            scaled = [reference_trust(weights[i], g if norms == "rank" else average) * (g + DECAY * weights[i])
                      for g in everyone[i]]
            velocity[i] = MOMENTUM * velocity[i] + np.mean(scaled, axis=0)
            weights[i] = weights[i] - LR * velocity[i]
    got = [v.numpy() for v in variables]
    close = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, weights))
    return {"rule_matches": bool(close), "rule_same_on_every_rank": same_on_every_rank(got, f"lt.rule.{norms}")}


def velocities_and_residuals(opt) -> dict:
    return {f"{memory.name}/{name}": v for memory in opt.aggregator._memories
            for name, v in memory.variables_by_name.items()}


def make_optimizer():
    return hvdx.DistributedOptimizer(LARS(1.0, momentum=0.9, weight_decay=5e-5, eeta=0.01, max_trust_ratio=1.0,
                                          exclude_from_weight_decay=["bias"]),
                                     communication="hitopk", density=0.01, backward_passes_per_step=2)


def check_training(topo) -> dict:
    out = {norms: check_rule(topo, norms) for norms in ("rank", "average")}
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    folder = tempfile.mkdtemp(prefix=f"hvdx-lt-r{topo.rank}-")
    try:
        x, y = digits(topo.rank, topo.size)
        model = digits_model()
        opt = make_optimizer()
        out["defaults"] = [opt.local_trust_ratio, float(opt.communication.momentum)]
        model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
        weights = [w.numpy() for w in model.trainable_variables]
        out["weights_same"] = same_on_every_rank(weights, "lt.w")
        state = {key: v.numpy().copy() for key, v in velocities_and_residuals(opt).items()}
        out["finite"] = bool(all(np.isfinite(w).all() for w in weights) and all(
            np.isfinite(v).all() for v in state.values()))
        path = tf.train.Checkpoint(model=model, optimizer=opt).write(f"{folder}/ckpt")
        again = make_optimizer()
        fresh = digits_model(seed=1)
        again.build(fresh.trainable_variables)
        tf.train.Checkpoint(model=fresh, optimizer=again).read(path)
        restored = {key: v.numpy() for key, v in velocities_and_residuals(again).items()}
        out["restored_own_state"] = bool(any("velocity" in k for k in state) and sorted(state) == sorted(restored)
                                         and all(np.array_equal(state[k], restored[k]) for k in state)
                                         and any(np.any(v) for v in state.values()))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
        shutil.rmtree(folder, ignore_errors=True)
        hvdx.barrier()
    return out


CHECKS = {"training": check_training}
