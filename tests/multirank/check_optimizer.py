"""hvdx.DistributedOptimizer / DistributedGradientTape on an m x n topology, every rank.

- the tape with every strategy at density 1.0 averages like hvd.allreduce;
- model.fit on scikit-learn's digits with each strategy (same seeds and hyper-parameters):
  every rank holds the same weights, a strategy switch by callback takes effect, and (with
  `accuracy_bar`) the MSTopK strategies end within 1 point of Allreduce's test accuracy;
- residuals survive a checkpoint round-trip; bad input fails clearly;
- `keras3_fit`: a Keras 3 model trained by `fit` through hvdx.DistributedOptimizer around a
  Keras 3 SGD (hvdx/keras3_optimizer.py) ends with identical weights on every rank and learns;
- `keras3_mixed_precision`: the same under Keras 3's mixed_float16 policy (a LossScaleOptimizer
  inside the wrapper), with one step on which only rank 1's gradients are not finite: every
  rank skips it alike.
"""
import os
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from tests.multirank import digits

STRATEGIES = ["allreduce", "hierarchical", "sparse_allgather", "hitopk"]


make_model = digits.mlp


def train(topo, communication: str, epochs: int, legacy: bool = False, callbacks=()):
    x_train, x_test, y_train, y_test = digits.split()
    per_rank = len(x_train) // topo.size  # equal shards: every rank runs the same steps
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    model = make_model()
    inner = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(
        learning_rate=0.05 * topo.size, momentum=0.9)
    density = {"density": 0.01} if communication in ("sparse_allgather", "hitopk") else {}
    optimizer = hvdx.DistributedOptimizer(inner, communication=communication, **density)
    assert optimizer.inner_optimizer is inner and type(inner).__name__ == "SGD"
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x_mine, y_mine, batch_size=16, epochs=epochs, verbose=0,
              callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    spread = hvd.allreduce(tf.constant(weights), op=hvd.Max, name=f"wmax.{communication}.{legacy}") - \
        hvd.allreduce(tf.constant(weights), op=hvd.Min, name=f"wmin.{communication}.{legacy}")
    assert float(tf.reduce_max(spread)) == 0.0, f"{communication}: ranks hold different weights"
    return float(accuracy), optimizer, model


def check_tape(topo) -> None:
    rng = np.random.default_rng(topo.rank)
    variables = [tf.Variable(rng.standard_normal((7, 5)), dtype=tf.float32),
                 tf.Variable(rng.standard_normal(13), dtype=tf.float32)]
    for strategy in STRATEGIES:
        density = {"density": 1.0} if strategy in ("sparse_allgather", "hitopk") else {}
        with hvdx.DistributedGradientTape(communication=strategy, bucket_bytes=64, **density) as tape:
            loss = tf.reduce_sum(variables[0] ** 2) + tf.reduce_sum(tf.sin(variables[1]))
        got = tape.gradient(loss, variables)
        want = [hvd.allreduce(g, op=hvd.Average, name=f"tape.{strategy}.{i}")
                for i, g in enumerate([2 * variables[0], tf.cos(variables[1])])]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def check_tape_keeps_residuals_across_steps(topo) -> None:
    """A tape made anew every step still feeds back what the last step did not send."""
    variable = tf.Variable(np.random.default_rng(topo.rank).standard_normal(400), dtype=tf.float32)
    for step in range(3):
        with hvdx.DistributedGradientTape(communication="hitopk", density=0.05) as tape:
            loss = tf.reduce_sum(variable ** 2)
        tape.gradient(loss, [variable])
    residuals = tape.aggregator.residuals
    assert len(residuals) == 1 and np.abs(residuals[0].numpy()).sum() > 0


def check_checkpoint(optimizer: hvdx.DistributedOptimizer, model: tf.keras.Model) -> None:
    residuals = optimizer.aggregator.residuals
    assert residuals and any(np.abs(r.numpy()).sum() > 0 for r in residuals)
    saved = [r.numpy().copy() for r in residuals]
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    save_path = checkpoint.save(path)
    for r in residuals:
        r.assign(tf.zeros_like(r))
    checkpoint.restore(save_path).assert_consumed()
    for r, s in zip(residuals, saved):
        np.testing.assert_array_equal(r.numpy(), s)


