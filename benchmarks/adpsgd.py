"""AD-PSGD against AllReduce-SGD and D-PSGD (lian2018 Figures 3-6 in miniature: Lian, Zhang,
Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018,
arXiv 1710.06952): training loss against wall time.

Three methods, the same MLP on scikit-learn's digits, the same per-rank batch and learning
rate, the same samples in total (`--epochs` of the training set, counted over all ranks), in
one custom loop:

- `allreduce`: AllReduce-SGD, Horovod's `hvd.DistributedGradientTape` (the allreduce of
  `hvd.DistributedOptimizer`), gradients averaged over all ranks every step;
- `dpsgd`: D-PSGD, the same gossip as AD-PSGD but synchronous: after its step each rank waits
  for its exchange and then for every rank (a one-element Horovod allreduce);
- `adpsgd`: `hvdx.adpsgd.ADPSGD` on the exponential graph, nobody waits; the epochs are
  counted over all ranks (`step_budget`, lian2018's setting): each rank cycles its shard until
  the ranks together ran the steps the synchronous methods run, so with a slowed rank the
  fast ranks do its share.

Scenarios: `homogeneous`; `slow_rank`: the last rank sleeps (factor - 1) x AllReduce-SGD's
homogeneous step time (computation and allreduce, measured first) after every step: it takes
factor (4) times as long per step as the others; `slow_link` (emulated cluster
only): the last node's uplink is re-shaped to `--slow-rate` (100 Mbit/s) for the run. Methods take turns within each
round. Step 0 (which traces the step function) is not timed. Rank 0 (never the slowed one) evaluates its model's loss on a fixed training subset
after every `--eval-every` steps, the clock stopped meanwhile; time to `--target` loss is
read from that curve, as ratios to AllReduce-SGD in the same round. Final accuracy: the
test accuracy of the model every rank holds at the end (AD-PSGD/D-PSGD: the average).

    python benchmarks/adpsgd.py                 # emulated cluster, 2x2 and 4x1, 1 Gbit/s (root)
    python benchmarks/adpsgd.py --local         # horovodrun over loopback (no slow_link scenario)
    python benchmarks/adpsgd.py --smoke --out /tmp/x   # 2x1 over loopback, tiny, no README

Inside and across nodes (`--stem adpsgd_nodes --methods allreduce,adpsgd,adpsgd_intra,adpsgd_inter
--topologies 2x2`): the same AD-PSGD with `cross_node_weight` 1 (uniform), 0.25 (a neighbour on
another node four times less likely) and 4.

On Keras 3 beside Keras 2 (`--stem adpsgd_keras3 --methods allreduce,adpsgd,adpsgd_keras3`):
`adpsgd_keras3` is the same AD-PSGD around the same MLP built with Keras 3 (`import keras`,
beside tf.keras as Keras 2 in the same rank processes) and stepped by a Keras 3 SGD.

Writes <out>/<stem>.json, <stem>.png (stem: adpsgd) and the table of benchmarks/README.md.
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
    from common import (add_output_arguments, add_topology_arguments, against_baseline, cluster_description,
                        digits_shards, freeze_start_up, keras_module, markdown_table, readme_path, run_topologies,
                        time_cells, update_readme)
except ImportError:
    from benchmarks.common import (add_output_arguments, add_topology_arguments, against_baseline, cluster_description,
                                   digits_shards, freeze_start_up, keras_module, markdown_table, readme_path,
                                   run_topologies, time_cells, update_readme)

METHODS = ["allreduce", "dpsgd", "adpsgd"]
LABELS = {"allreduce": "AllReduce-SGD (hvd.DistributedGradientTape)", "dpsgd": "D-PSGD (gossip + barrier)",
          "adpsgd": "AD-PSGD (hvdx.adpsgd)",
          "adpsgd_intra": "AD-PSGD, cross_node_weight=0.25 (mostly inside nodes)",
          "adpsgd_inter": "AD-PSGD, cross_node_weight=4 (mostly across nodes)",
          "adpsgd_keras3": "AD-PSGD (hvdx.adpsgd), Keras 3 model and SGD"}
# The gossip methods: (synchronous, cross_node_weight); `--stem adpsgd_nodes` compares the weights.
GOSSIP = {"dpsgd": (True, 1.0), "adpsgd": (False, 1.0), "adpsgd_intra": (False, 0.25), "adpsgd_inter": (False, 4.0),
          "adpsgd_keras3": (False, 1.0)}
SCENARIOS = ["homogeneous", "slow_rank", "slow_link"]


def shape_node_link(rate_bps: int) -> None:
    """Re-shapes this node's uplink (eth0 of its namespace, tbf as hvdx/runner/shaping.py
    sets it without netem) to `rate_bps`: run by one rank of the node, inside the emulated
    cluster only. The node's downlink, shaped in the switch's namespace, keeps its rate."""
    import subprocess

    burst = max(rate_bps // 8 // 1000, 64 * 1024 + 2 * 1500)
    limit = max(rate_bps // 8 // 50, 4 * burst)
    subprocess.run(["tc", "qdisc", "change", "dev", "eth0", "root", "handle", "1:", "tbf", "rate", str(rate_bps),
                    "burst", str(burst), "limit", str(limit)], check=True)


# -- the ranks -------------------------------------------------------------------------------
def build_model(width: int, seed: int, keras=None):
    """The digits MLP 64-width-width-10 (of `keras`: None is tf.keras)."""
    from hvdx.zoo import mlp

    return mlp(64, (width, width), seed=seed, keras=keras)


def train(method: str, scenario: str, args, topo, data, step_seconds: float, round_index: int) -> dict:
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    from hvdx.adpsgd import ADPSGD

    keras = keras_module(3 if method.endswith("_keras3") else 2)  # Keras 2: tf.keras here (use_keras2 above)
    x_mine, y_mine, x_eval, y_eval, x_test, y_test = data
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build_model(args.width, args.seed + round_index if args.seeds else args.seed, keras=keras)
    opt = keras.optimizers.SGD(args.lr)
    opt.build(model.trainable_variables)
    gossip = None
    steps = args.epochs * max(1, len(x_mine) // args.batch)  # the synchronous methods' steps on every rank
    budget = int(hvd.allreduce(tf.constant([steps], tf.int64), op=hvd.Sum,
                               name=f"adpsgd.bench.budget.{method}.{scenario}.{round_index}").numpy()[0])
    if method == "allreduce":
        for v in model.variables:  # the same start everywhere (as BroadcastGlobalVariables)
            v.assign(hvd.broadcast(v, 0, name=f"adpsgd.bench.bcast.{v.name}"))
    else:
        synchronous, cross_node_weight = GOSSIP[method]
        gossip = ADPSGD(model.trainable_variables, topology="exponential", timeout=120,
                        name=f"adpsgd.bench.{method}.{scenario}.{round_index}",
                        step_budget=None if synchronous else budget, cross_node_weight=cross_node_weight).start()

    @tf.function
    def local_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def allreduce_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    step_fn = allreduce_step if method == "allreduce" else local_step
    cluster = cluster_description()
    shaping = scenario == "slow_link" and topo.node == topo.num_nodes - 1 and topo.local_rank == 0
    if shaping:
        shape_node_link(parse_rate(args.slow_rate))
    hvd.allreduce(tf.zeros([1]), name="adpsgd.bench.shaped")
    sleep = (args.slow_factor - 1) * step_seconds if scenario == "slow_rank" and topo.rank == topo.size - 1 else 0.0
    rng = np.random.default_rng(args.seed + 100 * topo.rank + round_index)
    curve: List[List[float]] = []
    clock = 0.0

    def evaluate() -> None:
        if topo.rank == 0:
            curve.append([clock, float(loss_fn(y_eval, model(x_eval, training=False)))])

    k = 0

    def more() -> bool:
        if method in GOSSIP and not GOSSIP[method][0]:  # until the ranks together ran the budget (steps 0 and 1 on every rank:
            return k < 2 or not gossip.done  # step 1 meets every rank)
        return k < steps

    while more():
        if k == 1:  # step 0 traced the step function: the clock starts after it, for every method
            hvd.allreduce(tf.zeros([1]), name="adpsgd.bench.traced")
            evaluate()
        began = time.perf_counter()
        pick = rng.choice(len(x_mine), args.batch, replace=False)
        step_fn(tf.constant(x_mine[pick]), tf.constant(y_mine[pick]))
        if gossip is not None:
            gossip.step()
            if method == "dpsgd":  # synchronous: this rank's exchange done, then every rank's
                while not gossip.gossip.idle():
                    time.sleep(0.0002)
                hvd.allreduce(tf.zeros([1]), name="adpsgd.bench.barrier")
        if sleep:
            time.sleep(sleep)
        if k > 0:
            clock += time.perf_counter() - began
        k += 1
        if k % args.eval_every == 0:
            evaluate()
    if k % args.eval_every:
        evaluate()
    exchanges = gossip.stats()["exchanges"] if gossip is not None else 0
    cross_share, spread = None, None
    if gossip is not None:
        # rank 0's exchanges with another node, and how far the models drifted apart before the
        # final average: max over ranks of ||x_i - mean|| / ||mean|| (one allreduce, one allgather)
        partners = gossip.stats()["partners"]
        mine = set(topo.node_ranks[topo.node])
        cross_share = sum(n for p, n in partners.items() if int(p) not in mine) / max(1, sum(partners.values()))
        flat = gossip.gossip.model().astype(np.float64)
        mean = hvd.allreduce(tf.constant(flat), op=hvd.Average, name=f"adpsgd.bench.mean.{method}").numpy()
        spread = float(np.max(hvd.allgather(tf.constant([np.linalg.norm(flat - mean) / np.linalg.norm(mean)]),
                                            name=f"adpsgd.bench.spread.{method}").numpy()))
        gossip.finish()
    if shaping:
        shape_node_link(cluster["rate_bps"])
    hvd.allreduce(tf.zeros([1]), name="adpsgd.bench.unshaped")
    accuracy = float(tf.reduce_mean(tf.cast(tf.equal(tf.argmax(model(x_test, training=False), axis=1),
                                                     tf.cast(y_test, tf.int64)), tf.float32)))
    seconds = hvd.allgather(tf.constant([clock], tf.float64), name=f"adpsgd.bench.clock.{method}").numpy().tolist()
    rank_steps = hvd.allgather(tf.constant([k], tf.int64), name=f"adpsgd.bench.steps.{method}").numpy().tolist()
    return {"curve": curve, "accuracy": accuracy, "train_seconds": seconds, "steps": k, "exchanges": exchanges,
            "rank_steps": rank_steps, "budget": budget, "cross_node_share": cross_share, "spread": spread}


def parse_rate(text: str) -> int:
    """tc's rate syntax ("100mbit", "1gbit") in bits per second."""
    units = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "bit": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    raise ValueError(f"rate {text!r}: give e.g. 100mbit")


