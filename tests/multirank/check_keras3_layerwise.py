"""hvdx's Keras 3 LARS and LAMB (hvdx/optimizers/keras3.py) on an m x n topology, every rank.

- "modes": a Keras 3 model (`import keras`, beside tf.keras's tf_keras) trained for STEPS steps
  of a custom loop through hvdx.DistributedOptimizer's Keras 3 adapter, each rank on its own
  data, with parallel=None, "pto" and "slices": LARS and LAMB under 2DTAR (every bucket
  reduce-scattered: "slices" reads them), LARS measuring the momentum step under HiTopK at
  density 1.0, LARS under a dense allreduce (no slices: "slices" runs as "pto"). Per run: the
  modes used, each mode's largest difference from parallel=None relative to the largest
  weight, how far training moved the weights, and the weights' spread over the ranks
  (max - min, 0.0 when bitwise identical) in every mode.
"""
import importlib.metadata

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx

STEPS = 20
EXCLUDE = ["bias", "batch_normalization"]


def make_model(keras):
    """Tensors of 768 + 64 + 2 x 64 + 256 + 4 elements (the node's slice boundaries cut the first
    kernel), the same initial weights on every rank."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(64), keras.layers.BatchNormalization(),
                             keras.layers.ReLU(), keras.layers.Dense(4)])


def weights_of(model) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])


def spread(vector: np.ndarray, tag: str) -> float:
    x = tf.constant(vector)
    return float(tf.reduce_max(hvd.allreduce(x, op=hvd.Max, name=f"k3lw.max.{tag}") -
                               hvd.allreduce(x, op=hvd.Min, name=f"k3lw.min.{tag}")))


def train_steps(topo, keras, inner, tag: str, communication, **options):
    """STEPS steps, each rank on its own data; the weights, their spread over the ranks and the
    norm mode the optimizer used."""
    model = make_model(keras)
    optimizer = hvdx.DistributedOptimizer(inner, communication=communication, **options)
    rng = np.random.default_rng(100 + topo.rank)
    xs = rng.standard_normal((STEPS, 16, 12)).astype(np.float32)
    ys = rng.standard_normal((STEPS, 16, 4)).astype(np.float32)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for i in range(STEPS):
        step(xs[i], ys[i])
    weights = weights_of(model)
    return weights, spread(weights, tag), optimizer.inner_optimizer.last_mode


def compare_modes(topo, keras, make, communication, tag: str, modes_to_run=(None, "pto", "slices"), **options):
    weights, modes, spreads = {}, {}, {}
    for mode in modes_to_run:
        weights[mode], spreads[str(mode)], modes[str(mode)] = train_steps(
            topo, keras, make(mode), f"{tag}.{mode}", communication, **options)
    scale = float(np.max(np.abs(weights[None])))
    out = {"modes": modes, "spread": max(spreads.values()), "spreads": spreads,
           "moved": float(np.max(np.abs(weights[None] - weights_of(make_model(keras))))) / scale,
           "slices_error": float(np.max(np.abs(weights["slices"] - weights[None]))) / scale}
    if "pto" in weights:
        out["pto_error"] = float(np.max(np.abs(weights["pto"] - weights[None]))) / scale
    return out


def check_modes(topo) -> dict:
    """Every parallel mode against parallel=None, for the Keras 3 classes (module docstring).
    Where the keras package is not Keras 3 (the tf2.15 stack) it trains nothing and says so."""
    version = importlib.metadata.version("keras")
    if int(version.split(".")[0]) < 3:
        return {"keras": version, "skipped": "no Keras 3 on this stack"}
    import keras
    from hvdx.optimizers import keras3

    def lars(mode, **kwargs):
        return keras3.LARS(0.5, momentum=0.9, weight_decay=1e-3, eeta=0.02, exclude_from_weight_decay=EXCLUDE,
                           min_trust_ratio=1e-5, max_trust_ratio=10.0, parallel=mode, **kwargs)

    def lamb(mode):
        return keras3.LAMB(0.01, weight_decay=0.01, exclude_from_weight_decay=EXCLUDE,
                           exclude_from_layer_adaptation=[], parallel=mode)

    two_d = hvdx.comm.Hierarchical(flat_below=0)  # 2DTAR on every bucket: the slices "slices" reads
    runs = {
        "lars.hierarchical": compare_modes(topo, keras, lars, two_d, "lars.2dtar"),
        "lamb.hierarchical": compare_modes(topo, keras, lamb, two_d, "lamb.2dtar", bucket_bytes=1024),
        "lars.hitopk": compare_modes(topo, keras, lambda m: lars(m, classic_momentum=False, nesterov=True), "hitopk",
                                     "lars.hitopk", (None, "slices"), density=1.0),
        "lars.allreduce": compare_modes(topo, keras, lars, "allreduce", "lars.allreduce", (None, "slices")),
    }
    for key, run in runs.items():
        print(f"keras3 {key}: {run}", flush=True)
    return {"keras": version, "runs": runs}


CHECKS = {"modes": check_modes}
