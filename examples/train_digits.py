"""hvdx's demo job: data-parallel training of a small Keras model on scikit-learn's bundled
digits with hvdx.DistributedOptimizer, across the nodes and ranks of a topology. Written for
Keras 3 (TensorFlow 2.16+'s own); it runs as it is with Keras 2 (TF_USE_LEGACY_KERAS=1, or
TensorFlow 2.15, where `import keras` is Keras 2).

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/train_digits.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/train_digits.py

(2 emulated nodes x 2 ranks, then 1 node x 4 ranks under Open MPI, on this machine; other
launchers: docs/launching.md; `make demo` runs examples/dawnbench.py.) Each rank
trains on its shard; gradients are aggregated with HiTopKComm (shi2021 Algorithm 2) at
density 0.01 by default. At the end the job prints the test accuracy and the per-step
communication time of the model's gradient buffer with the chosen strategy and with a
dense allreduce, measured in the same run.
"""
from __future__ import annotations

import argparse
import hashlib
import time

import statistics

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdx
from sklearn.model_selection import train_test_split


def shard(x: np.ndarray, y: np.ndarray, rank: int, size: int):
    """Every size-th example from `rank`, cut to the same length on every rank, so that
    every rank runs the same number of steps (and collectives) per epoch."""
    per_rank = len(x) // size
    return x[rank::size][:per_rank], y[rank::size][:per_rank]


def build_model(seed: int) -> keras.Model:
    """64 inputs -> 64 ReLU units -> 10 logits, the same initial weights on every rank."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--communication", default="hitopk",
                        help="hitopk (default), hierarchical, sparse_allgather or allreduce")
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()

    topo = hvdx.init()
    views = hvd.allgather_object(str(topo), name="demo.topology")
    if topo.rank == 0:
        print(f"hvdx topology: {topo.num_nodes} node(s) x {topo.local_size} rank(s)", flush=True)
        for view in views:
            print("  " + view, flush=True)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=args.seed, stratify=digits.target)
    x_mine, y_mine = shard(x_train, y_train, topo.rank, topo.size)

    model = build_model(args.seed)
    optimizer = hvdx.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * topo.size, momentum=0.9),
        communication=args.communication,
        **({"density": args.density} if args.communication in ("hitopk", "sparse_allgather") else {}))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    model.fit(x_mine, y_mine, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
              callbacks=[hvdx.callbacks.BroadcastGlobalVariablesCallback(0)])
    elapsed = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    # Every rank holds the same weights, so every rank measures the same accuracy.
    accuracies = hvd.allgather_object(round(float(accuracy), 6), name="demo.accuracy")
    # ... and bit for bit the same weights: a digest of every weight, compared across ranks.
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
    digests = hvd.allgather_object(digest, name="demo.weights")

    # Per-step communication time of this model's fused gradient buffer (every rank calls).
    d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    buffer = tf.random.stateless_normal([d], seed=[topo.rank, 0])
    times = {}
    for label, strategy in ((args.communication, optimizer.communication),
                            ("allreduce", hvdx.comm.Allreduce())):
        samples = []
        for step in range(25):
            start_step = time.perf_counter()
            strategy(buffer, name="demo_timing")
            samples.append(time.perf_counter() - start_step)
        times[label] = statistics.median(samples[5:])
    if topo.rank == 0:
        assert len(set(accuracies)) == 1, f"ranks disagree after training: {accuracies}"
        assert len(set(digests)) == 1, f"ranks hold different weights after training: {digests}"
        print(f"trained {args.epochs} epochs on {len(x_train)} digits over {topo.size} ranks with "
              f"{optimizer.communication!r} in {elapsed:.1f} s: test accuracy {accuracy:.4f}, "
              f"loss {loss:.4f}", flush=True)
        print(f"communication per step for the {d}-element gradient buffer (median of 20): "
              + ", ".join(f"{label} {seconds * 1e3:.2f} ms" for label, seconds in times.items()),
              flush=True)
        print(f"weights agree on all {topo.size} ranks: sha256 {digest} (Keras {keras.__version__})", flush=True)
    hvdx.barrier()


if __name__ == "__main__":
    main()
