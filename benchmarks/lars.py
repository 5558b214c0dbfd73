"""Section 5.4 of shi2021: LARS's layer-wise rates computed replicated or in parallel.

For ResNet-50's parameter shapes (161 tensors, 25.6M parameters) and a Transformer-base's
(257 tensors, 63M), with random weights and gradients identical on every rank (what
aggregation leaves), on 2 nodes x 2 ranks:

- naive: a Python loop of tf.norm calls per variable, eagerly (TF's reference LARS);
- fused: hvdx.optimizers.LARS(parallel=None), every layer's sums of squares in one graph;
- pto: parallel=None's work split over the ranks by element count, one all-gather (eqs. 12-14);
- slices: each rank reduces its slice of a 2DTAR (Hierarchical) reduce-scatter, one
  all-gather inside the node.

Two timings each: the layer-wise rates alone (eq. 11 for every layer), and a whole LARS step
(rates and the momentum updates of all variables). A time is the slowest rank's, median of
rounds after a warm-up round, the methods taking turns within a round; ratios are medians
of per-round ratios. The run also times the parts (the fused reduction alone, one rank's PTO
share alone, each all-gather alone) and models the PTO time on P ranks from them.

    python benchmarks/lars.py                 # relaunches itself with horovodrun on 2 x 2
    python benchmarks/lars.py --scale 0.01 --limit 24   # tiny (the CI smoke test)

Writes <out>/lars.json, lars.png and the `lars` table of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (README, add_output_arguments, by_key, launch_ranks, markdown_table, medians, timed_rounds,
                        under_launcher, update_readme)
except ImportError:
    from benchmarks.common import (README, add_output_arguments, by_key, launch_ranks, markdown_table, medians,
                                   timed_rounds, under_launcher, update_readme)

HERE = Path(__file__).resolve().parent
METHODS = ["naive", "fused", "pto", "slices"]
GOAL = 2.0  # best parallel mode over fused, rates at ResNet-50's shapes (the issue's "Done when")
MODEL_RANKS = [4, 8, 16, 32, 64, 128]

Shape = Tuple[int, ...]


def resnet50_shapes() -> List[Shape]:
    """ResNet-50's 161 trainable tensors (convolutions without bias, batch norm gamma and
    beta, the classifier): 25,557,032 parameters, as tf.keras.applications.ResNet50 minus
    its convolution biases, in the same order."""
    shapes: List[Shape] = [(7, 7, 3, 64), (64,), (64,)]
    channels = 64
    for width, blocks in zip([64, 128, 256, 512], [3, 4, 6, 3]):
        for block in range(blocks):
            if block == 0:
                shapes += [(1, 1, channels, 4 * width), (4 * width,), (4 * width,)]
            shapes += [(1, 1, channels, width), (width,), (width,), (3, 3, width, width), (width,), (width,),
                       (1, 1, width, 4 * width), (4 * width,), (4 * width,)]
            channels = 4 * width
    return shapes + [(2048, 1000), (1000,)]


def transformer_base_shapes(vocabulary: int = 37000, d: int = 512, ff: int = 2048, layers: int = 6) -> List[Shape]:
    """Transformer-base (Vaswani et al. 2017): a shared embedding, 6 encoder and 6 decoder
    layers (attention projections with biases, layer norms, feed-forward): 257 tensors."""
    attention = [(d, d), (d,)] * 4
    norm = [(d,), (d,)]
    feed_forward = [(d, ff), (ff,), (ff, d), (d,)]
    encoder = (attention + norm + feed_forward + norm) * layers + norm
    decoder = (attention + norm + attention + norm + feed_forward + norm) * layers + norm
    return [(vocabulary, d)] + encoder + decoder


MODELS = {"resnet50": resnet50_shapes, "transformer_base": transformer_base_shapes}


def scaled(shapes: Sequence[Shape], scale: float) -> List[Shape]:
    """The same number of tensors with about `scale` times the elements (1-D), for smoke tests."""
    import numpy as np

    if scale >= 1.0:
        return list(shapes)
    return [(max(1, int(np.prod(s) * scale)),) for s in shapes]


def rounds(calls: Dict[str, Callable[[], object]], repeats: int, tag: str) -> Dict[str, List[float]]:
    """The slowest rank's time of every call in each of `repeats` rounds after a warm-up
    round (it traces the tf.functions), the calls taking turns (common.timed_rounds)."""
    return by_key(timed_rounds(calls, repeats, f"lars.{tag}"))


def summary(per_round: Dict[str, List[float]]) -> dict:
    ratio = lambda base: {k: statistics.median(b / t for b, t in zip(per_round[base], per_round[k]))  # noqa: E731
                          for k in per_round}
    return {"median_seconds": medians(per_round), "rounds_seconds": per_round, "speedup_over_fused": ratio("fused"),
            "speedup_over_naive": ratio("naive")}


def run_model(name: str, shapes: List[Shape], repeats: int) -> dict:
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvdx
    from hvdx import pto
    from hvdx.optimizers import LARS
    from hvdx.optimizers.layerwise import squared_norm

    topo = hvdx.topology()
    rng = np.random.default_rng(54)  # the same weights and gradients on every rank
    variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32) * 0.05, name=f"{name}/t{i}")
                 for i, s in enumerate(shapes)]
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32) * 1e-3) for s in shapes]
    pairs = list(zip(grads, variables))
    # One optimizer (one set of momentum slots) for every method: each method's tf.function
    # is traced with its own mode, which the trace keeps.
    optimizer = LARS(learning_rate=0.1, momentum=0.9, weight_decay=1e-4, eeta=0.001, name=f"LARS_{name}")
    optimizer.build(variables)
    # The slices of a 2DTAR (Hierarchical) aggregation of these gradients, as
    # hvdx.DistributedOptimizer leaves them (one real aggregation, outside the timings).
    aggregator = hvdx.GradientAggregator(hvdx.comm.Hierarchical(flat_below=0))  # 2DTAR on every bucket
    aggregator([tf.identity(g) for g in grads], variables)
    optimizer.observe_aggregation(aggregator.last_aggregation)
    del aggregator
    mode_of = {"fused": None, "pto": "pto", "slices": "slices"}

    def naive_rates():  # TF's reference LARS: per variable, eagerly
        out = []
        for g, w in pairs:
            w_norm, g_norm = tf.norm(w), tf.norm(g)
            out.append(0.001 * w_norm / (g_norm + 1e-4 * w_norm))
        return [float(r) for r in out[-1:]]

    rates: Dict[str, Callable[[], object]] = {"naive": naive_rates}
    steps: Dict[str, Callable[[], object]] = {}
    modes = {}
    for method, mode in mode_of.items():
        rate_fn = tf.function(lambda m=mode: tf.stack(optimizer.trust_ratios(variables, grads, mode=m)))
        rate_fn.get_concrete_function()
        modes[method] = optimizer.last_mode
        rates[method] = lambda f=rate_fn: f().numpy()
        optimizer.parallel = mode
        step_fn = tf.function(lambda: optimizer.apply_gradients(pairs))
        step_fn.get_concrete_function()
        assert optimizer.last_mode == modes[method], (method, optimizer.last_mode)
        steps[method] = lambda f=step_fn: f().numpy()
    assert modes == {"fused": None, "pto": "pto", "slices": "slices"}, modes

    def naive_step():  # update_step per variable, each computing its own rate
        for g, w in pairs:
            optimizer.update_step(g, w)

    steps = {"naive": naive_step, **steps}
    rate_rounds = rounds(rates, repeats, f"{name}.rates")
    step_rounds = rounds(steps, repeats, f"{name}.step")

    # The parts: the fused reduction, one rank's PTO share, the all-gathers alone.
    sizes = [int(np.prod(s)) for s in shapes]
    shares = pto.partition([2 * n for n in sizes], topo.size)
    mine = shares.parts[topo.rank]
    share_fn = tf.function(lambda: tf.stack([tf.stack([squared_norm(variables[i]), squared_norm(grads[i])])
                                             for i in mine]) if mine else tf.zeros([0, 2]))
    fused_fn = tf.function(lambda: tf.stack([tf.stack([squared_norm(w), squared_norm(g)]) for g, w in pairs]))
    block = tf.zeros([shares.width, 2])
    local_block = tf.zeros([len(shapes), 2])
    gather = tf.function(lambda: hvd.allgather(block, name=f"lars.part.ag.{name}"))
    gather_local = tf.function(lambda: hvd.allgather(local_block, process_set=topo.local_set,
                                                     name=f"lars.part.agl.{name}"))
    part_rounds = rounds({"fused_reduction": lambda: fused_fn().numpy(), "pto_share": lambda: share_fn().numpy(),
                          "allgather_global": lambda: gather().numpy(),
                          "allgather_local": lambda: gather_local().numpy()}, repeats, f"{name}.parts")
    parts = medians(part_rounds)
    return {"model": name, "tensors": len(shapes), "elements": int(sum(sizes)), "modes": modes,
            "share_imbalance": shares.imbalance, "rates": summary(rate_rounds), "step": summary(step_rounds),
            "parts_seconds": parts, "parts_rounds_seconds": part_rounds}


def share_fractions(shapes: Sequence[Shape], ranks: Sequence[int]) -> Dict[int, float]:
    """The largest PTO share (w and g of whole tensors, hvdx.pto.partition) as a fraction of
    all the work, on each number of ranks: it stops shrinking once it is one large tensor."""
    import numpy as np

    from hvdx import pto

    sizes = [2 * int(np.prod(s)) for s in shapes]
    fractions = {}
    for p in ranks:
        loads = pto.partition(sizes, p).loads
        fractions[p] = max(loads) / sum(loads)
    return fractions


def model_on_p_ranks(model: dict, size: int, fractions: Dict[int, float]) -> List[dict]:
    """PTO's rate time on P ranks, calibrated on this run: T(P) = S (f_P / f_size) + alpha
    log2 P + c, with S one rank's measured share, f_P the largest share's fraction of the
    work on P ranks (share_fractions), alpha the measured all-gather over log2 of this run's
    ranks, and c what the measured PTO rates cost beyond share and all-gather (the formula,
    stacking). The fused replicated time F (measured) does not depend on P."""
    import math

    parts = model["parts_seconds"]
    fused = model["rates"]["median_seconds"]["fused"]
    share, gather = parts["pto_share"], parts["allgather_global"]
    alpha = gather / math.log2(size)
    rest = max(0.0, model["rates"]["median_seconds"]["pto"] - share - gather)
    out = []
    for p in MODEL_RANKS:
        t = share * fractions[p] / fractions[size] + alpha * math.log2(p) + rest
        out.append({"ranks": p, "pto_seconds": t, "fused_seconds": fused, "speedup": fused / t,
                    "largest_share": fractions[p]})
    return out


def table(result: dict) -> str:
    header = ["model", "tensors", "part", *(f"{m} (ms)" for m in METHODS), "pto / fused speed-up",
              "slices / fused speed-up", "fused / naive speed-up"]
    rows = []
    for m in result["models"]:
        for part in ("rates", "step"):
            s = m[part]
            rows.append([m["model"], m["tensors"], part, *(f"{s['median_seconds'][k] * 1e3:.1f}" for k in METHODS),
                         f"{s['speedup_over_fused']['pto']:.2f}x", f"{s['speedup_over_fused']['slices']:.2f}x",
                         f"{s['speedup_over_naive']['fused']:.2f}x"])
    return markdown_table(header, rows, text_columns=3)


def parts_table(result: dict) -> str:
    header = ["model", "fused reduction (ms)", "one rank's PTO share (ms)", "all-gather, 4 ranks (ms)",
              "all-gather in the node (ms)", "share imbalance"]
    return markdown_table(header, ([m["model"], *(f"{m['parts_seconds'][k] * 1e3:.1f}" for k in (
        "fused_reduction", "pto_share", "allgather_global", "allgather_local")), f"{m['share_imbalance']:.3f}"]
        for m in result["models"]), text_columns=1)


def model_table(result: dict) -> str:
    header = ["model", *(f"P = {p}" for p in MODEL_RANKS)]
    return markdown_table(header, ([m["model"], *(f"{row['speedup']:.2f}x" for row in m["model_p"])]
                                   for m in result["models"]), text_columns=1)


def verdict(result: dict) -> str:
    resnet = next(m for m in result["models"] if m["model"] == "resnet50")
    speedups = resnet["rates"]["speedup_over_fused"]
    best = max(("pto", "slices"), key=lambda k: speedups[k])
    value = speedups[best]
    text = (f"**ResNet-50 shapes, rates: the best parallel mode ({best}) is {value:.2f}x faster than the fused "
            f"replicated computation; goal {GOAL:.0f}x: ")
    if value >= GOAL:
        return text + "met.**"
    parts = resnet["parts_seconds"]
    return text + (f"missed by {(1 - value / GOAL):.0%}.** One all-gather costs "
                   f"{parts['allgather_global'] * 1e3:.1f} ms "
                   f"here against a fused reduction of {parts['fused_reduction'] * 1e3:.1f} ms, so the collective's "
                   "latency, not the arithmetic, bounds the speed-up.")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4.5))
    for ax, m in zip(axes, models):
        width = 0.38
        x = range(len(METHODS))
        for offset, part in ((-width / 2, "rates"), (width / 2, "step")):
            ax.bar([i + offset for i in x], [m[part]["median_seconds"][k] * 1e3 for k in METHODS], width,
                   label=part)
        ax.set_xticks(list(x), METHODS)
        ax.set(ylabel="time (ms, slowest rank, median)", title=f"{m['model']}: {m['tensors']} tensors, "
                                                               f"{m['elements'] / 1e6:.1f}M")
        ax.set_yscale("log")
        ax.legend()
    ax = axes[-1]
    for m in models:
        ax.plot([r["ranks"] for r in m["model_p"]], [r["speedup"] for r in m["model_p"]], marker="o",
                label=m["model"])
    ax.axhline(GOAL, color="grey", linestyle=":")
    ax.set(xscale="log", xlabel="ranks P", ylabel="PTO over fused (rates), modelled",
           title="PTO on P ranks, from the measured parts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def model_shapes(result: dict, name: str) -> List[Shape]:
    return scaled(MODELS[name]()[:result.get("limit")], result["scale"])


def report(result: dict, out: Path, readme: Path) -> None:
    size = result["topology"]["nodes"] * result["topology"]["ranks_per_node"]
    for m in result["models"]:
        m["model_p"] = model_on_p_ranks(m, size, share_fractions(model_shapes(result, m["model"]),
                                                                  sorted({size, *MODEL_RANKS})))
    out.mkdir(parents=True, exist_ok=True)
    (out / "lars.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "lars.png")
    cores = result["machine"]["cpu_count"]
    body = (f"Measured by `python benchmarks/lars.py`: 2 nodes x 2 ranks over loopback, all 4 ranks on {cores} "
            f"CPU cores (shared with other work), {result['repeats']} rounds after a warm-up, the methods taking "
            "turns; times are the slowest rank's, medians; speed-ups are medians of per-round ratios. `rates`: "
            "eq. 11 for every layer; `step`: a whole LARS step (rates and momentum updates). naive = per-variable "
            "tf.norm loop (eager), fused = `LARS(parallel=None)`, pto = `parallel=\"pto\"`, slices = "
            "`parallel=\"slices\"` on a 2DTAR aggregation's slices.\n\n" + table(result) + "\n\n" + verdict(result)
            + "\n\nThe parts (medians): the fused replicated reduction of every layer's two sums of squares, one "
            "rank's balanced PTO share of it, and the all-gathers alone:\n\n" + parts_table(result)
            + "\n\nWith 4 ranks on 2 cores, every rank's compute is contended: the replicated reduction runs 4 "
            "times at once on 2 cores, and a PTO share of 1/4 of it does not run 4x faster than the whole on "
            "an otherwise idle core. A small Gloo collective costs about 10 ms here, through Horovod's "
            "background thread and loopback TCP on busy cores. A whole step gains less than the rates: its "
            "momentum updates read and write every parameter on every rank, and PTO removes only the norms. "
            "Modelled speed-up of PTO's rates over the fused ones on P ranks, "
            "from this run's parts: T_pto(P) = S f_P / f_4 + alpha log2 P + c (S: one rank's measured share; f_P: "
            "the largest balanced share's fraction of the work on P ranks, which stops shrinking at the largest "
            "tensor, 2 x 2.4M elements of ResNet-50, 2 x 18.9M of the Transformer; alpha: the measured 4-rank "
            "all-gather / 2; c: the measured PTO rates beyond share and all-gather), against the measured fused "
            "time, which does not depend on P. With this machine's millisecond collectives the all-gather's "
            "log2 P term dominates at large P; with a cluster's microsecond ones the share term does:\n\n"
            + model_table(result))
    update_readme("lars", body, readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="tensor sizes x this (smoke tests)")
    parser.add_argument("--limit", type=int, default=None, help="only each model's first LIMIT tensors (smoke tests)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add_output_arguments(parser, readme=README)
    parser.add_argument("--report-only", type=Path, default=None,
                        help="rewrite the PNG, the model and the table from this JSON of an earlier run")
    args = parser.parse_args()
    if args.report_only is not None:
        sys.path.insert(0, str(HERE.parent))
        report(json.loads(args.report_only.read_text()), args.out, args.readme)
        return
    if not under_launcher():  # 2 nodes x 2 ranks over loopback
        raise SystemExit(launch_ranks([__file__, *sys.argv[1:]], 2, 2))
    import tensorflow as tf

    import hvdx

    topo = hvdx.init()
    models = []
    for name in args.models:
        models.append(run_model(name, scaled(MODELS[name]()[:args.limit], args.scale), args.repeats))
        if topo.rank == 0:
            print(json.dumps({k: v for k, v in models[-1].items() if k in ("model", "rates", "step", "parts_seconds")},
                             indent=1, default=str), flush=True)
    if topo.rank == 0:
        result = {"topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size}, "scale": args.scale,
                  "limit": args.limit,
                  "repeats": args.repeats, "models": models,
                  "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                              "tensorflow": tf.__version__}}
        report(result, args.out, args.readme)
    hvdx.barrier()


if __name__ == "__main__":
    main()
