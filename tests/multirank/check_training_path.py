"""The training path a user runs, defect by defect (issue: "A training path users can
trust"), on every rank of an m x n job. Each check returns what the test asserts on.

Run by tests/test_training_path.py through the suite (2 nodes x 2 ranks).
"""
import os
import shutil
import tempfile
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.zoo import mlp

SPARSE = ("hitopk", "sparse_allgather")
ALL = ("allreduce", "hierarchical") + SPARSE


def options(strategy, density=0.05):
    return {"communication": strategy, **({"density": density} if strategy in SPARSE else {})}


def same_on_every_rank(values, tag):
    """True when every rank holds the same array (bitwise)."""
    flat = tf.constant(np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values]))
    low = hvd.allreduce(flat, op=hvd.Min, name=f"min.{tag}")
    high = hvd.allreduce(flat, op=hvd.Max, name=f"max.{tag}")
    return bool(np.array_equal(low.numpy(), high.numpy()) or np.allclose(low.numpy(), high.numpy(), rtol=0, atol=0,
                                                                        equal_nan=True))


def digits_model(seed=0):
    return mlp(64, (32,), seed=seed)


def digits(rank, size, n=256):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)[:n * size]
    y = data.target[:n * size]
    return x[rank::size][:n], y[rank::size][:n]


# 1. mixed precision ------------------------------------------------------------------
def check_mixed_precision(topo):
    """model.fit under mixed_float16 with rank 1 overflowing now and then: no hang, every
    rank applies the same steps and ends with the same weights and loss scale."""
    out = {}
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for strategy in ("allreduce", "hitopk"):
            x, y = digits(topo.rank, topo.size)
            if topo.rank == 1:
                x = x.copy()
                x[::16] *= 3e4  # overflows float16 activations in those batches on rank 1 only
            model = digits_model()
            inner = tf.keras.optimizers.SGD(0.05, momentum=0.9)
            opt = hvdx.DistributedOptimizer(inner, **options(strategy))
            model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            assert type(model.optimizer).__name__ == "LossScaleOptimizerV3", type(model.optimizer)
            started = time.time()
            model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
            weights = [w.numpy() for w in model.trainable_variables]
            scale = float(model.optimizer.loss_scale.numpy())
            out[strategy] = {
                "seconds": time.time() - started,
                "weights_equal": same_on_every_rank(weights, f"mp.w.{strategy}"),
                "scale_equal": same_on_every_rank([scale], f"mp.s.{strategy}"),
                "finite": bool(all(np.isfinite(w).all() for w in weights)),
                "scale": scale, "iterations": int(model.optimizer.iterations.numpy()),
            }
            if strategy == "hitopk":
                residuals = opt.aggregator.residuals
                out[strategy]["residuals_finite"] = bool(all(np.isfinite(r.numpy()).all() for r in residuals))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    return out


# 2. non-finite steps -----------------------------------------------------------------
def check_non_finite(topo):
    """One Inf (and one float16 overflow) through each strategy: the step's output is not
    finite, residuals are untouched by it, and the next steps are finite again."""
    out = {}
    rng = np.random.default_rng(topo.rank)
    for strategy in ALL:
        for wire in (None, tf.float16):
            agg = hvdx.GradientAggregator(**options(strategy, 0.1), wire_dtype=wire)
            variable = tf.Variable(np.zeros(203, np.float32))
            finite_after, untouched, inf_seen = True, True, None
            for step in range(5):
                g = rng.standard_normal(203).astype(np.float32)
                if step == 2 and topo.rank == 1:
                    g[7] = np.inf
                before = [r.numpy().copy() for r in agg.residuals]
                averaged = agg([tf.constant(g)], [variable])[0].numpy()
                if step == 2:
                    inf_seen = not bool(np.isfinite(averaged).all())
                    untouched = all(np.array_equal(b, r.numpy()) for b, r in zip(before, agg.residuals))
                elif step > 2:
                    finite_after = finite_after and bool(np.isfinite(averaged).all())
            out[f"{strategy}/{wire.name if wire else 'float32'}"] = {
                "inf_reaches_output": inf_seen, "residuals_untouched": untouched, "finite_after": finite_after,
                "has_residuals": bool(agg.residuals)}
    # A finite 1e5 through a float16 wire: arrives finite (scaled on the wire), nearly exact.
    for strategy in SPARSE:
        agg = hvdx.GradientAggregator(communication=strategy, density=0.1, wire_dtype=tf.float16)
        g = np.zeros(100, np.float32)
        g[3] = 1e5
        got = agg([tf.constant(g)], [tf.Variable(np.zeros(100, np.float32))])[0].numpy()
        out[f"{strategy}/float16 1e5"] = {"value": float(got[3]), "finite": bool(np.isfinite(got).all())}
    return out


