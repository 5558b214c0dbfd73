"""Table 3 of shi2021 in miniature: training throughput (samples/s) and scaling efficiency of
Dense-SGD (allreduce), 2DTAR-SGD and MSTopK-SGD (HiTopKComm), with Horovod's own
`hvd.DistributedOptimizer` as the outside baseline, for ResNet-50 at 224 and 96 px, VGG-19
and a Transformer, on the emulated cluster (2 nodes x 2 ranks, 1 Gbit/s links).

Every configuration trains the same model (one set of weights, a Keras model per
configuration over the same layers, each compiled with its own optimizer) with `model.fit`'s
own train function on fixed random batches; the configurations take turns within each round
(a slow spell of the shared machine hits all of them alike), a time is the slowest rank's
time of `--steps` steps over `--steps`, and every figure is a median over the rounds.

Scaling efficiency (Table 3's SE) is the P-rank throughput over P times one rank's. One rank
is measured as one rank of the same job training alone (the `none` configuration: the same
steps without any communication, all ranks at once): on a cluster with a GPU per rank that
is the single-GPU throughput; on this machine, whose ranks share 2 CPU cores, a rank run
alone would get all the cores, and SE would measure core sharing rather than
communication. So SE = t(none) / t(configuration), per round, median over rounds.

    python benchmarks/throughput.py                 # the full run: 2x2 on the emulated cluster (root)
    python benchmarks/throughput.py --smoke         # tiny models, 1 round: checks that it runs
    python benchmarks/throughput.py --local         # horovodrun over loopback (no shaping)

Writes <out>/throughput.json, throughput.png and (with the default --out) the throughput
section of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (RESULTS, add_output_arguments, add_topology_arguments, cluster_description, freeze_start_up,
                        markdown_table, readme_path, run_topologies, timed_rounds, update_readme)
except ImportError:
    from benchmarks.common import (RESULTS, add_output_arguments, add_topology_arguments, cluster_description,
                                   freeze_start_up, markdown_table, readme_path, run_topologies, timed_rounds,
                                   update_readme)


@dataclass(frozen=True)
class Workload:
    """One row of Table 3: `model` at input `size` (px, or tokens per sentence for the
    Transformer) with `batch` samples per rank."""

    model: str   # resnet50 | vgg19 | transformer | tiny_cnn | tiny_transformer
    size: int
    batch: int
    paper: str   # the row of shi2021 Table 3 it stands for


#: The full run's rows. Batches are small (2 CPU cores for 4 ranks): the point is the ratio
#: of computation to communication, which a V100 at batch 256 and a quarter of a CPU core at
#: batch 2-4 both put in the range where aggregation matters. VGG-19 is Keras' VGG19 with
#: its 4096-4096-1000 classifier on 64 px inputs (49M parameters: at 224 px its 144M and
#: their optimizer state per configuration would not fit the machine's memory).
WORKLOADS: Dict[str, Workload] = {
    "resnet50_224": Workload("resnet50", 224, 2, "ResNet-50 (224*224)"),
    "resnet50_96": Workload("resnet50", 96, 4, "ResNet-50 (96*96)"),
    "vgg19": Workload("vgg19", 64, 2, "VGG-19"),
    "transformer": Workload("transformer", 64, 2, "Transformer"),
}
#: --smoke: the same rows with tiny stand-ins (seconds per step), on two models where the full
#: run builds three: what the full run does with models is still done (rows sharing a model
#: reuse its train functions at their own input size; the next model comes after a cleared
#: session; the Transformer's embedding gradients go through sparse_as_dense), and each model
#: costs a smoke run most of its CPU (building and tracing five train functions on every rank).
SMOKE_WORKLOADS: Dict[str, Workload] = {
    "resnet50_224": Workload("tiny_cnn", 24, 2, "ResNet-50 (224*224)"),
    "resnet50_96": Workload("tiny_cnn", 16, 2, "ResNet-50 (96*96)"),
    "vgg19": Workload("tiny_cnn", 32, 2, "VGG-19"),
    "transformer": Workload("tiny_transformer", 16, 2, "Transformer"),
}
#: "none": each rank trains alone (one rank's throughput, SE's denominator).
CONFIGS = ["none", "horovod", "allreduce", "hierarchical", "hitopk"]
LABELS = {"none": "each rank alone", "horovod": "Horovod DistributedOptimizer", "allreduce": "Dense (allreduce)",
          "hierarchical": "2DTAR", "hitopk": "MSTopK (HiTopK)"}
#: shi2021 Table 3 (128 V100s, 16 nodes, 25 GbE): samples/s and SE (%) per configuration.
PAPER = {
    "resnet50_224": {"allreduce": (64000, 43.5), "hierarchical": (134656, 91.4), "hitopk": (133376, 90.6)},
    "resnet50_96": {"allreduce": (113280, 20.1), "hierarchical": (313600, 56.7), "hitopk": (396800, 70.5)},
    "vgg19": {"allreduce": (17920, 25.0), "hierarchical": (47616, 66.4), "hitopk": (57600, 80.4)},
    "transformer": {"allreduce": (678, 16.5), "hierarchical": (2534, 61.6), "hitopk": (3502, 87.8)},
}
#: The issue's goal: MSTopK's throughput at least this times 2DTAR's on a communication-bound row.
GOAL = 1.25
#: A row is communication-bound when 2DTAR's step is at least this times one rank's alone.
COMM_BOUND = 1.5


# -- models -----------------------------------------------------------------------------------
def build_model(workload: Workload):
    """The workload's Keras model (random weights; the same on every rank: seeded)."""
    import tensorflow as tf

    from hvdx import zoo

    tf.keras.utils.set_random_seed(1234)
    kind, size = workload.model, workload.size
    if kind == "resnet50":  # any resolution: one model serves both ResNet-50 rows
        return zoo.resnet50(1000)
    if kind == "vgg19":
        return zoo.vgg19(1000, input_shape=(size, size, 3))
    if kind in ("transformer", "tiny_transformer"):  # embedding + 3 x (attention, feed-forward), 25.8M parameters
        from topk import transformer_model

        return transformer_model(quick=kind == "tiny_transformer")
    if kind == "tiny_cnn":
        return zoo.cnn((None, None, 3), (8, 16), strides=(1, 2), padding="same", name="tiny_cnn")
    raise ValueError(f"unknown model {kind!r}")


