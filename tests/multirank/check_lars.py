"""The parallel tensor operator and LARS / LAMB on an m x n topology, every rank.

- PTO (eqs. 12-14): for 1 to 300 tensors of mixed sizes, per-tensor results equal the
  replicated computation bit for bit on every rank, eagerly and in a tf.function (more
  ranks than tensors included); the elementwise form too;
- LARS under hvdx.DistributedOptimizer (2DTAR): parallel=None, "pto" and "slices" give the
  same weights after 20 steps ("pto" bit-identical to replicated), every rank the same
  weights; with full=True also LAMB, HiTopK, a dense allreduce (where "slices" falls back to
  "pto"), loss scaling, and Horovod's own DistributedOptimizer ("pto" there);
- "under_daso": LARS and LAMB inside hvdx.DASO, whose gradients are averaged inside each
  node only: every node's weights follow eq. 11 on its own node's averaged gradients in
  every mode (the norms shared inside the node, not over all ranks); "slices" refused;
- "digits": a ResNet-style CNN trains on the digits with LARS + DistributedOptimizer
  (HiTopK) to the accuracy band of momentum SGD, both on a linearly decayed rate.
"""
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import hvdx
from hvdx import pto, zoo
from hvdx.optimizers import LAMB, LARS
from hvdx.optimizers.layerwise import squared_norm
from tests.multirank import digits

