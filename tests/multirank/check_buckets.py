"""Buckets and overlap (issue: "End-to-end training step"), on every rank of an m x n job.

Run by tests/test_buckets.py through the suite (2 nodes x 2 ranks). Each check returns
what the test asserts on.
"""
import os
import re
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.zoo import mlp

SPARSE = ("hitopk", "sparse_allgather")
ALL = ("allreduce", "hierarchical") + SPARSE
SMALL_BUCKETS = 16384  # bytes: the model below then has five buckets


def communication(strategy: str):
    """What the optimizer gets for a strategy name: "hierarchical" as 2DTAR on every bucket
    (this model's buckets are all under the size rule's 4 MiB and would go flat),
    "hierarchical_sized" with the rule cutting between them (flat under 20000 bytes)."""
    if strategy == "hierarchical":
        return hvdx.comm.Hierarchical(flat_below=0)
    if strategy == "hierarchical_sized":
        return hvdx.comm.Hierarchical(flat_below=20000)
    return strategy


def model(seed: int = 0) -> tf.keras.Model:
    """Variables (kernel, bias) x 3: 2048, 32, 19200, 2400, 24000, 40 bytes."""
    return mlp(64, (8, 600), seed=seed)


def batch(rank: int, n: int = 16):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((n, 64)).astype("float32"), rng.integers(0, 10, n)


def loss_fn(net, x, y):
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, net(x), from_logits=True))


def check_plans(topo):
    """The bucket plan: variable indices per bucket, in the order buckets are aggregated."""
    net = model()
    x, y = batch(topo.rank)
    plans = {}
    for name, bucket_bytes in (("small", SMALL_BUCKETS), ("medium", 30000), ("fused", None)):
        with hvdx.DistributedGradientTape(communication="hierarchical", bucket_bytes=bucket_bytes) as tape:
            loss = loss_fn(net, x, y)
        tape.gradient(loss, net.trainable_variables)
        plans[name] = [[piece.index for piece in bucket.pieces] for bucket in tape.aggregator.last_aggregation.buckets]
    return plans


def check_bucketed_equals_fused(topo):
    """Every strategy, lossless (density 1 for the sparse ones): buckets of any size give
    the average of the ranks' gradients, as one fused buffer does. Largest deviation."""
    net = model()
    x, y = batch(topo.rank)
    with tf.GradientTape() as tape:
        loss = loss_fn(net, x, y)
    local = tape.gradient(loss, net.trainable_variables)
    want = [hvd.allreduce(g, op=hvd.Average, name=f"eq.want.{i}").numpy() for i, g in enumerate(local)]
    out = {}
    for strategy in ALL + ("hierarchical_sized",):
        density = {"density": 1.0} if strategy in SPARSE else {}
        for bucket_bytes in (None, SMALL_BUCKETS, 4096):
            aggregator = hvdx.GradientAggregator(communication(strategy), bucket_bytes=bucket_bytes, **density)
            got = aggregator(local, net.trainable_variables)
            out[f"{strategy}/{bucket_bytes}"] = max(float(np.abs(g.numpy() - w).max()) for g, w in zip(got, want))
    return out


def check_overlap_structure(topo):
    """Wait-free backpropagation (shi2021 Fig. 1): in a traced train step, the collectives of
    the first bucket (the last layer's gradients) do not wait for the first layer's
    gradient; those of the last bucket do. Returns, per strategy, whether the first
    layer's kernel gradient is an ancestor of any collective of the first and of the last
    bucket."""
    out = {}
    for strategy in ALL:
        net = model()
        x, y = batch(topo.rank)
        density = {"density": 0.1} if strategy in SPARSE else {}
        opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication=communication(strategy),
                                        bucket_bytes=SMALL_BUCKETS, **density)
        step, graph, first_kernel_grad = traced_step(net, opt)
        collectives = [op for op in graph.get_operations() if op.type.startswith("Horovod")]
        by_bucket = {}
        for op in collectives:  # the collectives of each bucket (named ..._b<bucket>...; "allreduce" hands
            for b in range(8):  # each gradient of a bucket to Horovod in its own, ..._b<bucket>_<j>)
                if re.search(rf"_b{b}(?:[._]|$)", op.name):  # ..._b<b>, ..._b<b>_..., ..._b<b>.<j>
                    by_bucket.setdefault(b, []).append(op)
        first, last = by_bucket[min(by_bucket)], by_bucket[max(by_bucket)]
        out[strategy] = {"buckets": len(by_bucket),
                         "first_waits": any(first_kernel_grad in ancestors(op) for op in first),
                         "last_waits": any(first_kernel_grad in ancestors(op) for op in last)}
        step(*batch(topo.rank))  # and it runs
    out["allreduce_one_bucket"] = _last_gradient_waits_in_one_bucket(topo)
    return out


def _last_gradient_waits_in_one_bucket(topo) -> dict:
    """"allreduce" with every gradient in one bucket (the default 32 MiB): the allreduce of
    the last layer's gradient (the first backpropagation yields) does not wait for the first
    layer's, the first layer's does: the call's progress mark gates one piece, not all."""
    step, graph, first = traced_step(model(), hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                                       communication="allreduce"))
    collectives = sorted((op for op in graph.get_operations() if op.type == "HorovodAllreduce"), key=lambda op: op.name)
    last = max(collectives, key=lambda op: int(re.search(r"[._](\d+)$", op.name).group(1)))  # ..._b0.<j>
    step(*batch(topo.rank))
    return {"collectives": len(collectives), "last_waits": first in ancestors(last),
            "any_waits": any(first in ancestors(op) for op in collectives)}


