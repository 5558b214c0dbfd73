"""DASO vs Horovod (coquelin2021, Figures 6-9 in miniature): time to a target accuracy.

The same model, data and hyper-parameters trained with Model.fit twice per repeat, the
methods taking turns: Horovod's `hvd.DistributedOptimizer` (gradients averaged over all
ranks every step) and `hvdx.DASO` (node-local averaging every step; global parameter
averaging blocking in the warm-up and cool-down epochs, every B steps and overlapped in
between). A wide MLP on scikit-learn's digits, so that a step's communication (the
parameters' size over the slow links) outweighs its computation, as for the paper's
ResNet-50 on 1 Gbit/s-class links.

    python benchmarks/daso.py                 # emulated cluster, 2x2 and 2x1, 1 Gbit/s (root)
    python benchmarks/daso.py --local         # horovodrun over loopback (no slow links)
    python benchmarks/daso.py --methods horovod,daso,daso_keras3 --topologies 2x2 --name daso_keras3
                                              # DASO on Keras 3 beside Keras 2 in one run

`daso_keras3` is `hvdx.DASO` around a Keras 3 SGD training the same MLP built with Keras 3
(`import keras`, beside tf.keras as Keras 2 in the same rank processes); Horovod's Keras
wrapper has no Keras 3 path, so the baseline stays Horovod's on Keras 2.

Reported per topology: the training time (evaluation excluded) until the test accuracy
first reaches `--target`, the final accuracy, and where a step's time goes (Horovod's
step; DASO's blocking step, cycling step with and without an exchange in flight, the steps
that start and merge one, the epoch's drain), beside how long the exchanges took on the
wire: an exchange that spans W steps whose times do not grow is overlapped. Writes
<out>/daso.json, daso.png and the table of benchmarks/README.md.
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
    from common import (README, add_output_arguments, add_topology_arguments, cluster_description, digits_shards,
                        freeze_start_up, keras_module, markdown_table, run_topologies, update_readme)
except ImportError:
    from benchmarks.common import (README, add_output_arguments, add_topology_arguments, cluster_description,
                                   digits_shards, freeze_start_up, keras_module, markdown_table, run_topologies,
                                   update_readme)

METHODS = ["horovod", "daso"]
LABELS = {"horovod": "Horovod DistributedOptimizer", "daso": "hvdx.DASO", "daso_keras3": "hvdx.DASO (Keras 3)"}
DASO_METHODS = ("daso", "daso_keras3")
GOAL_LESS_TIME, GOAL_ACCURACY_POINTS = 0.35, 0.5
STEP_KINDS = ["blocking", "local", "in_flight", "start", "merge", "epoch_end"]
STEP_LABELS = {"blocking": "blocking global average (warm-up/cool-down)", "local": "cycling, no exchange in flight",
               "in_flight": "cycling, exchange in flight", "start": "cycling, starts an exchange",
               "merge": "cycling, merges one (eq. 1)", "epoch_end": "last step of an epoch (drain + loss)"}


# -- the ranks -------------------------------------------------------------------------------
def build_model(width: int, seed: int = 0, keras=None):
    """The digits MLP 64-width-width-10 (of `keras`: None is tf.keras)."""
    from hvdx.zoo import mlp

    return mlp(64, (width, width), seed=seed, keras=keras)


def classify_steps(history) -> List[str]:
    """The kind of each DASO step, from the actions it reported (hvdx.daso.Action)."""
    kinds, pending = [], False
    for action in history:
        if action.blocking_group is not None:
            kinds.append("blocking")
        elif action.merge_group is not None:
            kinds.append("merge")
            pending = False
        elif action.start_group is not None:
            kinds.append("start")
        else:
            kinds.append("in_flight" if pending else "local")
        if action.start_group is not None:
            pending = True
    return kinds


def train(method: str, args, topo, data) -> dict:
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    from hvdx.daso import DASO, DASOCallback

    keras = keras_module(3 if method.endswith("_keras3") else 2)  # Keras 2: tf.keras here (use_keras2 above)
    x_mine, y_mine, x_test, y_test = data
    model = build_model(args.width, seed=args.seed, keras=keras)
    inner = keras.optimizers.SGD(args.lr, momentum=0.9)
    if method == "horovod":
        opt = hvd_keras.DistributedOptimizer(inner)
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
    else:
        opt = DASO(inner, total_epochs=args.epochs, warmup_epochs=args.warmup_epochs,
                   cooldown_epochs=args.cooldown_epochs, max_global_skips=args.max_global_skips)
        callbacks = [DASOCallback()]
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    steps, epoch_seconds, accuracy = [], [], []

    class Timer(keras.callbacks.Callback):  # after DASOCallback: a step includes its synchronisation
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_start = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self.step_start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            steps.append(now - self.step_start)
            self.epoch_end = now

        def on_epoch_end(self, epoch, logs=None):
            epoch_seconds.append(self.epoch_end - self.epoch_start)
            accuracy.append(float(model.evaluate(x_test, y_test, verbose=0, batch_size=512)[1]))

    keras.utils.set_random_seed(args.seed + 1 + topo.rank)
    model.fit(x_mine, y_mine, batch_size=args.batch, epochs=args.epochs, verbose=0, shuffle=True,
              callbacks=callbacks + [Timer()])
    # the slowest rank's epoch times: the job is as fast as its slowest rank
    epoch_seconds = hvd.allreduce(tf.constant(epoch_seconds, tf.float64), op=hvd.Max,
                                  name=f"daso.bench.{method}").numpy().tolist()
    out = {"epoch_seconds": epoch_seconds, "accuracy": accuracy, "step_seconds": steps}
    if method in DASO_METHODS:
        out["step_kinds"] = classify_steps(opt.history)
        per_epoch = len(steps) // args.epochs
        for i in range(per_epoch - 1, len(steps), per_epoch):
            out["step_kinds"][i] = "epoch_end"
        stats = opt.stats
        out["exchange_seconds"] = list(stats.exchange)
        out["merge_wait_seconds"] = list(stats.merge_wait)
        out["events"] = list(opt.events)
    return out


def run_ranks(args) -> None:

    import hvdx

    topo = hvdx.init()
    x_shard, y_shard, _, _, x_test, y_test = digits_shards(topo.rank, topo.size)
    data = (x_shard, y_shard, x_test, y_test)
    runs: Dict[str, list] = {m: [] for m in args.methods}
    short = argparse.Namespace(**{**vars(args), "epochs": args.warmup_epochs + args.cooldown_epochs + 1})
    for method in args.methods:  # warm-up: TF's, Horovod's and the transport's first-use costs
        train(method, short, topo, data)
    for seed in range(args.seed, args.seed + args.seeds):  # initial weights and batch order per seed
        seeded = argparse.Namespace(**{**vars(args), "seed": seed})
        for _ in range(args.repeats):
            for method in args.methods:
                runs[method].append({**train(method, seeded, topo, data), "seed": seed})
    if topo.rank == 0:
        Path(args.worker_json).write_text(json.dumps({
            "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size}, "network": cluster_description(),
            "parameters": int(build_model(args.width).count_params()), "runs": runs}))
    hvdx.barrier()


# -- the summary -----------------------------------------------------------------------------
def time_to(run: dict, target: float) -> Optional[float]:
    """Training seconds until the test accuracy first reaches `target` (None: never)."""
    elapsed = 0.0
    for seconds, accuracy in zip(run["epoch_seconds"], run["accuracy"]):
        elapsed += seconds
        if accuracy >= target:
            return elapsed
    return None


def summarize(result: dict, target: float) -> dict:
    runs = result["runs"]
    out: dict = {}
    for method, repeats in runs.items():
        times = [time_to(r, target) for r in repeats]
        out[method] = {"time_to_target": [t for t in times], "final_accuracy": [r["accuracy"][-1] for r in repeats],
                       "total_seconds": [sum(r["epoch_seconds"]) for r in repeats],
                       "median_time_to_target": statistics.median(times) if None not in times else None,
                       "median_final_accuracy": statistics.median(r["accuracy"][-1] for r in repeats),
                       "median_total_seconds": statistics.median(sum(r["epoch_seconds"]) for r in repeats)}
    for m in out.values():  # over seeds (issue 44): means, the time only where every run reached the target
        m["mean_time_to_target"] = (statistics.mean(m["time_to_target"]) if None not in m["time_to_target"]
                                    else None)
        m["mean_final_accuracy"] = statistics.mean(m["final_accuracy"])
    for daso in (m for m in DASO_METHODS if m in runs and "horovod" in runs):
        pairs = list(zip(out["horovod"]["time_to_target"], out[daso]["time_to_target"]))
        less = [1 - d / h for h, d in pairs if h and d]
        out[daso]["less_time_to_target"] = statistics.median(less) if len(less) == len(pairs) else None
        out[daso]["less_time_per_repeat"] = less
        h, d = out["horovod"]["mean_time_to_target"], out[daso]["mean_time_to_target"]
        out[daso]["less_mean_time_to_target"] = 1 - d / h if h and d else None
        out[daso]["mean_accuracy_points_vs_horovod"] = 100 * (out[daso]["mean_final_accuracy"]
                                                              - out["horovod"]["mean_final_accuracy"])
        out[daso]["accuracy_points_vs_horovod"] = 100 * (out[daso]["median_final_accuracy"]
                                                         - out["horovod"]["median_final_accuracy"])
        daso_runs = runs[daso]
        kinds: Dict[str, List[float]] = {k: [] for k in STEP_KINDS}
        for run in daso_runs:
            for kind, seconds in zip(run["step_kinds"], run["step_seconds"]):
                kinds[kind].append(seconds)
        out[daso]["step_ms"] = {k: 1000 * statistics.median(v) for k, v in kinds.items() if v}
        out[daso]["step_counts"] = {k: len(v) // len(daso_runs) for k, v in kinds.items() if v}
        exchange = [s for run in daso_runs for s in run["exchange_seconds"]]
        waits = [s for run in daso_runs for s in run["merge_wait_seconds"]]
        out[daso]["exchange_ms"] = 1000 * statistics.median(exchange) if exchange else None
        out[daso]["merge_wait_ms"] = 1000 * statistics.median(waits) if waits else None
        out["horovod"]["step_ms"] = 1000 * statistics.median(s for run in runs["horovod"]
                                                             for s in run["step_seconds"])
    if "daso" in runs and "daso_keras3" in runs:  # the Keras 3 DASO against the Keras 2 one, same seeds
        k2, k3 = out["daso"], out["daso_keras3"]
        k3["mean_accuracy_points_vs_keras2"] = 100 * (k3["mean_final_accuracy"] - k2["mean_final_accuracy"])
        k3["mean_time_ratio_vs_keras2"] = (k3["mean_time_to_target"] / k2["mean_time_to_target"]
                                           if k2["mean_time_to_target"] and k3["mean_time_to_target"] else None)
        k3["step_ratio_vs_keras2"] = {k: k3["step_ms"][k] / k2["step_ms"][k]
                                      for k in k3.get("step_ms", {}) if k in k2.get("step_ms", {})}
    return out


def verdict(summary: dict, seeds: int = 1, daso: str = "daso") -> str:
    """The goal's sentence for `daso` (a DASO method): with one seed from the medians of the
    repeats (paired), with several from the means over every seed's runs (issue 44: gains as
    means over seeds); the Keras 3 DASO's also against the Keras 2 one where both ran."""
    summary_of = summary.get(daso, {})
    name = LABELS[daso].replace("hvdx.DASO", "DASO")
    if seeds > 1:
        less, points = summary_of.get("less_mean_time_to_target"), summary_of.get("mean_accuracy_points_vs_horovod")
    else:
        less, points = summary_of.get("less_time_to_target"), summary_of.get("accuracy_points_vs_horovod")
    if less is None:
        return f"{name}: a method never reached the target accuracy"
    text = (f"over {seeds} seeds, {name}'s mean training time to the target accuracy is {less:.0%} less than "
            "Horovod's" if seeds > 1 else
            f"{name} needs {less:.0%} less training time than Horovod to the target accuracy")
    met = less >= GOAL_LESS_TIME and points is not None and points >= -GOAL_ACCURACY_POINTS
    shortfalls = []
    if less < GOAL_LESS_TIME:
        shortfalls.append(f"{GOAL_LESS_TIME - less:.0%} short of 35%")
    if points is not None and points < -GOAL_ACCURACY_POINTS:
        shortfalls.append(f"final accuracy {points:+.2f} points, beyond the 0.5 allowed")
    mean = " (means)" if seeds > 1 else ""
    text += (f", final accuracy {points:+.2f} points{mean}: goal met" if met else ": goal missed (" +
             "; ".join(shortfalls) + ")")
    if summary_of.get("mean_accuracy_points_vs_keras2") is not None:
        ratio = summary_of.get("mean_time_ratio_vs_keras2")
        text += (f"; against DASO on Keras 2 in the same run: final accuracy "
                 f"{summary_of['mean_accuracy_points_vs_keras2']:+.2f} points, time to the target x"
                 + (f"{ratio:.2f}" if ratio is not None else " n/a"))
    return text