def check_loss_scaled_tape(topo):
    """A custom loop with dynamic loss scaling and HiTopK: after an overflow (skipped on
    every rank) training goes on, and residuals follow the loss scale."""
    opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.01), initial_scale=2.0 ** 15)
    variable = tf.Variable(np.ones(400, np.float32))
    applied = 0
    scales = []
    for step in range(12):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable ** 2) * (1e36 if (step == 3 and topo.rank == 0) else 1.0)
            scaled = opt.get_scaled_loss(loss)
        tape = hvdx.DistributedGradientTape(tape, communication="hitopk", density=0.05, loss_scale=opt)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [variable]))
        before = int(opt.iterations.numpy())
        finite = bool(np.isfinite(grads[0].numpy()).all())
        opt.apply_gradients(zip(grads, [variable]))
        applied += int(finite)
        scales.append(float(opt.loss_scale.numpy()))
        assert int(opt.iterations.numpy()) == before + 1
    memory = tape.aggregator._memories[0]
    stored_scale = float(list(memory._scales.values())[0].numpy())
    return {"applied": applied, "scales": scales, "stored_scale": stored_scale,
            "weights_equal": same_on_every_rank([variable.numpy()], "lst.w")}


# 3. two models -----------------------------------------------------------------------
def check_two_models(topo):
    """A GAN-like loop: models A and B of equal size trained with tapes of equal options.
    B's true gradient is 0: it must receive exactly 0, never A's unsent gradient."""
    a = tf.Variable(np.random.default_rng(topo.rank).standard_normal(300).astype(np.float32))
    b = tf.Variable(np.zeros(300, np.float32))
    b_grads = []
    for _ in range(4):
        with hvdx.DistributedGradientTape(communication="hitopk", density=0.02) as tape:
            loss_a = tf.reduce_sum(a ** 2)
        tape.gradient(loss_a, [a])
        with hvdx.DistributedGradientTape(communication="hitopk", density=0.02) as tape:
            loss_b = tf.reduce_sum(b * 0.0)
        b_grads.append(float(np.abs(tape.gradient(loss_b, [b])[0].numpy()).max()))
    return {"b_grad_max": max(b_grads), "residual_sets": len(tape.aggregator.residuals)}


# 4. ranks that disagree ----------------------------------------------------------------
def expect_mismatch(action):
    started = time.time()
    try:
        action()
    except hvdx.RankMismatchError as exc:
        return {"raised": True, "message": str(exc), "seconds": time.time() - started}
    return {"raised": False, "seconds": time.time() - started}


