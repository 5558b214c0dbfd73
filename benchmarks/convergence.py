"""Convergence: accuracy at equal steps, and time to a target accuracy, of dense and sparse
aggregation with and without Deep Gradient Compression's aids (issue 21).

Three tasks, each trained by every method from the same initial weights on the same
batches (scikit-learn's digits; nothing is downloaded):

- `mnist`: Horovod's TF2 Keras MNIST example model (two convolutions, dropout, Adam at
  0.001 x ranks) on the digits upscaled to 28x28 as tests/upstream does;
- `resnet`: a small ResNet (3 basic blocks) on the 8x8 digits, momentum SGD;
- `mlp`: the communication-bound MLP of benchmarks/train_step.py (1024-4096-4096-10 at
  --mlp-scale 1) on the digits upscaled to 32x32, momentum SGD.

`--optimizer lars` / `lamb` trains every task with hvdx's LARS (momentum 0.9, trust ratio
clipped to 1, rate and trust coefficient per task: LARS_OPTIONS) or LAMB (LAMB_OPTIONS) instead
of the task's own optimizer ("task": Adam for mnist, momentum SGD for the others).

Methods: `horovod` (hvd.DistributedOptimizer), `allreduce` (hvdx, dense), `hitopk`
(density --density, no aid given, i.e. hvdx's defaults), and `hitopk+AID+...` with AIDs
`plain` (every aid off), `mc` (momentum correction with factor masking), `clip` (local
clipping at --clip-norm), `warmup` (density warm-up from 25 % over --warmup-steps),
`dense` (the warm-up starts dense: warmup_density=1), `decay` (residual decay 0.9), `lt`
(LARS' trust ratio applied to each rank's gradient before the strategy: local_trust_ratio,
with the norm of the ranks' average gradient, sketched), `ltr` (the same with each rank's own
norm: trust_norms="rank"),
`layer` (one bucket per gradient, bucket_bytes=1: the density applies to each layer),
`small` (gradients of fewer than --dense-below elements sent whole: dense_below), `nomask`
(momentum correction without DGC's momentum factor masking: momentum_masking=False).
The compressors beside top-k (issue 66), at their defaults: `powersgd` (rank 4), `lowbit`
(8 bits), `lowbit4` (4 bits).
The local methods (issue 68), each rank stepping its task's optimizer alone between
synchronisations of --sync-every steps: `localsgd` (hvdx.localsgd.LocalSGD: DiLoCo, blocking,
float32; DiLoCo's outer Nesterov step given explicitly, here and in every method but the
`_avg` ones), `localsgd_avg` (the same with outer SGD at rate 1 and no momentum: the outer step is
the ranks' average, Local SGD's model averaging), `streaming`
(hvdx.streaming_diloco.StreamingDiLoCo: --fragments fragments, one step of overlap, float32
across nodes), `streaming8`, `streaming4` (8- and 4-bit outer gradients), `streaming4_avg`
(4-bit with `localsgd_avg`'s outer SGD at rate 1); `daso`
(hvdx.DASO over the task's optimizer: node-local gradient averaging every step, global
parameter averaging blocking in the first and last chunk and every B steps, overlapped, in
between) and `adpsgd` (hvdx.adpsgd.ADPSGD on the exponential graph, the ranks' models
averaged at each evaluation). Each evaluation ends one of the methods' epochs
(`begin_epoch` / `end_epoch`: DASO drains, AD-PSGD averages, inside the timed part). Their
accuracy is the anchor's for LocalSGD and streaming DiLoCo (the global model every rank holds
the same, DiLoCo's outer model), rank 0's model for DASO and AD-PSGD (the same on every rank
after the epoch's end), taken outside the timed part; a chunk's time includes the wait for the
exchanges still in flight at its end, so no exchange hides in an evaluation.
`--seeds N` repeats everything with N seeds (--seed, --seed + 1, ...): the table gives the
mean and the range of the final accuracy. `--lr-warmup-steps N` ramps every method's learning
rate as Horovod's `LearningRateWarmupCallback` does (from rate / ranks to the rate over N
steps, then constant), as Horovod's Keras MNIST example runs; `--lr-decay-power P` then decays
it as LARS' recipe does (to 0 at --steps, ((S - step) / (S - W))^P). `--loop tape` trains as
Horovod's custom-loop example (examples/tensorflow2/tensorflow2_mnist.py) does instead of
`Model.fit`: a `tf.function` step, the tape wrapped by `hvd.DistributedGradientTape`
(Horovod) or `hvdx.DistributedGradientTape(tape, **options)` (hvdx's methods), the inner
optimizer applying the gradients, and the variables broadcast after the first step.
The methods take turns: every --eval-every steps each method trains that many steps, then
its test accuracy is taken (outside the timed part), so a slow spell of the machine hits
all of them alike. Wall times are only results when the machine runs nothing else.
`--keras 2,3` (issue 64) runs every method but `horovod` (Keras 2 only) also on the task's
model built with Keras 3 (`import keras`: its layers and optimizer, `hvdx.DistributedOptimizer`'s
Keras 3 path, the local methods on Keras 3 variables, hvdx's Keras 3 LARS / LAMB,
`jit_compile=False`), as "METHOD@keras3", taking turns with the others; the report adds each
HiTopK method's final accuracy against `allreduce` of the same Keras.

    python benchmarks/convergence.py                       # the emulated cluster, 2x2, 1 Gbit/s (root)
    python benchmarks/convergence.py --local --tasks mnist # loopback horovodrun
    python benchmarks/convergence.py --smoke               # seconds: tiny models, few steps
    python benchmarks/convergence.py --keras 2,3 --methods allreduce,hitopk --seeds 5 --name convergence_keras3

Writes benchmarks/results/<name>.json and <name>.png (--name, default convergence: accuracy
vs steps and vs wall time) and its section of benchmarks/README.md (<name> with - for _).
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import contextlib
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

try:
    import common
except ImportError:  # imported as benchmarks.convergence
    from benchmarks import common

README = common.README

TASKS = ("mnist", "resnet", "mlp")
#: The methods compared on each task by default.
METHODS = {
    "mnist": ["horovod", "allreduce", "hitopk+plain", "hitopk+warmup", "hitopk+dense", "hitopk+decay",
              "hitopk"],
    "resnet": ["horovod", "allreduce", "hitopk+plain", "hitopk+mc", "hitopk+clip", "hitopk+warmup",
               "hitopk+mc+clip+warmup", "hitopk"],
    "mlp": ["horovod", "allreduce", "hitopk+plain", "hitopk+mc", "hitopk+clip", "hitopk+warmup",
            "hitopk+mc+clip+warmup", "hitopk"],
}
#: Target test accuracy for the time-to-accuracy column.
TARGETS = {"mnist": 0.90, "resnet": 0.90, "mlp": 0.90}
DEFAULT_NAME = "convergence"
#: Issue 64's goal: a HiTopK method's mean final accuracy at most this many points under
#: `allreduce`'s (the dense step) of the same Keras.
POINTS_TO_ALLREDUCE = 1.0


# -- data and models -------------------------------------------------------------------------
def digits(task: str):
    """(x_train, y_train, x_test, y_test) of the task, float32 in [0, 1], 75/25 split."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images / 16.0
    if task == "mnist":  # as tests/upstream/digits_as_mnist.py: 3x3 blocks, 2 pixels of border
        images = np.pad(np.kron(images, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))[..., None]
    elif task == "mlp":  # 4x4 blocks: 32x32 = the MLP's 1024 inputs
        images = np.kron(images, np.ones((4, 4))).reshape(len(images), -1)
    else:
        images = images[..., None]
    cut = len(images) * 3 // 4
    x, y = images.astype("float32"), data.target.astype("int64")
    return x[:cut], y[:cut], x[cut:], y[cut:]