def check_bad_input() -> None:
    for bad in (object(), tf.compat.v1.train.GradientDescentOptimizer(0.1)):
        try:
            hvdx.DistributedOptimizer(bad)
        except ValueError as exc:
            assert "wraps a Keras optimizer" in str(exc), exc
        else:
            raise AssertionError(f"a non-Keras optimizer was accepted: {bad!r}")
    for kwargs, match in [({"communication": "ring"}, "unknown communication strategy"),
                          ({"density": 0.0}, "density"), ({"density": 2}, "density"),
                          ({"bucket_bytes": -1}, "bucket_bytes")]:
        try:
            hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), **kwargs)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"{kwargs} accepted")


def check_training(topo, epochs: int = 14, accuracy_bar: bool = True) -> dict:
    """Everything above; the MSTopK strategies held to Allreduce's test accuracy minus 1
    point only with `accuracy_bar` (it needs the epochs to get there: tests/test_optimizer.py
    says how many)."""
    check_bad_input()
    check_tape(topo)
    check_tape_keeps_residuals_across_steps(topo)
    print("tape ok", flush=True)
    accuracy = {}
    for strategy in STRATEGIES:
        accuracy[strategy], optimizer, model = train(topo, strategy, epochs)
        print(f"{strategy}: test accuracy {accuracy[strategy]:.4f}", flush=True)
    for strategy in ("sparse_allgather", "hitopk"):
        assert not accuracy_bar or accuracy[strategy] >= accuracy["allreduce"] - 0.01, accuracy
    check_checkpoint(optimizer, model)
    # Legacy optimizers, and the DAWNBench switch from MSTopK to 2DTAR.
    switched, optimizer, _ = train(topo, "hitopk", 3, legacy=True,
                                   callbacks=[hvdx.callbacks.SwitchCommunication(2, "hierarchical")])
    assert type(optimizer.communication).__name__ == "Hierarchical", optimizer.communication
    return {"accuracy": accuracy, "switched": switched}


def _keras3_digits_mlp(topo, communication: str):
    """A Keras 3 MLP for the digits, seeded by rank (the ranks start apart), compiled with
    hvdx.DistributedOptimizer(keras.optimizers.SGD(0.05 x size, momentum 0.9)) and
    `communication` (HiTopK at density 0.05). Returns (model, optimizer)."""
    import keras

    keras.utils.set_random_seed(topo.rank)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    density = {"density": 0.05} if communication == "hitopk" else {}
    optimizer = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.05 * topo.size, momentum=0.9),
                                          communication=communication, **density)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, optimizer


def check_keras3_fit(topo, epochs: int = 6) -> dict:
    """A Keras 3 model (`import keras`, beside tf.keras's tf_keras) trained by `fit` through
    hvdx.DistributedOptimizer(keras.optimizers.SGD) with allreduce, 2DTAR and HiTopK, each rank
    seeded differently and then given rank 0's weights (hvdx.broadcast_variables): the trained
    weights' spread over the ranks (max - min, 0.0 when bitwise identical), test accuracy and
    losses per strategy. Where the keras package is not Keras 3 (the tf2.15 stack) it trains
    nothing and says so (its test is skipped there)."""
    import importlib.metadata

    version = importlib.metadata.version("keras")
    if int(version.split(".")[0]) < 3:
        return {"keras": version, "skipped": "no Keras 3 on this stack"}
    import keras

    x_train, x_test, y_train, y_test = digits.split()
    per_rank = len(x_train) // topo.size  # equal shards: every rank runs the same steps
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    runs = {}
    for communication in ("allreduce", "hierarchical", "hitopk"):
        model, optimizer = _keras3_digits_mlp(topo, communication)
        before = np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])
        spread_before = hvd.allreduce(tf.constant(before), op=hvd.Max, name=f"k3max0.{communication}") - \
            hvd.allreduce(tf.constant(before), op=hvd.Min, name=f"k3min0.{communication}")
        hvdx.broadcast_variables(model.variables, root_rank=0)
        history = model.fit(x_mine, y_mine, batch_size=16, epochs=epochs, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        weights = np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])
        spread = hvd.allreduce(tf.constant(weights), op=hvd.Max, name=f"k3max.{communication}") - \
            hvd.allreduce(tf.constant(weights), op=hvd.Min, name=f"k3min.{communication}")
        losses = history.history["loss"]
        runs[communication] = {"spread_before": float(tf.reduce_max(spread_before)),
                               "spread": float(tf.reduce_max(spread)), "accuracy": float(accuracy),
                               "first_loss": losses[0], "last_loss": losses[-1],
                               "wrapper": type(optimizer).__module__,
                               "is_sgd": isinstance(optimizer, keras.optimizers.SGD)}
        print(f"keras3 {communication}: test accuracy {accuracy:.4f}", flush=True)
    return {"keras": version, "runs": runs}