def check_mismatches(topo):
    out = {}
    v = [tf.Variable(np.ones(50, np.float32)), tf.Variable(np.ones(20, np.float32))]

    def none_on_rank_1():
        agg = hvdx.GradientAggregator()
        grads = [tf.ones(50), None if topo.rank == 1 else tf.ones(20)]
        agg(grads, v)
    out["none_gradient"] = expect_mismatch(none_on_rank_1)

    def length():
        agg = hvdx.GradientAggregator(communication="hitopk")
        n = 60 if topo.rank == 2 else 50
        agg([tf.ones(n)], [tf.Variable(np.ones(n, np.float32))])
    out["length"] = expect_mismatch(length)

    def density():
        agg = hvdx.GradientAggregator(communication="hitopk", density=0.02 if topo.rank == 3 else 0.01)
        agg([tf.ones(50)], [v[0]])
    out["density"] = expect_mismatch(density)

    def strategy():
        agg = hvdx.GradientAggregator(communication="hierarchical" if topo.rank == 1 else "allreduce")
        agg([tf.ones(50)], [v[0]])
    out["strategy"] = expect_mismatch(strategy)

    def steps():
        x, y = digits(topo.rank, topo.size, n=64 + (16 if topo.rank == 0 else 0))
        model = digits_model()
        model.compile(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["steps"] = expect_mismatch(steps)
    return out


# 5. checkpoints --------------------------------------------------------------------------
def trained_hitopk_model(topo, legacy=False):
    x, y = digits(topo.rank, topo.size, n=64)
    model = digits_model()
    inner = (tf.keras.optimizers.legacy.Adam if legacy else tf.keras.optimizers.Adam)(0.01)
    # no density warm-up (Adam's default): its first steps are dense and leave no residual to keep
    opt = hvdx.DistributedOptimizer(inner, communication="hitopk", density=0.02, warmup_steps=0)
    model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model, opt


def residual_view(opt):
    """What the next step would add: this rank's residuals as read (zeros if foreign)."""
    views = []
    for memory in opt.aggregator._memories:
        for name, residual in memory.variables_by_name.items():
            views.append(memory.read(name, int(residual.shape[0]), residual.dtype).numpy())
    return views


def same_arrays(got, want):
    """Equal as multisets (a legacy optimizer lists its slots in creation order, which a
    restore may change)."""
    key = lambda a: (a.shape, float(np.sum(a)))
    got, want = sorted(got, key=key), sorted(want, key=key)
    return len(got) == len(want) and all(a.shape == b.shape and np.allclose(a, b) for a, b in zip(got, want))


def check_checkpoints(topo):
    out = {}
    shared = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdx-ckpt-") if topo.rank == 0 else None,
                                  root_rank=0, name="ckpt.dir")
    mine = tempfile.mkdtemp(prefix=f"hvdx-ckpt-r{topo.rank}-")
    try:
        for legacy in (False, True):
            # One trained model per kind, saved in every format (saving changes neither it nor
            # its optimizer): the same state each format must give back.
            model, opt = trained_hitopk_model(topo, legacy)
            residuals = [r.numpy().copy() for r in opt.aggregator.residuals]
            iterations = int(opt.iterations.numpy())
            inner_state = [w.copy() for w in opt.get_weights()]
            for fmt in ("keras", "savedmodel", "h5", "checkpoint"):
                for who, folder in (("own", mine), ("rank0", shared)):
                    path = os.path.join(folder, f"{fmt}-{legacy}" + {"keras": ".keras", "h5": ".h5"}.get(fmt, ""))
                    if who == "own" or topo.rank == 0:
                        if fmt == "checkpoint":
                            path = tf.train.Checkpoint(model=model, optimizer=opt).write(path)
                        else:
                            model.save(path)
                    path = hvd.broadcast_object(path, root_rank=0, name=f"p.{fmt}.{legacy}") if who == "rank0" else path
                    hvdx.barrier()
                    if fmt == "checkpoint":
                        loaded_model, loaded = digits_model(seed=1), None
                        loaded = hvdx.DistributedOptimizer(
                            (tf.keras.optimizers.legacy.Adam if legacy else tf.keras.optimizers.Adam)(0.01),
                            communication="hitopk", density=0.02, warmup_steps=0)
                        tf.train.Checkpoint(model=loaded_model, optimizer=loaded).read(path)
                        loaded.build(loaded_model.trainable_variables)
                        loaded_model.compile(loaded, loss="mse")
                    else:
                        loaded_model = hvdx.load_model(path)
                        loaded = loaded_model.optimizer
                    loaded.build(loaded_model.trainable_variables)  # (Keras' loaders have, too)
                    views = residual_view(loaded)
                    record = {
                        "type": type(loaded).__name__,
                        "iterations": int(loaded.iterations.numpy()) == iterations,
                        "inner_state": same_arrays(loaded.get_weights(), inner_state),
                        "own_residual": all(np.array_equal(a, b) for a, b in zip(views, residuals)),
                        "zero_residual": all(not np.any(v) for v in views),
                        "nonzero_saved": any(np.any(r) for r in residuals),
                    }
                    out[f"{fmt}/{'legacy' if legacy else 'new'}/{who}"] = record
                    hvdx.barrier()
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        hvdx.barrier()
        if topo.rank == 0:
            shutil.rmtree(shared, ignore_errors=True)
    return out