def build_model(task: str, args: argparse.Namespace, keras=None):
    """The task's model, built with `keras` (None: tf.keras, Keras 2 here; `keras`: Keras 3)."""
    import tensorflow as tf

    from hvdx import zoo

    keras = keras or tf.keras
    layers = keras.layers
    if task == "mnist":  # Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py
        width = 0.25 if args.smoke else 1.0
        return zoo.cnn((28, 28, 1), (int(32 * width), int(64 * width)), pool_after=(1,), dropout=0.25,
                       head="flatten", dense=(int(128 * width),), dense_dropout=0.5, output_activation="softmax",
                       keras=keras)
    if task == "resnet":
        # Not zoo.resnet: a biased stem and biased 1x1 projections (built before the block), neither
        # batch-normalized; the model of the published rows.
        def block(x, filters, stride):
            shortcut = x if stride == 1 and x.shape[-1] == filters else layers.Conv2D(filters, 1, stride)(x)
            y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x)
            y = layers.Activation("relu")(layers.BatchNormalization()(y))
            y = layers.BatchNormalization()(layers.Conv2D(filters, 3, padding="same", use_bias=False)(y))
            return layers.Activation("relu")(layers.Add()([shortcut, y]))

        inputs = keras.Input((8, 8, 1))
        x = layers.Conv2D(16, 3, padding="same")(inputs)
        x = block(block(x, 16, 1), 16, 1)
        x = block(x, 32, 2)
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(10, activation="softmax")(x), name="resnet")
    width = max(4, int(4096 * (0.01 if args.smoke else args.mlp_scale)))  # train_step.py's MLP: 4096 at scale 1
    return zoo.mlp(1024, (width, width), output_activation="softmax", name="mlp", keras=keras)