def traced_step(net, opt):
    """(the train step of `net` under `opt` as a tf.function, its traced graph, the name of the
    op that yields the first layer's kernel gradient)."""
    seen = {}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(net, x, y)
        grads = tape.gradient(loss, net.trainable_variables)
        seen["first"] = grads[0].op.name
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    graph = step.get_concrete_function(tf.TensorSpec([None, 64]), tf.TensorSpec([None], tf.int64)).graph
    return step, graph, seen["first"]


def ancestors(op) -> set:
    """Names of every op `op` depends on (data and control inputs), transitively."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


def check_error_feedback_per_bucket(topo):
    """HiTopK with five buckets in model.fit: a residual per bucket, each of its bucket's
    node slice, written by training, restored from a checkpoint; switching to 2DTAR and
    back resumes them."""
    net = model()
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), communication="hitopk",
                                    density=0.05, bucket_bytes=SMALL_BUCKETS)
    net.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch(topo.rank, 64)
    net.fit(x, y, batch_size=16, epochs=1, verbose=0)
    residuals = dict(opt.communication.variables)
    lengths = {name: int(v.shape[0]) for name, v in residuals.items()}
    written = {name: bool(np.abs(v.numpy()).sum() > 0) for name, v in residuals.items()}
    saved = {name: v.numpy().copy() for name, v in residuals.items()}
    path = tempfile.mkdtemp()
    checkpoint = tf.train.Checkpoint(model=net, optimizer=opt)
    save_path = checkpoint.save(os.path.join(path, "ckpt"))
    for v in residuals.values():
        v.assign(tf.zeros_like(v))
    checkpoint.restore(save_path).assert_consumed()
    restored = all(np.array_equal(residuals[name].numpy(), saved[name]) for name in residuals)
    opt.set_communication("hierarchical")
    net.make_train_function(force=True)  # what hvdx.callbacks.SwitchCommunication does
    net.fit(x, y, batch_size=16, epochs=1, verbose=0)
    opt.set_communication("hitopk")
    net.make_train_function(force=True)
    resumed = all(np.array_equal(opt.communication.variables[name].numpy(), saved[name]) for name in residuals)
    net.fit(x, y, batch_size=16, epochs=1, verbose=0)
    weights = np.concatenate([w.numpy().ravel() for w in net.trainable_variables])
    spread = hvd.allreduce(tf.constant(weights), op=hvd.Max, name="ef.max") - \
        hvd.allreduce(tf.constant(weights), op=hvd.Min, name="ef.min")
    sizes = [int(np.prod(v.shape)) for v in net.trainable_variables]
    return {"lengths": lengths, "written": written, "restored": restored, "resumed": resumed,
            "identical_weights": float(tf.reduce_max(tf.abs(spread))) == 0.0, "sizes": sizes,
            "local_size": topo.local_size, "local_rank": topo.local_rank}


class WithEmptyWeight(tf.keras.layers.Layer):
    """Adds the sum of a weight of no elements (0) to its input."""

    def build(self, input_shape):
        self.empty = self.add_weight(name="empty", shape=[0], initializer="zeros")

    def call(self, x):
        return x + tf.reduce_sum(self.empty)


def check_zero_size(topo):
    """Issue 27, item 10: a variable of no elements beside a normal one, on every strategy
    (density 1: the sparse ones average exactly): the tape's gradients (rank r's loss is
    (r + 1) * sum(w), so the average is mean(r + 1)), a direct call, and model.fit."""
    out = {}
    for strategy in ALL:
        density = {"density": 1.0} if strategy in SPARSE else {}
        kept, empty = tf.Variable([1.0, 2.0]), tf.Variable(tf.zeros([0]))
        with tf.GradientTape() as tape:
            loss = float(topo.rank + 1) * tf.reduce_sum(kept) + tf.reduce_sum(empty)
        grads = hvdx.DistributedGradientTape(tape, communication=strategy, **density).gradient(loss, [kept, empty])
        direct = hvdx.comm.get(strategy, **density)(tf.zeros([0]), "empty")
        tf.keras.utils.set_random_seed(0)
        net = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2), WithEmptyWeight()])
        net.compile(optimizer=hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), communication=strategy,
                                                        **density), loss="mse")
        x = np.full((8, 4), (topo.rank + 1) / 4, np.float32)
        history = net.fit(x, np.zeros((8, 2), np.float32), epochs=2, batch_size=4, verbose=0)
        out[strategy] = {"tape": [g.numpy().tolist() for g in grads], "direct": list(direct.shape),
                         "losses": history.history["loss"], "empty": list(net.layers[1].empty.shape),
                         "kernel": net.layers[0].kernel.numpy().ravel().tolist()}
    return out


CHECKS = {"zero_size": check_zero_size, "plans": check_plans, "bucketed_equals_fused": check_bucketed_equals_fused,
          "overlap_structure": check_overlap_structure, "error_feedback_per_bucket": check_error_feedback_per_bucket}