# 6. Horovod's options -----------------------------------------------------------------
def train_steps(make_optimizer, topo, steps=4, embedding=False, seed=0, eager=False, models=None):
    """A few steps of model.fit with the same data, model and initial weights: the final
    weights and the model. `models`, a dict the caller keeps for runs under one dtype
    policy: the model of each kind is built once into it and reset to its initial weights
    for every run (building one is a fair share of a run's cost; None: a new model).
    `eager` runs model.fit eagerly (no train function traced)."""
    rng = np.random.default_rng(100 + topo.rank)
    models = {} if models is None else models
    if (embedding, seed) not in models:
        tf.keras.utils.set_random_seed(seed)
        if embedding:  # not a zoo model: int tokens into an Embedding, whose gradients are IndexedSlices
            model = tf.keras.Sequential([tf.keras.layers.Input((6,), dtype="int32"),
                                         tf.keras.layers.Embedding(50, 4), tf.keras.layers.Flatten(),
                                         tf.keras.layers.Dense(3)])
        else:
            model = mlp(6, (8,), 3, activation="tanh")
        models[embedding, seed] = model, model.get_weights()
    model, initial = models[embedding, seed]
    model.set_weights(initial)
    if embedding:
        x = rng.integers(0, 50, (16 * steps, 6))
    else:
        x = rng.standard_normal((16 * steps, 6)).astype(np.float32)
    y = rng.integers(0, 3, 16 * steps)
    model.compile(make_optimizer(), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=eager)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_variables], model


