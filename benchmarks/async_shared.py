"""Shared-memory asynchronous SGD against synchronous Horovod on one node (gimpel2010
Figures 1-3 and kungurtsev2021 Figure 1 in miniature: Gimpel, Das, Smith, "Distributed
Asynchronous Online Learning for Natural Language Processing", CoNLL 2010; Kungurtsev, Egan,
Chatterjee, Alistarh, "Asynchronous Optimization Methods for Efficient Training of Deep
Neural Networks with Guarantees", AAAI 2021, arXiv 1905.11845): test accuracy against wall
time.

Five methods, the same MLP on scikit-learn's digits, the same per-rank batch, learning rate
and momentum, every rank the same number of epochs of its own shard, in one custom loop:

- `sync`: synchronous data-parallel SGD, Horovod's `hvd.DistributedGradientTape` (the
  allreduce of `hvd.DistributedOptimizer`), gradients averaged over all ranks every step;
- `asyncminibatch`: `hvdx.asynchronous.AsyncMiniBatch` (Algorithm 1, whole-vector lock);
- `assm`, `passm`, `passm+`: `hvdx.asynchronous.ASSM`, `PASSM`, `PASSMPlus` (the paper's
  schedule: ASSM for the first 25% of the epochs and 10% around the decay at 2/3).

The learning rate is multiplied by 0.1 at 2/3 of the epochs for every method. Rank 0 keeps a
copy of its model (for the asynchronous methods: the node's shared model as it last read
it) every `--eval-every` of its steps with the time since all ranks started; the copies are
evaluated after training, so evaluation costs no training time. Time to `--target` test
accuracy is read from that curve, as a ratio to `sync` in the same round (methods take turns
within each round, rotating the order). Step functions are traced before the clock starts.
Also reported: the staleness of every update (all ranks merged) and the fraction of
weight-gradient backprop flops PASSM's restricted backpropagation saves (the paper's
Appendix D count on this model).

    python benchmarks/async_shared.py                       # 1x2 and 1x4, writes README's table
    python benchmarks/async_shared.py --smoke --out /tmp/x  # 1x2, tiny: checks the script runs
    python benchmarks/async_shared.py --stem async_shared_keras3 --methods sync,assm,assm_keras3,passm,passm_keras3

A method named `<method>_keras3` is the same method around the same MLP built with Keras 3
(`import keras`, beside tf.keras as Keras 2 in the same rank processes) and stepped by a Keras 3
SGD: the methods on Keras 3 beside Keras 2 in one run.

Writes <out>/<stem>.json, <stem>.png (stem: async_shared) and the table of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (add_output_arguments, add_topology_arguments, against_baseline, freeze_start_up, keras_module,
                        markdown_table, readme_path, run_topologies, time_cells, update_readme)
except ImportError:
    from benchmarks.common import (add_output_arguments, add_topology_arguments, against_baseline, freeze_start_up,
                                   keras_module, markdown_table, readme_path, run_topologies, time_cells,
                                   update_readme)

METHODS = ["sync", "asyncminibatch", "assm", "passm", "passm+"]
LABELS = {"sync": "synchronous (hvd.DistributedGradientTape)", "asyncminibatch": "AsyncMiniBatch",
          "assm": "ASSM", "passm": "PASSM", "passm+": "PASSM+"}
LABELS.update({f"{m}_keras3": f"{LABELS[m]}, Keras 3 model and SGD" for m in METHODS if m != "sync"})


def build_model(width: int, depth: int, seed: int, keras=None):
    """The digits MLP: 64 inputs, `depth` hidden layers of `width`, 10 logits (of `keras`: None
    is tf.keras)."""
    from hvdx.zoo import mlp

    return mlp(64, (width,) * depth, seed=seed, keras=keras)


def make_method(name: str, args):
    from hvdx.asynchronous import ASSM, PASSM, AsyncMiniBatch, PASSMPlus

    name = name.removesuffix("_keras3")
    if name == "asyncminibatch":
        return AsyncMiniBatch(average_every=10 ** 9)
    if name == "assm":
        return ASSM(average_every=10 ** 9)
    if name == "passm":
        return PASSM(average_every=10 ** 9)
    return PASSMPlus(PASSMPlus.paper_schedule(args.epochs, decays=[decay_epoch(args)]), average_every=10 ** 9)


def decay_epoch(args) -> int:
    return max(1, (2 * args.epochs) // 3)


def train(name: str, args, topo, data, seed: int) -> dict:
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvdx

    keras = keras_module(3 if name.endswith("_keras3") else 2)  # Keras 2: tf.keras here (use_keras2 above)
    x_train, y_train, x_test, y_test = data
    model = build_model(args.width, args.depth, seed, keras=keras)
    opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps_per_epoch = len(x_train) // args.batch
    method = None
    if name == "sync":
        hvd.broadcast_variables(model.variables, root_rank=0)
        opt.build(model.trainable_variables)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        steps = {True: step}
    else:
        method = make_method(name, args).start(model, opt)

        def make_step():
            own = method.variables_to_train()

            @tf.function
            def step(xb, yb):
                method.step_begin_ops()            # read the shared model (AsyncMiniBatch: read back)
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True))
                opt.apply_gradients(zip(tape.gradient(loss, own), own))   # PASSM: restricted backprop
                method.push_ops(read_after=False)
            return step
        steps = {}
        for epoch in range(args.epochs):       # one traced step per phase (PASSM+ has two)
            method.set_epoch(epoch)
            if method.full_step() not in steps:
                steps[method.full_step()] = make_step()
        method.set_epoch(0)
    spec = (tf.TensorSpec([args.batch, 64], tf.float32), tf.TensorSpec([args.batch], tf.int64))
    for fn in steps.values():
        fn.get_concrete_function(*spec)        # traced before the clock starts
    rng = np.random.default_rng(seed * 1000 + topo.rank)
    snapshots = []
    hvdx.barrier()
    began = time.perf_counter()
    done = 0
    for epoch in range(args.epochs):
        if epoch == decay_epoch(args):
            opt.learning_rate.assign(args.lr * 0.1)
        full = True
        if method is not None:
            method.set_epoch(epoch)
            full = method.full_step()
        order = rng.permutation(len(x_train))
        for s in range(steps_per_epoch):
            idx = order[s * args.batch:(s + 1) * args.batch]
            steps[full](tf.constant(x_train[idx]), tf.constant(y_train[idx]))
            if method is not None:
                method.after_step()
            done += 1
            if topo.rank == 0 and done % args.eval_every == 0:
                flat = (method._pulled.numpy() if method is not None else
                        np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables]))
                snapshots.append((time.perf_counter() - began, flat))
    trained = time.perf_counter() - began
    stats = None
    if method is not None:
        method.finish()
        stats = method.stats()
    seconds = float(hvd.allreduce(tf.constant(trained, tf.float64), op=hvd.Max, name=f"bench.{name}.time"))
    every = hvd.allgather_object(stats, name=f"bench.{name}.stats")
    final = float(np.mean(np.argmax(model(x_test).numpy(), 1) == y_test))
    curve = []
    if topo.rank == 0:
        variables = model.trainable_variables
        for t, flat in snapshots:
            offset = 0
            for v in variables:
                size = int(np.prod(v.shape))
                v.assign(flat[offset:offset + size].reshape(v.shape))
                offset += size
            curve.append([t, float(np.mean(np.argmax(model(x_test).numpy(), 1) == y_test))])
    out = {"seconds": seconds, "accuracy": final, "curve": curve, "steps": done}
    if method is not None:
        from hvdx.asynchronous.staleness import merge
        out["staleness"] = merge([s["staleness"] for s in every])
    return out


def flops_saved(args, processes: int) -> Optional[float]:
    """The paper's count (Appendix D) of the weight-gradient backprop flops PASSM saves with
    `processes` processes on this model (each dense layer: 4 x in x out flops per sample)."""
    from hvdx.asynchronous import backprop_flops_saved, layer_units, partition

    model = build_model(args.width, args.depth, args.seed)
    _, units = layer_units(model)
    if len(units) < processes:
        return None
    flops = [4.0 * float(u.size) for u in units]
    return backprop_flops_saved(partition(units, processes), flops)


def run_ranks(args) -> None:
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvdx

    topo = hvdx.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                                        stratify=digits.target)
    shard = slice(topo.rank, len(x_train) - len(x_train) % topo.size, topo.size)  # equal sizes: equal steps
    data = (x_train[shard], y_train[shard].astype(np.int64), x_test, y_test)
    runs: Dict[str, list] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods):] + args.methods[:r % len(args.methods)]
        for name in order:
            runs[name].append(train(name, args, topo, data, args.seed + r if args.seeds else args.seed))
    if topo.rank == 0:
        result = {"topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size}, "runs": runs,
                  "passm_flops_saved": flops_saved(args, topo.local_size)}
        Path(args.worker_json).write_text(json.dumps(result))
    hvdx.barrier()


# -- the report ------------------------------------------------------------------------------
def time_to(curve: List[List[float]], target: float) -> Optional[float]:
    """The time at which the curve's accuracy first reaches `target` (None: never)."""
    for seconds, accuracy in curve:
        if accuracy >= target:
            return seconds
    return None