def _spread(values: np.ndarray, name: str) -> float:
    """max - min over the ranks of each element of `values`, the largest (0.0: bitwise identical)."""
    values = tf.constant(values)
    return float(tf.reduce_max(hvd.allreduce(values, op=hvd.Max, name=f"{name}.max") -
                               hvd.allreduce(values, op=hvd.Min, name=f"{name}.min")))


def check_keras3_mixed_precision(topo, epochs: int = 6) -> dict:
    """A Keras 3 MLP under the mixed_float16 policy trained by `fit` through
    hvdx.DistributedOptimizer(keras.optimizers.SGD) (made under the policy: a LossScaleOptimizer
    inside it) with allreduce and HiTopK, the ranks seeded apart then given rank 0's weights;
    halfway, one step on which only rank 1's batch holds an inf (its gradients alone are not
    finite): per strategy, whether every rank skipped it alike (weights, residuals as they were,
    the scale halved, the same scale everywhere), the weights' spread over the ranks after
    training, test accuracy and losses. Where the keras package is not Keras 3 it trains nothing."""
    import importlib.metadata

    version = importlib.metadata.version("keras")
    if int(version.split(".")[0]) < 3:
        return {"keras": version, "skipped": "no Keras 3 on this stack"}
    import keras

    x_train, x_test, y_train, y_test = digits.split()
    per_rank = len(x_train) // topo.size
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    runs = {}
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for communication in ("allreduce", "hitopk"):
            model, optimizer = _keras3_digits_mlp(topo, communication)  # made under the policy
            flat = lambda: np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])
            spread_before = _spread(flat(), f"mp0.{communication}")
            hvdx.broadcast_variables(model.variables, root_rank=0)
            first = model.fit(x_mine, y_mine, batch_size=16, epochs=epochs // 2, verbose=0).history["loss"]
            # one step on which only rank 1's gradients are not finite
            weights, scale = flat(), float(optimizer.dynamic_scale.numpy())
            residuals = [r.numpy().copy() for r in optimizer.aggregator.residuals]
            nonfinite, iterations = int(optimizer.nonfinite_steps.numpy()), int(optimizer.iterations.numpy())
            batch = x_mine[:16].copy()
            if topo.rank == 1:
                batch[0, 0] = np.inf
            model.train_on_batch(batch, y_mine[:16])
            skipped = {
                "weights_unchanged": bool(np.array_equal(flat(), weights)),
                "residuals_unchanged": len(residuals) == len(optimizer.aggregator.residuals) and all(
                    np.array_equal(r.numpy(), before) for r, before in zip(optimizer.aggregator.residuals, residuals)),
                "has_residuals": bool(residuals),
                "scale_before": scale, "scale_after": float(optimizer.dynamic_scale.numpy()),
                "scale_spread": _spread(np.array([optimizer.dynamic_scale.numpy()], np.float32),
                                        f"mpscale.{communication}"),
                "nonfinite_counted": int(optimizer.nonfinite_steps.numpy()) - nonfinite,
                "iterations_counted": int(optimizer.iterations.numpy()) - iterations,
            }
            last = model.fit(x_mine, y_mine, batch_size=16, epochs=epochs - epochs // 2, verbose=0).history["loss"]
            _, accuracy = model.evaluate(x_test, y_test, verbose=0)
            state = np.concatenate([np.asarray(v, np.float64).ravel() for v in optimizer.variables])
            runs[communication] = {
                "spread_before": spread_before, "spread": _spread(flat(), f"mp.{communication}"),
                "optimizer_spread": _spread(state, f"mpopt.{communication}"),
                "accuracy": float(accuracy), "first_loss": first[0], "last_loss": last[-1], "skipped": skipped,
                "dynamic_scale": float(optimizer.dynamic_scale.numpy()),
                "is_loss_scaler": isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer),
                "compute_dtype": model.layers[0].compute_dtype, "compiled_as_given": model.optimizer is optimizer}
            print(f"keras3 mixed_float16 {communication}: test accuracy {accuracy:.4f}, {skipped}", flush=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {"keras": version, "runs": runs}


CHECKS = {"training": check_training, "keras3_fit": check_keras3_fit,
          "keras3_mixed_precision": check_keras3_mixed_precision}