def check_horovod_options(topo):
    import horovod.tensorflow.keras as hvd_keras

    out = {}
    cases = {
        "default": {},
        "compression_fp16": {"compression": hvd.Compression.fp16},
        "sparse_as_dense": {"sparse_as_dense": True},
        "sparse_indexed_slices": {"sparse_as_dense": False},
        "backward_passes_per_step": {"backward_passes_per_step": 2},
        "average_aggregated_gradients": {"backward_passes_per_step": 2, "average_aggregated_gradients": True},
        "op_sum": {"op": hvd.Sum},
        "gradient_predivide_factor": {"gradient_predivide_factor": 2.0},
        "num_groups": {"num_groups": 2},
        "device_dense": {"device_dense": "/cpu:0", "device_sparse": "/cpu:0"},
        "scale_local_gradients": {"scale_local_gradients": False},
    }
    horovods, models = {}, {}
    for label, kwargs in cases.items():
        embedding = label.startswith("sparse")
        for strategy in ("allreduce", "hitopk"):
            if strategy == "hitopk" and label in ("op_sum", "gradient_predivide_factor"):
                pass  # both still apply (a sum is the average times the size)
            extra = {} if strategy == "allreduce" else {"communication": "hitopk", "density": 1.0}
            if strategy == "hitopk" and label == "compression_fp16":
                extra = {"communication": "hierarchical"}  # fp16 values: compare a dense strategy
            ours, _ = train_steps(lambda: hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **kwargs, **extra),
                                  topo, embedding=embedding, models=models)
            if label not in horovods:  # Horovod's weights do not depend on hvdx's strategy: train them once,
                horovods[label], _ = train_steps(  # eagerly (the reference: hvdx's runs are the traced ones)
                    lambda: hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **kwargs), topo,
                    embedding=embedding, eager=True, models=models)
            theirs = horovods[label]
            tol = 2e-3 if label == "compression_fp16" else 1e-5
            out[f"{label}/{strategy}"] = bool(all(np.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(ours, theirs)))
    out["name_positional"] = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), "mine").name == "mine"
    try:
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), "hitopk")
        out["strategy_as_name_rejected"] = False
    except ValueError as exc:
        out["strategy_as_name_rejected"] = "communication='hitopk'" in str(exc)
    # local variables: Horovod's PartialDistributedOptimizer and register_local_var
    local = tf.Variable(np.full(3, float(topo.rank + 1), np.float32))
    shared = tf.Variable(np.full(3, float(topo.rank + 1), np.float32))
    for cls_label, make in (("hvdx", hvdx.DistributedOptimizer), ("horovod", hvd_keras.DistributedOptimizer)):
        opt = make(tf.keras.optimizers.SGD(1.0))
        opt.register_local_var(local)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local * float(topo.rank + 1)) + tf.reduce_sum(shared * float(topo.rank + 1))
        grads = opt._compute_gradients(loss, [local, shared], tape=tape)
        out[f"local_var/{cls_label}"] = [g.numpy().tolist() for g, _ in grads]
    out["local_var"] = out["local_var/hvdx"] == out["local_var/horovod"]
    # momentum correction of LearningRateWarmupCallback reaches the wrapped optimizer
    legacy = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    wrapped = hvdx.DistributedOptimizer(legacy)
    out["momentum_reachable"] = wrapped.momentum is legacy.momentum
    # float64 gradients keep their dtype and are averaged in float64
    v64 = tf.Variable(np.full(4, 1.0 + 1e-12 * topo.rank, np.float64))
    g64 = hvdx.GradientAggregator()([tf.constant(np.full(4, 1.0 + 1e-12 * topo.rank, np.float64))], [v64])[0]
    out["float64"] = {"dtype": g64.dtype.name, "exact": bool(np.allclose(
        g64.numpy(), 1.0 + 1e-12 * np.mean(range(topo.size)), rtol=0, atol=1e-15))}
    # hvdx.DistributedGradientTape(tape) wraps an existing tape, like Horovod's
    x = tf.Variable(np.arange(5, dtype=np.float32) * (topo.rank + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x ** 2)
    got = hvdx.DistributedGradientTape(tape).gradient(loss, [x])[0].numpy()
    want = 2 * np.arange(5) * np.mean([r + 1 for r in range(topo.size)])
    out["tape_wraps"] = bool(np.allclose(got, want))
    # a process set: only the first node's ranks aggregate, as with Horovod's
    ps = hvdx.topology().local_set if topo.node == 0 else None
    node0 = hvdx.topology().node_ranks[0]
    if topo.rank in node0:
        opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), process_set=ps)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(shared * float(topo.rank + 1))
        g = opt._compute_gradients(loss, [shared], tape=tape)[0][0].numpy()
        out["process_set"] = bool(np.allclose(g, np.mean([r + 1 for r in node0])))
    hvdx.barrier()
    return out