#: LARS / LAMB with --optimizer, at a constant rate, every layer adapted, biases and
#: batch-norm parameters without weight decay. LARS' rate and trust coefficient per task, from
#: a scan on one rank (batch 128, 200 steps): on the small ResNet a larger step (0.5, 0.01)
#: trained but left batch norm's moving statistics behind (test accuracy 0.1-0.8 where the
#: training batches gave 0.93), so it runs with SGD's rate, the trust ratio clipped to 1.
_LARS_COMMON = dict(momentum=0.9, weight_decay=5e-5, max_trust_ratio=1.0,
                    exclude_from_weight_decay=["bias", "batch_normalization"], exclude_from_layer_adaptation=[])
LARS_OPTIONS = {"resnet": dict(_LARS_COMMON, learning_rate=0.1, eeta=0.1),
                "mlp": dict(_LARS_COMMON, learning_rate=0.5, eeta=0.01),
                "mnist": dict(_LARS_COMMON, learning_rate=0.5, eeta=0.01)}
LAMB_OPTIONS = dict(learning_rate=0.01, weight_decay=1e-4, exclude_from_weight_decay=["bias", "batch_normalization"])
OPTIMIZERS = ("task", "lars", "lamb")


def inner_optimizer(task: str, size: int, optimizer: str = "task", keras=None):
    """The optimizer a task trains with: its own ("task": Adam for mnist, momentum SGD for
    the others, rates scaled by the ranks as Horovod's examples; `keras`'s, None: tf.keras),
    or hvdx's LARS or LAMB of that Keras."""
    import tensorflow as tf

    from hvdx.legacy_keras import is_keras3_object

    keras = keras or tf.keras
    if optimizer in ("lars", "lamb"):
        if is_keras3_object(keras.optimizers.SGD()):  # Keras 3's: hvdx's Keras 3 classes
            from hvdx.optimizers import keras3 as layerwise
        else:
            from hvdx.optimizers import keras2 as layerwise
        if optimizer == "lars":
            return layerwise.LARS(**LARS_OPTIONS[task])
        return layerwise.LAMB(**LAMB_OPTIONS)
    if optimizer != "task":
        raise ValueError(f"unknown optimizer {optimizer!r} (one of {OPTIMIZERS})")
    if task == "mnist":
        return keras.optimizers.Adam(0.001 * size)  # Horovod's example: lr scaled by the ranks
    return keras.optimizers.SGD(0.025 * size, momentum=0.9)


#: The local methods: their class's keywords beside --sync-every (and --fragments); DASO and
#: AD-PSGD take theirs in `local_method`.
LOCAL_METHODS = {"localsgd": {}, "localsgd_avg": {}, "streaming": {"overlap": 1},
                 "streaming8": {"overlap": 1, "bits": 8}, "streaming4": {"overlap": 1, "bits": 4},
                 "streaming4_avg": {"overlap": 1, "bits": 4}, "daso": {}, "adpsgd": {}}


def local_method(method: str, args: argparse.Namespace, optimizer: Any = None, chunks: int = 1):
    """The TrainingMethod of a local method's name (LOCAL_METHODS), not started. `optimizer`:
    the task's (DASO wraps it, and is the model's optimizer); `chunks`: the evaluations of
    the run, DASO's epochs (one blocking, the cycling ones, one blocking)."""
    if method == "daso":
        from hvdx.daso import DASO

        return DASO(optimizer, total_epochs=max(3, chunks), warmup_epochs=1, cooldown_epochs=1)
    if method == "adpsgd":
        from hvdx.adpsgd import ADPSGD

        # the average of every rank's model at each evaluation (what ADPSGDCallback's
        # average_every_epoch gives a user), counted in the training time
        return ADPSGD(topology="exponential", average_every_epoch=True, timeout=300.0,
                      name=f"conv.adpsgd.{args.seed}")
    import tensorflow as tf

    # *_avg: the outer step is the ranks' average itself (outer SGD at rate 1, no momentum:
    # Local SGD's model averaging); otherwise DiLoCo's Nesterov 0.7 / 0.9, given explicitly
    # (the library's default over the tasks' momentum SGD is the average)
    outer = (tf.keras.optimizers.SGD(1.0) if method.endswith("_avg")
             else tf.keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True))
    if method in ("localsgd", "localsgd_avg"):
        from hvdx.localsgd import LocalSGD

        return LocalSGD(sync_every=args.sync_every, outer_optimizer=outer, sync_every_epoch=False)
    from hvdx.streaming_diloco import StreamingDiLoCo

    return StreamingDiLoCo(sync_every=args.sync_every, outer_optimizer=outer, fragments=args.fragments,
                           sync_every_epoch=False, **LOCAL_METHODS[method])