def run_ranks(args) -> None:
    import tensorflow as tf

    import hvdx

    topo = hvdx.init()
    x_shard, y_shard, x_train, y_train, x_test, y_test = digits_shards(topo.rank, topo.size)
    data = (x_shard, y_shard, x_train[:512], y_train[:512], x_test, y_test)
    # AllReduce-SGD's step (computation and allreduce), homogeneous: the slowed rank takes
    # slow_factor times as long per step (measured once, then the same for all rounds)
    import horovod.tensorflow as hvd

    model = build_model(args.width, args.seed)
    opt = tf.keras.optimizers.SGD(args.lr)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    xb, yb = tf.constant(x_train[:args.batch]), tf.constant(y_train[:args.batch])
    times = []
    for _ in range(30):
        began = time.perf_counter()
        step(xb, yb)
        times.append(time.perf_counter() - began)
    step_seconds = max(hvd.allgather(tf.constant([statistics.median(times[5:])], tf.float64),
                                     name="adpsgd.bench.step_seconds").numpy().tolist())
    runs: Dict[str, Dict[str, list]] = {s: {m: [] for m in args.methods} for s in args.scenarios}
    for r in range(args.rounds):
        for scenario in args.scenarios:
            order = args.methods[r % len(args.methods):] + args.methods[:r % len(args.methods)]
            for method in order:
                runs[scenario][method].append(train(method, scenario, args, topo, data, step_seconds, r))
    if topo.rank == 0:
        result = {"topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
                  "step_seconds": step_seconds, "runs": runs, "cluster": cluster_description()}
        Path(args.worker_json).write_text(json.dumps(result))
    hvdx.barrier()