def random_batch(model, workload: Workload, rank: int):
    """A fixed random batch of the workload's shape for this rank: images and class labels,
    or token sentences and their next tokens."""
    import numpy as np

    rng = np.random.default_rng(rank)
    if "transformer" in workload.model:
        vocabulary = model.output_shape[-1]
        shape = (workload.batch, *model.input_shape[1:])
        return rng.integers(0, vocabulary, shape).astype("int32"), rng.integers(0, vocabulary, shape)
    classes = model.output_shape[-1]
    return (rng.standard_normal((workload.batch, workload.size, workload.size, 3)).astype("float32"),
            rng.integers(0, classes, workload.batch))


# -- the ranks ----------------------------------------------------------------------------------
def train_functions(base, args: argparse.Namespace) -> Dict[str, Callable]:
    """Per configuration, Keras' train function of a model over `base`'s layers (shared
    weights) compiled with that configuration's optimizer (benchmarks/train_step.py's)."""
    import tensorflow as tf
    from train_step import make_optimizer

    out = {}
    for key in args.configs:
        model = tf.keras.Model(base.inputs, base.outputs, name=f"{base.name}_{key}")
        model.compile(optimizer=make_optimizer(key, args),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        out[key] = model.make_train_function()
    return out


def measure(name: str, workload: Workload, base, trains: Dict[str, Callable], args: argparse.Namespace) -> dict:
    """Per round, the slowest rank's seconds per step of every configuration (turns rotate)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdx

    x, y = random_batch(base, workload, hvd.rank())
    iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())

    def steps(train: Callable, n: int) -> float:
        logs = None
        for _ in range(n):
            logs = train(iterator)
        return float(logs["loss"])  # waits for the last step

    for train in trains.values():  # warm-up: tracing at this input shape, residuals, layout checks
        steps(train, args.warmup_steps)
        hvdx.barrier()
    calls = {key: (lambda train=train: steps(train, args.steps)) for key, train in trains.items()}
    per_round: Dict[str, List[float]] = {key: [] for key in trains}
    for r, times in enumerate(timed_rounds(calls, args.rounds, f"tp.{name}", warmup=0, rotate=True)):
        for key, seconds in times.items():
            per_round[key].append(seconds / args.steps)
        if hvd.rank() == 0:
            print(f"[{name}] round {r}: " + ", ".join(f"{k} {per_round[k][-1] * 1e3:.0f} ms" for k in trains),
                  flush=True)
    return {"workload": asdict(workload), "parameters": int(base.count_params()), "rounds": per_round}


def run_ranks(args: argparse.Namespace) -> None:
    """Every rank: the workloads, grouped by model (one model, its configurations' train
    functions, then each of its rows), freeing each model before the next."""
    import gc

    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdx

    topo = hvdx.init()
    workloads = {name: args.workload_table[name] for name in args.workloads}
    results, start = {}, time.perf_counter()
    for model in dict.fromkeys(w.model for w in workloads.values()):
        rows = {name: w for name, w in workloads.items() if w.model == model}
        began = time.perf_counter()
        base = build_model(next(iter(rows.values())))
        trains = train_functions(base, args)
        for name, workload in rows.items():
            results[name] = measure(name, workload, base, trains, args)
            results[name]["seconds"] = time.perf_counter() - began  # building, tracing, warm-up, rounds
            began = time.perf_counter()
            if hvd.rank() == 0:
                print(f"[{name}] done in {results[name]['seconds']:.0f} s", flush=True)
        del base, trains
        tf.keras.backend.clear_session()
        gc.collect()
        hvdx.barrier()
    if hvd.rank() == 0:
        Path(args.worker_json).write_text(json.dumps({
            "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
            "network": cluster_description(), "seconds": time.perf_counter() - start, "workloads": results},
            indent=1))
    hvdx.barrier()


# -- the summary -------------------------------------------------------------------------------
def summarize(result: dict) -> Dict[str, dict]:
    """Per workload and configuration: samples/s over all ranks (median over rounds), SE
    (median over rounds of t(none) / t), and the medians (min, max) over rounds of the
    per-round throughput ratios to 2DTAR and to Horovod."""
    size = result["topology"]["nodes"] * result["topology"]["ranks_per_node"]
    out = {}
    for name, measured in result["workloads"].items():
        rounds, batch = measured["rounds"], measured["workload"]["batch"]
        rows = {}
        for key, times in rounds.items():
            row = {"step_seconds": statistics.median(times),
                   "samples_per_s": statistics.median(size * batch / t for t in times)}
            for ref, field in (("none", "scaling_efficiency"), ("hierarchical", "vs_2dtar"),
                               ("horovod", "vs_horovod")):
                if ref in rounds and key != ref:
                    ratios = [r / t for r, t in zip(rounds[ref], times)]
                    row[field] = statistics.median(ratios)
                    row[field + "_range"] = [min(ratios), max(ratios)]
            rows[key] = row
        out[name] = rows
    return out


def verdict(summary: Dict[str, dict]) -> dict:
    """The issue's goal: MSTopK at least GOAL x 2DTAR on a communication-bound row (2DTAR's
    step at least COMM_BOUND x a rank's alone). Per row: the ratio, how communication-bound
    it is, whether it counts; overall: met on which rows, or the best ratio and by how much
    it falls short."""
    rows = {}
    for name, s in summary.items():
        if "hitopk" not in s or "vs_2dtar" not in s["hitopk"]:
            continue
        ratio = s["hitopk"]["vs_2dtar"]
        bound = (s["hierarchical"]["step_seconds"] / s["none"]["step_seconds"]) if "none" in s else None
        rows[name] = {"mstopk_over_2dtar": ratio, "2dtar_over_alone": bound,
                      "communication_bound": bound is not None and bound >= COMM_BOUND, "met": ratio >= GOAL}
    any_bound = any(r["communication_bound"] for r in rows.values())
    bound = {n: r for n, r in rows.items() if r["communication_bound"]} or rows
    best = max(bound, key=lambda n: bound[n]["mstopk_over_2dtar"]) if bound else None
    return {"goal": GOAL, "rows": rows, "met_on": [n for n, r in bound.items() if r["met"] and any_bound],
            "best": best, "any_communication_bound": any_bound,
            "short_by": 0.0 if best is None or bound[best]["met"]
            else 1.0 - bound[best]["mstopk_over_2dtar"] / GOAL}


def verdict_text(v: dict, summary: Dict[str, dict]) -> str:
    if v["best"] is None:
        return "MSTopK and 2DTAR were not both measured."
    parts = [f"{n} {r['mstopk_over_2dtar']:.2f}x (2DTAR's step {r['2dtar_over_alone']:.1f}x a rank's alone)"
             if r["2dtar_over_alone"] is not None else f"{n} {r['mstopk_over_2dtar']:.2f}x"
             for n, r in v["rows"].items()]
    text = f"**MSTopK (HiTopK) over 2DTAR, throughput: {'; '.join(parts)}. "
    if v["met_on"]:
        return text + f"Goal (>= {GOAL}x on a communication-bound row) met on {', '.join(v['met_on'])}.**"
    best = v["best"]
    if not v["any_communication_bound"]:
        return text + (f"Goal not judged: no row was communication-bound (2DTAR's step at least {COMM_BOUND}x a "
                       "rank's alone); larger models or smaller batches would make one.**")
    s = summary[best]
    alone, hier, topk = (s[k]["step_seconds"] for k in ("none", "hierarchical", "hitopk"))
    return (text + f"Goal (>= {GOAL}x on a communication-bound row) missed by {v['short_by']:.0%} on the best "
            f"row, {best}.** There one rank alone steps in {alone * 1e3:.0f} ms; 2DTAR adds "
            f"{(hier - alone) * 1e3:.0f} ms per step and MSTopK {(topk - alone) * 1e3:.0f} ms. MSTopK's own work "
            "(the node-local reduce-scatter over TCP, MSTopK, two all-gathers, the accumulation) runs on the same "
            "2 cores as the 4 ranks' computation, where the paper's has a GPU per rank and NVLink; "
            "train_step.py's profile shows where a HiTopK step's time goes.")


def table(result: dict) -> str:
    summary = result["summary"]
    topo = result["topology"]
    size = topo["nodes"] * topo["ranks_per_node"]
    rows = []
    for name, s in summary.items():
        measured = result["workloads"][name]
        w = measured["workload"]
        for key in CONFIGS:
            if key not in s:
                continue
            row = s[key]
            paper = PAPER.get(name, {}).get(key)
            se = row.get("scaling_efficiency")
            low, high = row.get("vs_2dtar_range", (None, None))
            rows.append([name, f"{w['model']} {w['size']}, batch {w['batch']} x {size}",
                         f"{measured['parameters'] / 1e6:.1f}M", LABELS[key], f"{row['step_seconds'] * 1e3:.0f}",
                         f"{row['samples_per_s']:.1f}", "100 (one rank)" if key == "none" else f"{se:.0%}",
                         "" if "vs_2dtar" not in row else f"{row['vs_2dtar']:.2f}x ({low:.2f}-{high:.2f})",
                         "" if "vs_horovod" not in row else f"{row['vs_horovod']:.2f}x",
                         "" if paper is None else f"{paper[0]:,} ({paper[1]:.1f} %)"])
    return markdown_table(["row", "workload (per rank x ranks)", "parameters", "configuration", "step (ms)",
                           "samples/s", "SE", "vs 2DTAR, median (min-max) of rounds", "vs Horovod",
                           "paper: samples/s (SE), 128 V100s"], rows, text_columns=4)


def plot(result: dict, path: Path) -> None:
    """SE per configuration and row, the paper's SE beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    keys = [k for k in CONFIGS if k != "none"]
    names = list(summary)
    fig, ax = plt.subplots(figsize=(2.4 * len(names) + 2, 4.2))
    width = 0.8 / len(keys)
    colors = {"horovod": "#d62728", "allreduce": "#ff7f0e", "hierarchical": "#1f77b4", "hitopk": "#2ca02c"}
    for j, key in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(names))]
        se = [100 * summary[n].get(key, {}).get("scaling_efficiency", 0.0) for n in names]
        ax.bar(xs, se, width, label=f"{LABELS[key]} (here)", color=colors[key])
        paper = [PAPER.get(n, {}).get(key, (None, None))[1] for n in names]
        ax.plot([x for x, p in zip(xs, paper) if p is not None], [p for p in paper if p is not None], "k_",
                markersize=14, mew=2)
    ax.plot([], [], "k_", markersize=14, mew=2, label="shi2021 Table 3 (128 V100s)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("scaling efficiency (%)")
    topo = result["topology"]
    ax.set_title(f"throughput / (P x one rank's), {topo['nodes']} nodes x {topo['ranks_per_node']} ranks", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace, result: dict, wall: float) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("worker_json", "workload_table")},
        "wall_seconds": wall, "verdict": result["verdict"], **result}, indent=1))
    plot(result, args.out / "throughput.png")
    readme = readme_path(args)
    if readme is None:
        return
    where = (f"on the emulated cluster of `hvdx/runner/cluster.py`, {args.rate} links between nodes (tbf-shaped, "
             "no added delay)" if result.get("network") else "over loopback (horovodrun, unshaped)")
    topo = result["topology"]
    lines = [
        f"Measured by `python benchmarks/throughput.py{' --local' if args.local else ''}` {where}: "
        f"{topo['nodes']} nodes x {topo['ranks_per_node']} ranks, all on 2 CPU cores; `model.fit`'s train "
        f"function, SGD with momentum, HiTopK at density {args.density}, random fixed batches. The "
        f"configurations share one model's weights and take turns, {args.rounds} rounds of {args.steps} steps "
        f"each after {args.warmup_steps} warm-up steps; a step's time is the slowest rank's, every figure a "
        "median over rounds. SE = throughput / (P x one rank's), one rank's measured as the ranks training "
        "alone at the same time (`each rank alone`). The run took "
        f"{wall / 60:.1f} min; the machine's 1-minute load average before and after: "
        f"{result['load_average'][0]:.1f}, {result['load_average'][1]:.1f}. Plot: `results/throughput.png`, "
        "raw: `results/throughput.json`.", "",
        verdict_text(result["verdict"], result["summary"]), "", table(result)]
    update_readme("throughput", "\n".join(lines), readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_topology_arguments(parser, topologies="2x2")
    parser.add_argument("--smoke", action="store_true", help="tiny stand-in models, 1 round of 1 step")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: s.split(","),
                        help=f"rows of Table 3, comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--configs", default=",".join(CONFIGS), type=lambda s: s.split(","))
    parser.add_argument("--density", type=float, default=0.01, help="HiTopK's k / d")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps timed per configuration per round")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="untimed steps per configuration and row (the first traces)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.bucket_bytes, args.sparse_as_dense = None, True  # train_step.make_optimizer's defaults; whole models
    args.workload_table = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    if args.smoke:
        args.rounds, args.steps, args.warmup_steps = 1, 1, 1
        if args.out == RESULTS and args.readme is None:  # a smoke run's numbers are not results
            args.out = Path(tempfile.gettempdir()) / "hvdx-throughput-smoke"
    unknown = [n for n in args.workloads if n not in WORKLOADS] + [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown {unknown}: workloads are {list(WORKLOADS)}, configurations {CONFIGS}")
    if args.worker_json:
        freeze_start_up()
        run_ranks(args)
        return
    if len(args.topologies.split(",")) != 1:
        parser.error("one topology per run (SE is against a rank of the same job)")
    start = time.perf_counter()
    (result,) = run_topologies(__file__, args, sys.argv[1:] if argv is None else argv)
    result["summary"] = summarize(result)
    result["verdict"] = verdict(result["summary"])
    report(args, result, time.perf_counter() - start)
    print(verdict_text(result["verdict"], result["summary"]))
    print(table(result))


if __name__ == "__main__":
    main()