PTO_COUNTS = [1, 2, 3, 5, 8, 13, 161, 300]
STEPS = 20
EXCLUDE = ["bias", "batch_normalization"]
BN_MOMENTUM = 0.5  # the moving statistics follow the last steps: test accuracy stable from run to run


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def mixed_shapes(count: int, rng: np.random.Generator):
    """Shapes from 1 to ~100k elements, log-uniform: lopsided like a real model's."""
    sizes = np.exp(rng.uniform(0, np.log(100_000), count)).astype(int) + 1
    return [(int(s),) if i % 3 else (int(s) // 4 + 1, 4) for i, s in enumerate(sizes)]


def check_pto(topo) -> dict:
    """PTO equals the replicated computation bit for bit; this rank's [nodes, ranks per node]."""
    rng = np.random.default_rng(2021)  # the same tensors on every rank
    op = lambda t: tf.stack([squared_norm(t), tf.reduce_max(t), tf.reduce_min(t)])  # noqa: E731
    checked = []
    for count in PTO_COUNTS:
        tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in mixed_shapes(count, rng)]
        replicated = tf.stack([op(t) for t in tensors])
        parallel = pto.parallel_map(op, tensors, output_shape=[3], name=f"check.pto.{count}")
        assert parallel.shape == (count, 3), parallel.shape
        assert np.array_equal(bits(parallel), bits(replicated)), f"{count} tensors: PTO != replicated"
        checked.append(count)
    graph = tf.function(lambda ts: pto.parallel_map(op, ts, output_shape=[3], name="check.pto.graph"))
    assert np.array_equal(bits(graph(tensors)), bits(replicated)), "PTO in a tf.function != replicated"
    pairs = [(tensors[i], tensors[-1 - i]) for i in range(7)]  # tuples of tensors as items
    both = pto.parallel_map(lambda a, b: squared_norm(a) + squared_norm(b), pairs, name="check.pto.pairs")
    assert np.array_equal(bits(both), bits([squared_norm(a) + squared_norm(b) for a, b in pairs]))
    x = tf.constant(rng.standard_normal((1001, 3)).astype(np.float32))
    y = pto.parallel_elementwise(lambda t: tf.exp(t) * 2 + 1, x, name="check.pto.elementwise")
    assert np.array_equal(bits(y), bits(tf.exp(x) * 2 + 1)), "elementwise PTO != replicated"
    return {"counts": checked, "topology": [topo.num_nodes, topo.local_size]}


def make_model(seed: int = 0) -> tf.keras.Model:  # not a zoo model: batch norm between two Dense layers
    """Tensors of 768 + 64 + 2 x 64 + 256 + 4 elements: the node's slice boundaries cut the
    first kernel, so partial norms of one tensor come from two ranks."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.layers.Input(shape=(12,)), tf.keras.layers.Dense(64),
                                tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU(),
                                tf.keras.layers.Dense(4)])


def weights_of(model) -> np.ndarray:
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


def same_on_every_rank(vector: np.ndarray, tag: str) -> None:
    x = tf.constant(vector)
    spread = hvd.allreduce(x, op=hvd.Max, name=f"max.{tag}") - hvd.allreduce(x, op=hvd.Min, name=f"min.{tag}")
    assert float(tf.reduce_max(tf.abs(spread))) == 0.0, f"{tag}: ranks hold different weights"


def train_steps(topo, inner, tag: str, communication=None, horovod: bool = False, loss_scale: bool = False,
                **options):
    """STEPS steps of a custom loop, each rank on its own data; returns the weights and the
    norm mode the inner optimizer used."""
    model = make_model()
    if horovod:
        optimizer = hvd_keras.DistributedOptimizer(inner)
    else:
        optimizer = hvdx.DistributedOptimizer(inner, communication=communication, **options)
    if loss_scale:
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10)
    rng = np.random.default_rng(100 + topo.rank)
    xs = rng.standard_normal((STEPS, 16, 12)).astype(np.float32)
    ys = rng.standard_normal((STEPS, 16, 4)).astype(np.float32)

    def loss_of(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    @tf.function
    def step(x, y):
        if horovod:  # Horovod's wrapper aggregates in compute_gradients: minimize()
            return optimizer.minimize(lambda: loss_of(x, y), model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
            if loss_scale:
                loss = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        if loss_scale:
            grads = optimizer.get_unscaled_gradients(grads)
        return optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for i in range(STEPS):
        step(xs[i], ys[i])
    weights = weights_of(model)
    same_on_every_rank(weights, tag)
    used = optimizer if horovod else optimizer.inner_optimizer
    if loss_scale:
        used = optimizer.inner_optimizer.inner_optimizer
    return weights, used.last_mode


def compare_modes(topo, make, communication, tag: str, modes_to_run=(None, "pto", "slices"), *,
                  exact: bool = True, **options) -> dict:
    """Weights after STEPS steps in each mode; pto bit-identical to replicated (`exact`: not
    where Horovod fuses per-gradient allreduces as they get ready, which changes the sums'
    rounding from run to run), slices close."""
    weights, modes = {}, {}
    for mode in modes_to_run:
        weights[mode], modes[str(mode)] = train_steps(topo, make(mode), f"{tag}.{mode}", communication, **options)
    scale = float(np.max(np.abs(weights[None])))
    pto_error = float(np.max(np.abs(weights["pto"] - weights[None]))) / scale if "pto" in weights else 0.0
    if "pto" in weights and exact and (topo.num_nodes <= 2 or "bucket_bytes" not in options):
        assert pto_error == 0.0, f"{tag}: pto weights != replicated weights"
    # (Several buckets on 3 nodes: Horovod may fuse the cross-node allreduces of buckets that
    # are ready together, which changes how 3 partial sums associate: the aggregated
    # gradients then differ in the last bit between two runs, whatever the norms.)
    assert pto_error < 1e-4, f"{tag}: pto differs from replicated by {pto_error:.2e} (relative)"
    slices_error = float(np.max(np.abs(weights["slices"] - weights[None]))) / scale
    assert slices_error < 1e-4, f"{tag}: slices differs from replicated by {slices_error:.2e} (relative)"
    moved = float(np.max(np.abs(weights[None] - weights_of(make_model())))) / scale
    assert moved > 1e-3, f"{tag}: the weights hardly moved ({moved:.1e}), the comparison would be empty"
    return {"modes": modes, "slices_error": slices_error, "pto_error": pto_error, "weights": weights[None]}


def lars(mode, **kwargs):
    return LARS(0.5, momentum=0.9, weight_decay=1e-3, eeta=0.02, exclude_from_weight_decay=EXCLUDE,
                min_trust_ratio=1e-5, max_trust_ratio=10.0, parallel=mode, **kwargs)


def lamb(mode):
    return LAMB(0.01, weight_decay=0.01, exclude_from_weight_decay=EXCLUDE, exclude_from_layer_adaptation=[],
                parallel=mode)


#: 2DTAR on every bucket (no size rule): the small model's slices are what "slices" reads.
TWO_D = hvdx.comm.Hierarchical(flat_below=0)


def check_modes(topo, full: bool = False) -> dict:
    out = {"lars.hierarchical": compare_modes(topo, lars, TWO_D, "lars.2dtar")}
    replicated = out["lars.hierarchical"]["weights"]
    if full:
        out["lamb.hierarchical"] = compare_modes(topo, lamb, TWO_D, "lamb.2dtar", bucket_bytes=1024)
        out["lars_nesterov_step.hitopk"] = compare_modes(
            topo, lambda m: lars(m, classic_momentum=False, nesterov=True), "hitopk", "lars.hitopk", (None, "slices"),
            density=1.0)
        out["lars.allreduce"] = compare_modes(topo, lars, "allreduce", "lars.allreduce", (None, "slices"))
        # 2DTAR's size rule: the first kernel (3072 bytes) through 2DTAR, the smaller buckets
        # flat: "slices" computes the kernel's norms on the slices, the others' whole on each rank
        out["lars.sized"] = compare_modes(topo, lars, hvdx.comm.Hierarchical(flat_below=2048), "lars.sized",
                                          exact=False, bucket_bytes=1024)
        # Mixed precision's loss scaling: slices read the unscaled gradients that are applied.
        # (A loss scale of 2**10 scales and unscales exactly: the replicated run without it is the reference.)
        scaled, mode = train_steps(topo, lars("slices"), "lso.slices", TWO_D, loss_scale=True)
        assert mode == "slices", mode
        out["loss_scale_slices_error"] = float(np.max(np.abs(scaled - replicated)) / np.max(np.abs(replicated)))
        assert out["loss_scale_slices_error"] < 1e-4, out
        # Horovod's own DistributedOptimizer: "slices" has no slices there and runs as "pto".
        reference = out["lars.allreduce"]["weights"]
        horovod, mode = train_steps(topo, lars("slices"), "horovod.slices", horovod=True)
        assert mode == "pto", mode
        # Horovod fuses tensors as they become ready, so its sums' rounding varies from run to
        # run: float tolerance here (hvdx's one fused buffer is deterministic: bit-equality above).
        out["horovod_pto_vs_hvdx_replicated"] = float(np.max(np.abs(horovod - reference)) / np.max(np.abs(reference)))
        assert out["horovod_pto_vs_hvdx_replicated"] < 1e-4, out
    for entry in out.values():
        if isinstance(entry, dict):
            entry.pop("weights", None)
    return out


def digit_images():
    return digits.split((8, 8, 1))


def resnet(seed: int = 0) -> tf.keras.Model:
    """A stem and two residual blocks of 3x3 convolutions with batch norm, 8x8 inputs; Keras'
    layer names, which EXCLUDE's "batch_normalization" matches."""
    return zoo.resnet((16,), input_shape=(8, 8, 1), blocks_per_stage=2, bn_momentum=BN_MOMENTUM, layer_names=False,
                      seed=seed)


def check_digits(topo, epochs: int = 8, seed: int = 0) -> dict:
    """Test accuracy on this rank (its own batch-norm statistics) of the ResNet trained with
    momentum SGD and with LARS, each under HiTopK, the learning rate decayed linearly from 0.1
    to 0 over the `epochs` (at a constant rate the last steps' noise decided the accuracy:
    LARS from about even with SGD to 13 points under it, by seed)."""
    x_train, x_test, y_train, y_test = digit_images()
    per_rank = len(x_train) // topo.size
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    batch, accuracy = 16, {}
    for name in ("sgd", "lars"):
        model = resnet(seed)
        lr = tf.keras.optimizers.schedules.PolynomialDecay(0.1, epochs * -(-per_rank // batch), 0.0)
        inner = (tf.keras.optimizers.SGD(lr, momentum=0.9) if name == "sgd" else
                 LARS(lr, momentum=0.9, eeta=0.05, weight_decay=5e-4, exclude_from_weight_decay=EXCLUDE,
                      exclude_from_layer_adaptation=[], parallel="slices"))
        # like for like: both apply their own momentum to HiTopK's aggregate, LARS its trust
        # ratio after the aggregation, on the strategy's slices (the sparse aids, DGC's
        # momentum correction and LARS' local trust ratio, are tests/test_lars_sparse.py's)
        optimizer = hvdx.DistributedOptimizer(inner, communication="hitopk", density=0.01,
                                              momentum_correction=False,
                                              **({} if name == "sgd" else {"local_trust_ratio": False}))
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x_mine, y_mine, batch_size=batch, epochs=epochs, verbose=0,
                  callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
        accuracy[name] = float(model.evaluate(x_test, y_test, verbose=0)[1])
        same_on_every_rank(weights_of(model), f"digits.{name}")
        if name == "lars":
            assert inner.last_mode == "slices", inner.last_mode
    return accuracy


# -- under hvdx.DASO: node-local aggregation ------------------------------------------------
DASO_SHAPES = [(6, 5), (5,), (5, 4), (4,), (4, 3), (3,), (7,), (3, 2)]  # more layers than ranks: pto spans nodes
DASO_LARS = dict(learning_rate=0.5, momentum=0.9, weight_decay=1e-3, eeta=0.01, epsilon=0.0)


def daso_gradient(rank: int, step: int, layer: int) -> np.ndarray:
    """Rank `rank`'s gradient of `layer` at `step`, the same on every rank that computes it;
    the scale differs between nodes' ranks by up to 8x, so that norms of another node show."""
    rng = np.random.default_rng(1000 * rank + 10 * step + layer)
    return (rng.standard_normal(DASO_SHAPES[layer]) * (1 + 7 * (rank % 3 == 1) * (layer % 2))).astype(np.float32)


def lars_eq11_reference(initial, node_gradients, learning_rate, momentum, weight_decay, eeta, epsilon):
    """Classic-momentum LARS in float64 from eq. 11: trust = eeta ||w|| / (||g|| + wd ||w|| + eps),
    v <- momentum v + lr trust (g + wd w), w <- w - v; `node_gradients[k][i]` the node's average."""
    w = [x.astype(np.float64) for x in initial]
    v = [np.zeros_like(x) for x in w]
    for step in node_gradients:
        for i, g in enumerate(step):
            w_norm, g_norm = np.linalg.norm(w[i]), np.linalg.norm(g)
            trust = eeta * w_norm / (g_norm + weight_decay * w_norm + epsilon) if w_norm > 0 and g_norm > 0 else 1.0
            v[i] = momentum * v[i] + learning_rate * trust * (g + weight_decay * w[i])
            w[i] = w[i] - v[i]
    return w


def check_under_daso(topo, steps: int = 2) -> dict:
    """LARS / LAMB as DASO's inner optimizer (no global synchronisation in these steps: B is
    larger): the weights of each mode, the error against eq. 11 on this node's averaged
    gradients, and what "slices" says."""
    from hvdx.daso import DASO

    initial = [np.random.default_rng(7 + i).standard_normal(s).astype(np.float32) for i, s in enumerate(DASO_SHAPES)]
    node = topo.local_ranks
    node_gradients = [[np.mean([daso_gradient(r, k, i) for r in node], axis=0, dtype=np.float64)
                       for i in range(len(DASO_SHAPES))] for k in range(steps)]
    reference = lars_eq11_reference(initial, node_gradients, **DASO_LARS)
    scale = max(float(np.max(np.abs(r - w))) for r, w in zip(reference, initial))  # the largest update

    def run(inner, tag, steps):
        variables = [tf.Variable(w, name=f"{tag}{i}/kernel") for i, w in enumerate(initial)]
        opt = DASO(inner, total_epochs=1, warmup_epochs=0, cooldown_epochs=0, max_global_skips=100)

        @tf.function
        def step(grads):
            opt.apply_gradients(zip(grads, variables))

        for k in range(steps):
            step([tf.constant(daso_gradient(topo.rank, k, i)) for i in range(len(DASO_SHAPES))])
            if k + 1 < steps:
                opt.after_step()  # B = 100: no global average in these steps
        return [v.numpy() for v in variables], inner.last_mode

    out = {"lars": {}, "lamb": {}, "modes": {}}
    for mode in (None, "pto"):
        weights, used = run(LARS(parallel=mode, exclude_from_weight_decay=[], **DASO_LARS), f"lars_{mode}_", steps)
        out["modes"][str(mode)] = used
        out["lars"][str(mode)] = {
            "eq11_error": max(float(np.max(np.abs(w - r))) for w, r in zip(weights, reference)) / scale,
            "node_spread": node_spread(topo, weights, f"daso.lars.{mode}"),
            "between_nodes": between_nodes(topo, weights, f"daso.lars.{mode}")}
        lamb, _ = run(LAMB(0.01, weight_decay=0.01, parallel=mode), f"lamb_{mode}_", 1)
        out["lamb"][str(mode)] = lamb
    out["lamb_pto_equal_replicated"] = all(np.array_equal(bits(a), bits(b))
                                           for a, b in zip(out["lamb"]["None"], out["lamb"]["pto"]))
    out["lamb_between_nodes"] = between_nodes(topo, out["lamb"]["pto"], "daso.lamb")
    del out["lamb"]
    try:
        DASO(LARS(parallel="slices"), total_epochs=1)
        out["slices"] = "no error"
    except ValueError as exc:
        out["slices"] = f"ValueError: {exc}"
    return out


def node_spread(topo, weights, tag: str) -> float:
    """Largest difference between the ranks of this node."""
    flat = tf.constant(np.concatenate([np.ravel(w) for w in weights]))
    low = hvd.allreduce(flat, op=hvd.Min, process_set=topo.local_set, name=f"{tag}.min").numpy()
    high = hvd.allreduce(flat, op=hvd.Max, process_set=topo.local_set, name=f"{tag}.max").numpy()
    return float(np.max(high - low))


def between_nodes(topo, weights, tag: str) -> float:
    """Largest difference between the nodes' weights (each node trains on its own gradients)."""
    flat = tf.constant(np.concatenate([np.ravel(w) for w in weights]))
    low = hvd.allreduce(flat, op=hvd.Min, name=f"{tag}.nodes.min").numpy()
    high = hvd.allreduce(flat, op=hvd.Max, name=f"{tag}.nodes.max").numpy()
    return float(np.max(high - low))


CHECKS = {"pto": check_pto, "modes": check_modes, "digits": check_digits, "under_daso": check_under_daso}