# -- the report ------------------------------------------------------------------------------
def time_to(curve: List[List[float]], target: float) -> Optional[float]:
    """The training time at which the curve's loss first reaches `target` (None: never)."""
    for seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def summarize(result: dict, target: float) -> dict:
    out: dict = {}
    for scenario, methods in result["runs"].items():
        base = [time_to(run["curve"], target) for run in methods.get("allreduce", [])]
        out[scenario] = {}
        for method, runs in methods.items():
            times = [time_to(run["curve"], target) for run in runs]
            versus = against_baseline(times, base)
            out[scenario][method] = {
                "time_to_target": times,
                "ratio_to_allreduce": versus["ratios"],
                "median_ratio": versus["median_ratio"],
                "mean_time": versus["mean_time"],
                "mean_ratio": versus["mean_ratio"],
                "accuracy": [run["accuracy"] for run in runs],
                "final_loss": [run["curve"][-1][1] for run in runs],
                "exchanges": [run["exchanges"] for run in runs]}
    return out


def report(args, results: List[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                               for k, v in vars(args).items()},
                                                      "results": results}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), len(args.scenarios), figsize=(5 * len(args.scenarios), 3.6 * len(results)),
                             squeeze=False)
    for row, result in zip(axes, results):
        topo = f"{result['topology']['nodes']}x{result['topology']['ranks_per_node']}"
        for ax, scenario in zip(row, args.scenarios):
            for method in args.methods:
                curve = result["runs"][scenario][method][0]["curve"]
                ax.plot([c[0] for c in curve], [c[1] for c in curve], label=LABELS[method])
            ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"{topo}, {scenario.replace('_', ' ')}")
            ax.set_xlabel("training time of rank 0 (s)")
            ax.set_ylabel("training loss (rank 0's model)")
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.stem}.png", dpi=100)
    rows = []
    for result in results:
        topo = f"{result['topology']['nodes']}x{result['topology']['ranks_per_node']}"
        for scenario in args.scenarios:
            for method in args.methods:
                s = result["summary"][scenario][method]
                time, ratio = time_cells(s["time_to_target"], {**s, "ratios": s["ratio_to_allreduce"]}, args.seeds)
                average = statistics.mean if args.seeds else statistics.median
                runs = result["runs"][scenario][method]
                per_step = statistics.median(run["exchanges"] / run["steps"] for run in runs)
                cross = [run["cross_node_share"] for run in runs if run.get("cross_node_share") is not None]
                spread = [run["spread"] for run in runs if run.get("spread") is not None]
                rank_steps = "/".join(str(n) for n in runs[0].get("rank_steps", [runs[0]["steps"]]))
                rows.append([topo, scenario.replace("_", " "), LABELS[method],
                             time, ratio, f"{average(s['accuracy']):.4f}",
                             "-" if method == "allreduce" else f"{per_step:.2f}",
                             f"{statistics.median(cross):.2f}" if cross else "-",
                             f"{statistics.median(spread):.2g}" if spread else "-", rank_steps,
                             f"{result['load_average'][0]:.1f}"])
    readme = readme_path(args)
    if readme is None:
        return
    where = (f"on the emulated cluster of `hvdx/runner/cluster.py` ({args.rate} between nodes, tbf-shaped)"
             if not args.local else "over loopback (horovodrun, no slow links)")
    title = ("adpsgd.py: AD-PSGD against AllReduce-SGD and D-PSGD (lian2018 Figs. 3-6)" if args.stem == "adpsgd" else
             f"adpsgd.py --stem {args.stem}: {', '.join(LABELS[m] for m in args.methods)}")
    body = (f"## {title}\n\n"
            f"An MLP ({args.width}x{args.width}) on the digits, batch {args.batch} per rank, SGD lr {args.lr}, "
            f"{args.epochs} epochs of the training set counted over all ranks (AllReduce-SGD, D-PSGD: every rank "
            f"the same steps; AD-PSGD: a budget of the same total steps, the fast ranks doing a slow rank's share), "
            f"{args.rounds} round(s) with the methods taking turns"
            + (f", round r from seed {args.seed} + r (initial weights and batch order)" if args.seeds else "")
            + f", {where}. Time to a training loss of {args.target} on rank 0's model (clock stopped while it "
            + ("evaluates), the mean over the seeds, and the ratio of the mean times to AllReduce-SGD's (range: "
               "each seed's ratio); final accuracy the mean over the seeds; " if args.seeds else
               "evaluates), median over rounds, and its ratio to AllReduce-SGD in the same round (range over "
               "rounds); ")
            + f"`slow rank`: the last rank sleeps {args.slow_factor - 1:g}x AllReduce-SGD's homogeneous step "
            f"(computation and allreduce, measured on each topology: `step_seconds` in the JSON) after "
            f"every step; `slow link`: the last node's uplink at {args.slow_rate}. Final accuracy: the test accuracy of the model every rank holds at the end. "
            f"Averagings per step: the exchanges rank 0 took part in over its steps (Algorithm 1 averages once per "
            f"step; fewer means the gossip did not keep up with the computation and the ranks trained mostly alone). "
            f"Across nodes: the share of rank 0's exchanges made with a rank of another node. Spread: how far the "
            f"models drifted apart before the final average, max over ranks of ||x_i - mean|| / ||mean||. "
            f"Steps per rank: rank 0 / 1 / ... in the first round. "
            f"`results/{args.stem}.json`, `results/{args.stem}.png`.\n\n"
            + markdown_table(["topology", "scenario", "method", "time to target (s)", "ratio to AllReduce",
                              "final accuracy", "rank 0's averagings per step", "across nodes", "spread",
                              "steps per rank", "load avg"], rows, text_columns=3))
    update_readme(args.stem, body, readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_topology_arguments(parser, topologies="2x2,4x1")
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), type=lambda s: s.split(","))
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between rank 0's loss evaluations")
    parser.add_argument("--slow-factor", type=float, default=4.0)
    parser.add_argument("--slow-rate", default="100mbit", help="the last node's uplink in the slow_link scenario")
    parser.add_argument("--target", type=float, default=0.25, help="training loss the time is measured to")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", action="store_true",
                        help="round r from seed --seed + r (the initial weights; batches differ per round anyway); "
                        "the table then gives means over the seeds")
    parser.add_argument("--smoke", action="store_true", help="2x1 over loopback, tiny: checks the script runs")
    parser.add_argument("--stem", default="adpsgd", help="the results' file names and README section (adpsgd_nodes: "
                        "the cross_node_weight comparison, --methods allreduce,adpsgd,adpsgd_intra,adpsgd_inter)")
    add_output_arguments(parser, readme=None)
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in LABELS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {sorted(LABELS)}")
    if args.smoke and not args.worker_json:
        args.local, args.topologies, args.width, args.epochs, args.rounds, args.target = True, "2x1", 32, 2, 1, 2.2
        argv_out = sys.argv[1:] + ["--local", "--topologies", "2x1", "--width", "32", "--epochs", "2", "--rounds", "1",
                                   "--target", "2.2"]
    else:
        argv_out = sys.argv[1:]
    if args.worker_json:
        freeze_start_up()
        run_ranks(args)
        return
    if args.local and "slow_link" in args.scenarios:
        args.scenarios = [s for s in args.scenarios if s != "slow_link"]  # no link to slow down over loopback
        argv_out += ["--scenarios", ",".join(args.scenarios)]
    results = []
    for result in run_topologies(__file__, args, argv_out):
        result["summary"] = summarize(result, args.target)
        results.append(result)
    report(args, results)
    print(json.dumps([{"topology": r["topology"], **{s: {m: {k: v for k, v in r["summary"][s][m].items()
                                                            if k in ("median_ratio", "accuracy")}
                                                        for m in r["summary"][s]} for s in r["summary"]}}
                      for r in results], indent=1))


if __name__ == "__main__":
    main()