class AnchorView:
    """Within `with AnchorView(method):` the method's variables hold its anchor (the global
    model); its local values come back at the exit."""

    def __init__(self, method) -> None:
        self.method = method

    def __enter__(self) -> None:
        self.saved = [v.numpy() for v in self.method.variables]
        for v, a in zip(self.method.variables, self.method.anchor):
            v.assign(a)

    def __exit__(self, *exc) -> None:
        for v, value in zip(self.method.variables, self.saved):
            v.assign(value)


def method_options(method: str, task: str, args: argparse.Namespace) -> Dict[str, Any]:
    """hvdx.DistributedOptimizer's keywords for a method name (see the module docstring)."""
    base, *aids = method.split("+")
    if base in ("allreduce", "hierarchical", "powersgd", "lowbit") and not aids:
        return {"communication": base}
    if base == "lowbit4" and not aids:
        return {"communication": "lowbit", "bits": 4}
    if base not in ("hitopk", "sparse_allgather"):
        raise ValueError(f"unknown method {method!r}")
    options: Dict[str, Any] = {"communication": base, "density": args.density}
    if "plain" in aids or aids:  # every aid not named is off
        options.update(momentum_correction=False, clip_norm=None, warmup_steps=0, residual_decay=1.0,
                       local_trust_ratio=False, dense_below=0)
    for aid in aids:
        if aid == "mc":
            options["momentum_correction"] = True
        elif aid == "clip":
            options["clip_norm"] = args.clip_norm
        elif aid in ("warmup", "dense"):
            options["warmup_steps"] = args.warmup_steps or max(1, args.steps // 5)
            if aid == "dense":
                options["warmup_density"] = 1.0
        elif aid == "decay":
            options["residual_decay"] = 0.9
        elif aid in ("lt", "ltr"):
            options["local_trust_ratio"] = True
            if aid == "ltr":
                options["trust_norms"] = "rank"
        elif aid == "layer":  # one bucket per gradient: the density (top-k) applies to each layer
            options["bucket_bytes"] = 1
        elif aid == "small":  # gradients below --dense-below elements sent whole
            options["dense_below"] = args.dense_below
        elif aid == "nomask":  # the velocity of the entries sent is kept (DGC masks it)
            options["momentum_masking"] = False
        elif aid != "plain":
            raise ValueError(f"unknown aid {aid!r} in {method!r} (mc, clip, warmup, dense, decay, lt, ltr, layer, "
                             "small, nomask, plain)")
    return options


def warmed_rate(rate: float, step: int, warmup_steps: int, size: int) -> float:
    """Horovod's `LearningRateWarmupCallback`: rate / size * (t (size - 1) + 1) at the fraction
    t = step / warmup_steps of the warm-up, then `rate`."""
    if step >= warmup_steps:
        return rate
    return rate / size * (step / warmup_steps * (size - 1) + 1)


def scheduled_rate(rate: float, step: int, args: argparse.Namespace, size: int) -> float:
    """The rate at `step` of --steps: Horovod's warm-up over --lr-warmup-steps (`warmed_rate`),
    then with --lr-decay-power p > 0 the polynomial decay of LARS' recipe (You et al. 2017;
    hvdx.phases.PhaseSchedule, the DAWNBench recipe's): rate ((S - step) / (S - W))^p, to 0
    at step S = --steps; p = 0: constant."""
    warm = args.lr_warmup_steps
    if step < warm or not args.lr_decay_power:
        return warmed_rate(rate, step, warm, size)
    return rate * max(0.0, (args.steps - step) / max(1, args.steps - warm)) ** args.lr_decay_power


# -- the ranks -------------------------------------------------------------------------------
def tape_step(model, optimizer, options: Optional[Dict[str, Any]], keras=None):
    """Horovod's custom-loop training step (tensorflow2_mnist.py): `step(images, labels,
    first_batch)` -> loss; `options` None: Horovod's tape, else hvdx's with these keywords;
    `keras`: the model's Keras module (None: tf.keras)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdx

    loss_fn = (keras or tf.keras).losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape) if options is None else hvdx.DistributedGradientTape(tape, **options)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvdx.broadcast_variables(model.variables, root_rank=0)
            hvdx.broadcast_variables(optimizer.variables() if callable(optimizer.variables) else optimizer.variables,
                                     root_rank=0)
        return loss
    return step


def run_task(task: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Every method of the task, taking turns every --eval-every steps. Returns per method
    the steps, test accuracies and cumulative training seconds (slowest rank) of each eval."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import numpy as np
    import tensorflow as tf

    import hvdx

    x_train, y_train, x_test, y_test = digits(task)
    mine = np.arange(hvd.rank(), len(x_train), hvd.size())
    runs: Dict[str, Dict[str, Any]] = {}
    chunks = -(-(args.steps - 1) // args.eval_every)  # the evaluations after the first step
    for key in common.keras_keys(args.methods or METHODS[task], getattr(args, "keras", (2,))):
        method, version = common.split_keras(key)
        keras = common.keras_module(version)  # Keras 2 (tf.keras here) or Keras 3
        keras.utils.set_random_seed(args.seed)  # the same initial weights (of one Keras) and batches for every method
        model = build_model(task, args, keras)
        inner = inner_optimizer(task, hvd.size(), args.optimizer, keras)
        local = local_method(method, args, inner, chunks) if method in LOCAL_METHODS else None
        if method == "horovod":
            optimizer = hvd_keras.DistributedOptimizer(inner)
        elif local is not None:  # DASO is the model's optimizer; the others step the task's
            optimizer, options = (local if method == "daso" else inner), {}
        else:
            options = method_options(method, task, args)
            if not hasattr(inner, "momentum"):
                options.pop("momentum_correction", None)
            if type(inner).__name__ != "LARS":
                options.pop("local_trust_ratio", None)
            optimizer = hvdx.DistributedOptimizer(inner, **options)
        data = tf.data.Dataset.from_tensor_slices((x_train[mine], y_train[mine])).repeat().shuffle(
            2048, seed=args.seed).batch(args.batch)
        tape = args.loop == "tape"  # the tape's loop: the model compiled only for evaluate
        if tape and local is not None:
            raise ValueError(f"--loop tape runs the synchronous methods; {method} trains through Model.fit's step")
        model.compile(optimizer=inner if tape else optimizer, loss=keras.losses.SparseCategoricalCrossentropy(),
                      metrics=["accuracy"], **({"jit_compile": False} if version == 3 else {}))
        if tape:
            iterator = iter(data)
            hvdx.barrier()
            train = tape_step(model, inner, None if method == "horovod" else options, keras)
            train(*next(iterator), True)  # the first step, then the broadcast
        else:
            # Horovod's callback (Keras 2); hvdx.keras's hands a Keras 3 model to its Keras 3 counterpart
            callbacks = hvd_keras.callbacks if version == 2 else importlib.import_module("hvdx.keras").callbacks
            hvdx.barrier()
            model.fit(data, steps_per_epoch=1, epochs=1, verbose=0,  # builds and broadcasts the initial state
                      callbacks=[callbacks.BroadcastGlobalVariablesCallback(0)])
            model.make_train_function()  # Keras 3's returns None: both set model.train_function
            iterator, train = iter(data), model.train_function
            if local is not None:
                local.start(model, inner)  # collective: rank 0's model, the anchor, the transport
                if method == "daso":
                    local.after_step()  # the build step's synchronisation (DASO needs one after every step)
        # the optimizer whose rate --lr-warmup-steps ramps: the one that applies the gradients
        runs[key] = {"model": model, "iterator": iterator, "train": train,
                     "optimizer": inner if tape else model.optimizer,
                     "local": local, "steps": [], "accuracy": [], "seconds": [], "clock": 0.0, "done": 1,
                     "rate": float(np.asarray(inner.learning_rate))}
    for chunk in range(chunks):
        for method, run in runs.items():
            n = min(args.eval_every, args.steps - run["done"])
            hvdx.barrier()
            start = time.perf_counter()
            if run["local"] is not None and run["local"].begin_epoch(chunk):  # a chunk is an epoch
                run["model"].make_train_function(force=True)
                run["train"] = run["model"].train_function
            for i in range(n):
                if args.lr_warmup_steps or args.lr_decay_power:
                    run["optimizer"].learning_rate.assign(
                        scheduled_rate(run["rate"], run["done"] + i, args, hvd.size()))
                if args.loop == "tape":
                    logs = {"loss": run["train"](*next(run["iterator"]), False)}
                else:
                    logs = run["train"](run["iterator"])
                if run["local"] is not None:
                    run["local"].after_step()
            loss = float(logs["loss"])  # waits for the last step
            if run["local"] is not None:  # and for the exchanges in flight (applied at their step)
                for item in getattr(run["local"], "inflight", ()):
                    item.future.result()
                run["local"].end_epoch(chunk, {"loss": loss})  # DASO drains, AD-PSGD averages
            run["clock"] += common.slowest(time.perf_counter() - start, f"conv.{task}.{method}.{args.seed}.{chunk}")
            run["done"] += n
            anchored = getattr(run["local"], "anchor", None) is not None  # LocalSGD, streaming DiLoCo
            with (AnchorView(run["local"]) if anchored else contextlib.nullcontext()):
                _, accuracy = run["model"].evaluate(x_test, y_test, batch_size=256, verbose=0)
            run["steps"].append(run["done"])
            run["accuracy"].append(float(accuracy))
            run["seconds"].append(run["clock"])
            if hvd.rank() == 0:
                print(f"{task} {method} seed {args.seed}: step {run['done']} test accuracy {accuracy:.3f} "
                      f"({run['clock']:.1f} s training)", flush=True)
    out = {}
    for method, run in runs.items():
        out[method] = {k: run[k] for k in ("steps", "accuracy", "seconds")}
        if run["local"] is not None:
            out[method]["stats"] = run["local"].stats()  # rank 0's: bytes sent, the wait the overlap left
            run["local"].finish()  # collective: one model on every rank
            run["local"].close()
    return out


def run_ranks(args: argparse.Namespace) -> None:
    import horovod.tensorflow as hvd

    import hvdx

    topo = hvdx.init()
    first = args.seed
    by_seed = {}
    for seed in range(first, first + args.seeds):
        args.seed = seed
        by_seed[str(seed)] = {task: run_task(task, args) for task in args.tasks}
    args.seed = first
    if hvd.rank() == 0:
        Path(args.worker_json).write_text(json.dumps({
            "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
            "network": common.cluster_description(), "tasks": mean_curves(by_seed), "by_seed": by_seed},
            indent=1))
    hvdx.barrier()


def mean_curves(by_seed: Dict[str, Dict[str, Dict[str, dict]]]) -> Dict[str, Dict[str, dict]]:
    """Per task and method, the curves averaged over the seeds (every seed evaluates at the
    same steps): accuracy and seconds at each evaluation."""
    runs = list(by_seed.values())
    out: Dict[str, Dict[str, dict]] = {}
    for task, methods in runs[0].items():
        out[task] = {}
        for method, run in methods.items():
            curves = [r[task][method] for r in runs]
            out[task][method] = {"steps": run["steps"], **{
                key: [sum(c[key][i] for c in curves) / len(curves) for i in range(len(run["steps"]))]
                for key in ("accuracy", "seconds")}}
    return out


def seed_spread(by_seed: Dict[str, Dict[str, Dict[str, dict]]],
                targets: Optional[Mapping[str, float]] = None) -> Dict[str, Dict[str, dict]]:
    """Per task and method, the final test accuracy of each seed, their mean, min and max,
    and the mean's gap to Horovod's mean (points); with `targets`, each seed's seconds to
    its task's target (None where not reached), their mean over the seeds that reached it,
    and Horovod's mean over this method's (the speed-up, over the seeds both reached)."""
    runs = list(by_seed.values())
    out: Dict[str, Dict[str, dict]] = {}
    for task, methods in runs[0].items():
        out[task] = {}
        for method in methods:
            finals = [r[task][method]["accuracy"][-1] for r in runs]
            out[task][method] = {"final": finals, "mean": sum(finals) / len(finals), "min": min(finals),
                                 "max": max(finals)}
            if targets is not None:
                out[task][method]["seconds_to_target"] = [_seconds_to(r[task][method], targets[task]) for r in runs]
        reference = out[task].get("horovod", {})
        for spread in out[task].values():
            spread["gap_points"] = (None if "mean" not in reference
                                    else round(100 * (spread["mean"] - reference["mean"]), 2))
            if targets is None:
                continue
            reached = [s for s in spread["seconds_to_target"] if s is not None]
            spread["mean_seconds_to_target"] = sum(reached) / len(reached) if reached else None
            both = [(h, s) for h, s in zip(reference.get("seconds_to_target", []), spread["seconds_to_target"])
                    if h is not None and s is not None]
            spread["speedup_vs_horovod"] = (sum(h for h, _ in both) / sum(s for _, s in both)) if both else None
    return out


def _reached(run: dict, target: float) -> Optional[int]:
    """The index of the run's first evaluation at or above `target`; None if none is."""
    return next((i for i, a in enumerate(run["accuracy"]) if a >= target), None)


def _seconds_to(run: dict, target: float) -> Optional[float]:
    """The training seconds at the first evaluation at or above `target`; None if none is."""
    reached = _reached(run, target)
    return None if reached is None else run["seconds"][reached]


# -- the summary -------------------------------------------------------------------------------
def summarize(tasks: Dict[str, Dict[str, dict]], targets: Dict[str, float]) -> Dict[str, Dict[str, dict]]:
    """Per task and method: final accuracy, its gap to Horovod's (points), the best
    accuracy, the seconds per step and the seconds (and steps) to reach the target."""
    out: Dict[str, Dict[str, dict]] = {}
    for task, methods in tasks.items():
        reference = methods.get("horovod", {}).get("accuracy", [None])[-1]
        out[task] = {}
        for method, run in methods.items():
            final = run["accuracy"][-1]
            reached = _reached(run, targets[task])
            out[task][method] = {
                "final_accuracy": final,
                "gap_points": None if reference is None else round(100 * (final - reference), 2),
                "best_accuracy": max(run["accuracy"]),
                "seconds_per_step": run["seconds"][-1] / max(1, run["steps"][-1] - 1),
                "target": targets[task],
                "steps_to_target": None if reached is None else run["steps"][reached],
                "seconds_to_target": None if reached is None else run["seconds"][reached],
            }
    return out


def table(summary: Dict[str, Dict[str, dict]], steps: int, spread: Optional[Dict[str, Dict[str, dict]]] = None) -> str:
    """The Markdown table; with `spread` (several seeds) the final accuracy is the seeds' mean
    with its range, the gap is the means', the seconds to target the mean of the seeds that
    reached it (how many, and Horovod's mean over this method's), the other columns are of
    the mean curves."""
    rows = []
    for task, methods in summary.items():
        for method, s in methods.items():
            if spread is not None and len(spread[task][method]["final"]) > 1:
                r = spread[task][method]
                rows.append([task, method, f"{r['mean']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
                             "" if r["gap_points"] is None else f"{r['gap_points']:+.1f}", f"{s['best_accuracy']:.3f}",
                             "-" if s["steps_to_target"] is None else s["steps_to_target"],
                             _seeds_to_target(r) if "seconds_to_target" in r else
                             "-" if s["seconds_to_target"] is None else f"{s['seconds_to_target']:.1f}",
                             f"{1000 * s['seconds_per_step']:.0f}"])
                continue
            rows.append([task, method, f"{s['final_accuracy']:.3f}",
                         "" if s["gap_points"] is None else f"{s['gap_points']:+.1f}", f"{s['best_accuracy']:.3f}",
                         "-" if s["steps_to_target"] is None else s["steps_to_target"],
                         "-" if s["seconds_to_target"] is None else f"{s['seconds_to_target']:.1f}",
                         f"{1000 * s['seconds_per_step']:.0f}"])
    return common.markdown_table(["task", "method", f"test acc. after {steps} steps", "vs Horovod (points)",
                                  "best", "steps to target", "s to target", "ms/step"], rows, text_columns=2)


def against_allreduce(spread: Dict[str, Dict[str, dict]]) -> List[dict]:
    """Issue 64's goal: per task, Keras and HiTopK method ("hitopk", "hitopk+...", with or
    without "@keras3"), its final accuracy over the seeds (mean, min, max) against `allreduce`'s
    of the same Keras: the gap of the means (points) and whether it is at most
    POINTS_TO_ALLREDUCE under allreduce's ("met")."""
    rows = []
    for task, methods in spread.items():
        for key, r in methods.items():
            method, version = common.split_keras(key)
            dense = methods.get(common.keras_keys(["allreduce"], [version])[0])
            if not method.startswith("hitopk") or dense is None:
                continue
            gap = 100 * (r["mean"] - dense["mean"])
            rows.append({"task": task, "keras": version, "method": method, "seeds": len(r["final"]),
                         "mean": r["mean"], "min": r["min"], "max": r["max"], "allreduce_mean": dense["mean"],
                         "allreduce_min": dense["min"], "allreduce_max": dense["max"], "gap_points": round(gap, 2),
                         "met": gap >= -POINTS_TO_ALLREDUCE})
    return sorted(rows, key=lambda row: (row["task"], row["keras"]))


def allreduce_table(rows: List[dict]) -> str:
    """`against_allreduce`'s rows as a Markdown table."""
    return common.markdown_table(
        ["task", "Keras", "method", "seeds", "final test acc., mean (min-max)", "allreduce's (same Keras)",
         "vs allreduce (points)", f"within {POINTS_TO_ALLREDUCE:g} point"],
        [[r["task"], str(r["keras"]), r["method"], r["seeds"], f"{r['mean']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
          f"{r['allreduce_mean']:.3f} ({r['allreduce_min']:.3f}-{r['allreduce_max']:.3f})", f"{r['gap_points']:+.1f}",
          "yes" if r["met"] else f"no: {-r['gap_points'] - POINTS_TO_ALLREDUCE:.1f} points short"] for r in rows],
        text_columns=3)


def _seeds_to_target(spread: dict) -> str:
    """'mean s (reached/seeds, speed-up vs Horovod)' of a method's seconds to target."""
    if spread["mean_seconds_to_target"] is None:
        return "-"
    seeds = spread["seconds_to_target"]
    reached = sum(s is not None for s in seeds)
    speedup = spread.get("speedup_vs_horovod")
    return (f"{spread['mean_seconds_to_target']:.1f} ({reached}/{len(seeds)}"
            f"{'' if speedup is None else f', {speedup:.2f}x'})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 8), squeeze=False)
    for col, (task, methods) in enumerate(tasks.items()):
        for method, run in methods.items():
            axes[0][col].plot(run["steps"], run["accuracy"], label=method)
            axes[1][col].plot(run["seconds"], run["accuracy"], label=method)
        axes[0][col].set(title=f"{task}: accuracy vs steps", xlabel="step", ylabel="test accuracy")
        axes[1][col].set(title=f"{task}: accuracy vs wall time", xlabel="training seconds", ylabel="test accuracy")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def report(args: argparse.Namespace, result: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    readme = common.readme_path(args)
    versus = result.get("vs_allreduce") or []
    if readme is not None:
        network = result.get("network") or {}
        body = (f"`python benchmarks/convergence.py {' '.join(sys.argv[1:])}`: "
                f"{result['topology']['nodes']}x{result['topology']['ranks_per_node']} ranks, "
                f"{'emulated cluster at ' + str(network.get('rate')) if network else 'loopback'}, "
                f"batch {args.batch} per rank, density {args.density}, optimizer {args.optimizer}, "
                f"{args.seeds} seed(s), load average "
                f"{result['load_average'][0]:.1f} -> {result['load_average'][1]:.1f}.\n\n"
                + table(result["summary"], args.steps, result.get("seeds")))
        if versus and args.keras != [2]:
            verdicts = "; ".join(f"{r['task']} Keras {r['keras']} {r['method']} {r['gap_points']:+.1f} ("
                                 + ("met" if r["met"] else "missed") + ")" for r in versus)
            body += ("\n\n**HiTopK against the dense step (hvdx `allreduce`) of the same Keras, mean final accuracy "
                     f"over {args.seeds} seed(s) (goal: at most {POINTS_TO_ALLREDUCE:g} point under): {verdicts}.**"
                     "\n\n" + allreduce_table(versus))
        common.update_readme(args.name.replace("_", "-"), body, readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_topology_arguments(parser, topologies="2x2")
    parser.add_argument("--tasks", default=",".join(TASKS), type=lambda s: s.split(","))
    parser.add_argument("--methods", default=None, type=lambda s: s.split(","),
                        help="comma-separated methods (default: each task's list, METHODS)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--clip-norm", type=float, default=5.0)
    parser.add_argument("--dense-below", type=int, default=1024, help="the `small` aid's dense_below (elements)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="density warm-up steps (0: steps / 5)")
    parser.add_argument("--mlp-scale", type=float, default=0.5, help="width of the MLP (1: train_step.py's)")
    parser.add_argument("--lr-warmup-steps", type=int, default=0,
                        help="Horovod's LearningRateWarmupCallback over this many steps (0: none)")
    parser.add_argument("--lr-decay-power", type=float, default=0.0,
                        help="after the warm-up, polynomial decay of this power to 0 at --steps (0: constant)")
    parser.add_argument("--sync-every", type=int, default=10,
                        help="the local methods' steps between two synchronisations (of one fragment)")
    parser.add_argument("--fragments", type=int, default=2, help="streaming DiLoCo's fragments")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds (--seed, --seed + 1, ...)")
    parser.add_argument("--loop", default="fit", choices=("fit", "tape"),
                        help="fit: Model.fit's train function; tape: Horovod's custom-loop example")
    parser.add_argument("--optimizer", default="task", choices=OPTIMIZERS,
                        help="task: each task's own (Adam, momentum SGD); lars, lamb: hvdx's")
    parser.add_argument("--smoke", action="store_true", help="tiny models, few steps (tests)")
    common.add_keras_argument(parser)
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help="results' stem (<out>/<name>.json, .png) and README section (with - for _)")
    common.add_output_arguments(parser, readme=None)
    args = parser.parse_args(argv)
    if args.smoke and not args.worker_json:
        args.steps, args.eval_every = min(args.steps, 6), min(args.eval_every, 3)
    if args.worker_json:
        if 3 in args.keras:
            common.keras_module(3)  # imported before freeze_start_up's gc.freeze, as tf.keras is
        common.freeze_start_up()
        run_ranks(args)
        return
    worker_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if args.smoke:
        worker_argv += ["--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    result = next(iter(common.run_topologies(__file__, args, worker_argv)))
    result["summary"] = summarize(result["tasks"], TARGETS)
    result["seeds"] = seed_spread(result["by_seed"], TARGETS)
    result["vs_allreduce"] = against_allreduce(result["seeds"])
    result["arguments"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report(args, result)
    print(table(result["summary"], args.steps, result["seeds"]))
    if result["vs_allreduce"]:
        print(allreduce_table(result["vs_allreduce"]))


if __name__ == "__main__":
    main()