# 7. the default is lossless; bad options fail at construction ---------------------------
def check_defaults_and_errors(topo):
    out = {}
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    out["default"] = type(opt.communication).__name__
    bad = {
        "density_with_dense": lambda: hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), density=0.01),
        "density_zero": lambda: hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk",
                                                          density=0),
        "instance_with_options": lambda: hvdx.DistributedOptimizer(
            tf.keras.optimizers.SGD(), communication=hvdx.comm.HiTopK(), density=0.1),
        "adasum_sparse": lambda: hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk",
                                                           op=hvd.Adasum),
        "mstopk_fractional_k": lambda: hvdx.mstopk(tf.ones(10), 1.7),
        "tape_persistent_positional": lambda: hvdx.DistributedGradientTape(True),
    }
    for label, make in bad.items():
        try:
            make()
            out[label] = "accepted"
        except (ValueError, TypeError) as exc:
            out[label] = str(exc)
    out["numpy_density"] = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk",
                                                     density=np.float32(0.05)).communication.density
    config = hvdx.DistributedOptimizer(tf.keras.optimizers.Adam(), communication="hitopk",
                                       wire_dtype=tf.float16).get_config()
    import json

    out["config_json"] = bool(json.dumps(config))
    before = json.dumps(config, sort_keys=True)
    hvdx.DistributedOptimizer.from_config(config)
    out["from_config_pure"] = json.dumps(config, sort_keys=True) == before
    return out


# 8. small things ------------------------------------------------------------------------
def check_small_things(topo):
    out = {}
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk")
    out["no_gradients"] = opt.apply_gradients([]) is None
    v = tf.Variable(np.ones(4, np.float32))
    out["all_none"] = opt.apply_gradients([(None, v)]) is None
    agg = hvdx.GradientAggregator(communication="hitopk")
    out["none_list"] = agg([None, None], [v, v]) == [None, None]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def unknown(x):
        return hvdx.GradientAggregator(communication="hitopk", density=0.5)([x * 2.0], [None])[0]
    out["unknown_shape"] = bool(np.allclose(unknown(tf.ones(7) * (topo.rank + 1)).numpy(),
                                            2 * np.mean([r + 1 for r in range(topo.size)])))
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        weights, _ = train_steps(lambda: hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                                   communication="hitopk", density=0.5),
                                 topo, embedding=True)
        out["mixed_precision_embedding"] = bool(all(np.isfinite(w).all() for w in weights))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    # a wrapped AggregationObserver (LARS, LAMB) gets each aggregation's record: the slices
    seen = {}

    class Observer(tf.keras.optimizers.SGD, hvdx.buckets.AggregationObserver):
        def observe_aggregation(self, record):
            seen["slices"] = [r.local_slice is not None for r in record.results]
            seen["variables"] = len(record.variables)
            seen["calls"] = seen.get("calls", 0) + 1

    observed = hvdx.DistributedOptimizer(Observer(0.1), communication="hitopk", density=0.5)
    train_steps(lambda: observed, topo, steps=3)
    out["aggregation_observed"] = seen.get("slices") == [True] and seen.get("calls", 0) >= 1 and \
        seen.get("variables") == len(observed.aggregator.last_aggregation.variables) > 0
    # buckets never exceed the cap: a tensor spans two buckets, same result as one bucket
    g = tf.constant(np.random.default_rng(topo.rank).standard_normal(50).astype(np.float32))
    capped = hvdx.GradientAggregator(communication="hitopk", density=1.0)
    capped.max_bucket_elements = 16
    whole = hvdx.GradientAggregator(communication="allreduce")
    for cls in (hvdx.comm.HiTopK, hvdx.comm.SparseAllgather):  # int64 indices end to end (wire, offsets)
        wide = cls(density=0.3, index_dtype=tf.int64)(g, name="wide").numpy()
        narrow = cls(density=0.3)(g, name="narrow").numpy()
        out[f"int64_indices/{cls.key}"] = bool(np.array_equal(wide, narrow))
    out["bucket_cap"] = bool(np.allclose(capped([g], [None])[0].numpy(), whole([g], [None])[0].numpy(), atol=1e-6))
    return out


CHECKS = {check.__name__[len("check_"):]: check
          for check in (check_defaults_and_errors, check_small_things, check_non_finite, check_two_models,
                        check_mismatches, check_loss_scaled_tape, check_mixed_precision, check_horovod_options,
                        check_checkpoints)}