def plot(results: List[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results):
        topo = result["topology"]
        for method, repeats in result["runs"].items():
            for i, run in enumerate(repeats):
                elapsed, total = [], 0.0
                for seconds in run["epoch_seconds"]:
                    total += seconds
                    elapsed.append(total)
                ax.plot(elapsed, run["accuracy"], color={"horovod": "C0", "daso": "C3"}.get(method, "C2"), alpha=0.8,
                        label=LABELS[method] if i == 0 else None)
        ax.axhline(target, color="gray", linestyle=":", label=f"target {target:.0%}")
        ax.set_ylim(max(0.5, target - 0.2), 1.0)
        ax.set_xlabel("training time (s, evaluation excluded)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{topo['nodes']} nodes x {topo['ranks_per_node']} ranks")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _less(m: dict, key: str) -> str:
    """DASO's row: less time than Horovod (median of paired runs, or of the means over seeds)."""
    value = m.get("less_mean_time_to_target" if key == "mean" else "less_time_to_target")
    return f"{value:.0%}" if value is not None else ""


def report(args, results: List[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items() if k != "worker_json"},
        "goal": {"less_time": GOAL_LESS_TIME, "accuracy_points": GOAL_ACCURACY_POINTS}, "results": results},
        indent=1))
    plot(results, args.target, args.out / f"{args.name}.png")
    network = next((r["network"] for r in results if r.get("network")), None)
    where = (f"on the emulated cluster of `hvdx/runner/cluster.py` ({args.rate} between nodes, tbf-shaped)"
             if network else "over loopback (horovodrun, no slow links)")
    command = " ".join(["python benchmarks/daso.py"] + (["--local"] if args.local else []) + (
        [f"--methods {','.join(args.methods)} --topologies {args.topologies} --name {args.name}"]
        if args.name != "daso" else []))
    lines = [f"Measured by `{command}` {where}, 2 CPU cores "
             f"for all ranks. Digits, MLP 64-{args.width}-{args.width}-10 ({results[0]['parameters']:,} parameters), "
             f"per-rank batch {args.batch}, SGD lr {args.lr} momentum 0.9, {args.epochs} epochs; DASO with "
             f"{args.warmup_epochs} warm-up and {args.cooldown_epochs} cool-down epochs, max_global_skips "
             f"{args.max_global_skips}. "
             + (f"Seeds {args.seed}-{args.seed + args.seeds - 1} (initial weights and batch order), "
                f"{args.repeats} run(s) each" if args.seeds > 1 else f"{args.repeats} repeats")
             + " after a short warm-up run of each, methods taking turns; "
             f"times are the slowest rank's training time (evaluation excluded) until the test accuracy first "
             f"reaches {args.target:.0%}. Load average (1 min) when each topology started: " + ", ".join(
                 f"{r['topology']['nodes']}x{r['topology']['ranks_per_node']} {r['load_average'][0]:.1f}"
                 for r in results) + f". Plot: `results/{args.name}.png`, raw: `results/{args.name}.json`.", ""]
    rows, breakdown = [], []
    for r in results:
        name = f"{r['topology']['nodes']}x{r['topology']['ranks_per_node']}"
        s = r["summary"]
        for daso in (m for m in DASO_METHODS if m in s):
            lines.append(f"**{name}: {verdict(s, args.seeds, daso)}.**")
        key = "mean" if args.seeds > 1 else "median"
        for method in r["runs"]:
            m = s[method]
            rows.append([name, LABELS[method],
                         "never" if m[f"{key}_time_to_target"] is None else f"{m[f'{key}_time_to_target']:.1f}",
                         ", ".join("-" if t is None else f"{t:.1f}" for t in m["time_to_target"]),
                         f"{m['median_total_seconds']:.1f}", f"{100 * m[f'{key}_final_accuracy']:.2f}",
                         ", ".join(f"{100 * a:.2f}" for a in m["final_accuracy"]),
                         _less(m, key)])
        for daso in (m for m in DASO_METHODS if m in s and "step_ms" in s[m]):
            d, who = s[daso], LABELS[daso].replace("hvdx.DASO", "DASO")
            if daso == next(m for m in DASO_METHODS if m in s):
                breakdown.append([name, "Horovod: every step", "", f"{s['horovod']['step_ms']:.0f}"])
            for kind in STEP_KINDS:
                if kind in d["step_ms"]:
                    breakdown.append([name, f"{who}: {STEP_LABELS[kind]}", d["step_counts"][kind],
                                      f"{d['step_ms'][kind]:.0f}"])
            if d.get("exchange_ms") is not None:
                breakdown.append([name, f"{who}: one exchange on the wire (transport thread, overlapped)", "",
                                  f"{d['exchange_ms']:.0f}"])
                breakdown.append([name, f"{who}: merge's wait for it", "", f"{d['merge_wait_ms']:.1f}"])
    per = "per seed" if args.seeds > 1 and args.repeats == 1 else "per run"
    lines += ["", markdown_table(["ranks", "method", f"time to {args.target:.0%} (s, {key})", per, "total (s, median)",
                                  f"final accuracy (%, {key})", per, "less time than Horovod"], rows, 2), "",
              "Where a step's time goes (median ms; DASO steps counted per run):", "",
              markdown_table(["ranks", "step", "steps per run", "median ms"], breakdown, 2)]
    update_readme(args.name, "\n".join(lines).rstrip(), args.readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_topology_arguments(parser)
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","),
                        help=f"of {', '.join(LABELS)}")
    parser.add_argument("--name", default="daso", help="the results' file stem and README section")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--cooldown-epochs", type=int, default=1)
    parser.add_argument("--max-global-skips", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy the time is measured to")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds --seed .. --seed + N - 1, each --repeats runs; the table then gives means")
    add_output_arguments(parser, readme=README)
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in LABELS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {sorted(LABELS)}")
    if args.worker_json:
        freeze_start_up()
        run_ranks(args)
        return
    results = []
    for result in run_topologies(__file__, args, sys.argv[1:]):
        result["summary"] = summarize(result, args.target)
        results.append(result)
    report(args, results)
    print(json.dumps([{"topology": r["topology"], **{m: {k: v for k, v in r["summary"][m].items()
                                                         if not isinstance(v, (list, dict))}
                                                     for m in r["summary"]}} for r in results], indent=1))


if __name__ == "__main__":
    main()