def summarize(result: dict, target: float) -> dict:
    runs = result["runs"]
    base = [time_to(run["curve"], target) for run in runs.get("sync", [])]
    out = {}
    for name, rounds in runs.items():
        times = [time_to(run["curve"], target) for run in rounds]
        versus = against_baseline(times, base)
        out[name] = {"time_to_target": times, "ratio_to_sync": versus["ratios"],
                     "median_ratio": versus["median_ratio"], "mean_time": versus["mean_time"],
                     "mean_ratio": versus["mean_ratio"],
                     "accuracy": [run["accuracy"] for run in rounds],
                     "seconds": [run["seconds"] for run in rounds],
                     "staleness": rounds[0].get("staleness")}
    return out


def report(args, results: List[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "results": results},
        indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        for name in args.methods:
            curve = result["runs"][name][0]["curve"]
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=LABELS[name])
        ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"1 node x {result['topology']['ranks_per_node']} processes")
        ax.set_xlabel("wall time since all ranks started (s)")
        ax.set_ylabel("test accuracy (rank 0's model)")
        ax.set_ylim(max(0.0, args.target - 0.3), 1.0)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.stem}.png", dpi=100)
    rows = []
    for result in results:
        p = result["topology"]["ranks_per_node"]
        for name in args.methods:
            s = result["summary"][name]
            time, ratio = time_cells(s["time_to_target"], {**s, "ratios": s["ratio_to_sync"]}, args.seeds)
            average = statistics.mean if args.seeds else statistics.median
            st = s["staleness"]
            stale = "-" if not st else f"{st['mean']:.2f} / {st['max']}"
            saved = result["passm_flops_saved"] if name in ("passm", "passm_keras3") and result["passm_flops_saved"] \
                else None
            rows.append([f"1x{p}", LABELS[name], time, ratio,
                         f"{average(s['accuracy']):.4f}", f"{average(s['seconds']):.2f}", stale,
                         f"{saved:.2f}" if saved is not None else "-", f"{result['load_average'][0]:.1f}"])
    readme = readme_path(args)
    if readme is None:
        return
    title = "" if args.stem == "async_shared" else f" --stem {args.stem}: the methods on Keras 3 beside Keras 2"
    body = (f"## async_shared.py{title}: shared-memory asynchronous SGD against synchronous Horovod "
            f"(gimpel2010 Figs. 1-3, kungurtsev2021 Fig. 1)\n\n"
            f"One node (horovodrun over loopback), an MLP ({args.depth}x{args.width}) on the digits, batch "
            f"{args.batch} per process, SGD lr {args.lr} momentum {args.momentum} (x0.1 at epoch "
            f"{decay_epoch(args)}), {args.epochs} epochs of each process's shard, {args.rounds} round(s) with "
            f"the methods taking turns"
            + (f", round r from seed {args.seed} + r (initial weights and batch order)" if args.seeds else "")
            + f". Time to a test accuracy of {args.target} on rank 0's model (copies taken "
            f"every {args.eval_every} steps, evaluated after training), "
            + ("the mean over the seeds, and the ratio of the mean times to synchronous SGD's (range: each seed's "
               "ratio); final accuracy and training time: means over the seeds. " if args.seeds else
               "median over rounds, and its ratio to synchronous SGD in the same round (range over rounds). ")
            + "Final accuracy: the model every rank holds at the end. "
            f"Staleness: mean / max number of other updates applied between a process's read and its "
            f"update, all processes. PASSM flops saved: fraction of the weight-gradient backprop flops saved per "
            f"step by restricted backpropagation (the paper's Appendix D count). "
            f"`results/{args.stem}.json`, `results/{args.stem}.png`.\n\n"
            + markdown_table(["topology", "method", "time to target (s)", "ratio to sync", "final accuracy",
                              "training time (s)", "staleness mean / max", "PASSM flops saved", "load avg"], rows,
                             text_columns=2))
    update_readme(args.stem, body, readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_topology_arguments(parser, topologies="1x2,1x4")
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","),
                        help=f"of {', '.join(LABELS)}")
    parser.add_argument("--stem", default="async_shared", help="the results' file names and README section")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (PASSM needs layers >= processes - 1)")
    parser.add_argument("--batch", type=int, default=16, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--eval-every", type=int, default=10, help="rank 0's steps between model copies")
    parser.add_argument("--target", type=float, default=0.94,
                        help="test accuracy the time is measured to (PASSM alone ends near 0.96 on this task)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", action="store_true",
                        help="round r starts from seed --seed + r (initial weights, batch order) instead of --seed")
    parser.add_argument("--smoke", action="store_true", help="1x2, tiny: checks the script runs")
    add_output_arguments(parser, readme=None)
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in LABELS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {sorted(LABELS)}")
    raw = list(sys.argv[1:] if argv is None else argv)
    if args.smoke and not args.worker_json:
        args.topologies, args.width, args.epochs, args.rounds, args.target, args.eval_every = "1x2", 32, 2, 1, 0.3, 5
        raw += ["--topologies", "1x2", "--width", "32", "--epochs", "2", "--rounds", "1", "--target", "0.3",
                "--eval-every", "5"]
    if args.worker_json:
        freeze_start_up()
        run_ranks(args)
        return
    args.local = True   # one node: horovodrun over loopback
    if "sync" not in args.methods:
        raise SystemExit("--methods must include sync: every time is a ratio to it")
    results = []
    for result in run_topologies(__file__, args, [a for a in raw if a != "--smoke"] + ["--local"]):
        result["summary"] = summarize(result, args.target)
        results.append(result)
    report(args, results)
    print(json.dumps([{"topology": r["topology"], "passm_flops_saved": r["passm_flops_saved"],
                       **{m: {k: v for k, v in r["summary"][m].items() if k in ("median_ratio", "accuracy")}
                          for m in r["summary"]}} for r in results], indent=1))


if __name__ == "__main__":
    main()
