"""Figures 7 and 8 of shi2021: gradient aggregation time of the hvdx.comm strategies.

Figure 7: Allreduce (dense), Hierarchical (2DTAR), SparseAllgather (NaiveAG) and HiTopK
(HiTopKComm) on d-element float32 buffers at density 0.01, as ratios to Allreduce from the
same run. Figure 8: HiTopK's four steps (reduce-scatter, MSTopK, inter-node all-gather,
intra-node all-gather). A time is the slowest rank's, median of rounds after a warm-up round;
the strategies take turns within a round, and speed-ups are medians of per-round ratios.

    python benchmarks/comm.py                    # 2 nodes x 2 ranks over loopback (horovodrun)
    python benchmarks/comm.py --cluster          # on the emulated cluster: 1 Gbit/s between nodes
    python -m hvdx.runner --rate 1gbit -- python benchmarks/comm.py    # the same

Over loopback every link is equally fast, so that run measures the algorithms' own costs,
not the intra/inter-node bandwidth gap the paper exploits. On the emulated cluster
(hvdx/runner/cluster.py: a network namespace per node, links shaped with tc) the run also
measures alpha and beta of eqs. 3, 7, 9 and 10 on the links, by least squares over
all-gathers of several sizes, and sets the model of eqs. 7-10 beside the measured steps.
Writes <out>/comm[_cluster].json, .png and the tables of benchmarks/README.md.
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
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (by_key, cluster_description, launch_ranks, markdown_table, slowest, timed_rounds,
                        under_launcher, update_readme)
except ImportError:
    from benchmarks.common import (by_key, cluster_description, launch_ranks, markdown_table, slowest, timed_rounds,
                                   under_launcher, update_readme)

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = [1_000_000, 4_000_000, 16_000_000, 25_000_000, 64_000_000, 100_000_000]
BREAKDOWN_SIZES = [25_000_000, 110_000_000]
CLUSTER_SIZES = [1_000_000, 4_000_000, 25_000_000, 100_000_000]
CLUSTER_BREAKDOWN_SIZES = [25_000_000]
FIT_BYTES = [4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]  # per-rank all-gather sizes for alpha, beta
GOALS = {"allreduce": 5.0, "hierarchical": 2.0}   # HiTopK speed-up asked for at d = 25M
STRATEGIES = ["allreduce", "hierarchical", "sparse_allgather", "hitopk"]
LABELS = {"allreduce": "Allreduce (dense)", "hierarchical": "Hierarchical (2DTAR)",
          "sparse_allgather": "SparseAllgather (NaiveAG)", "hitopk": "HiTopK (HiTopKComm)"}


def median_time(call: Callable[[], object], repeats: int, tag: str) -> float:
    """Median over `repeats` of the slowest rank's time of `call` (common.timed_rounds)."""
    return statistics.median(t["call"] for t in timed_rounds({"call": call}, repeats, tag))


def aggregate_times(strategies: Dict[str, object], buffer, repeats: int, tag: str) -> Dict[str, List[float]]:
    """The slowest rank's time of each strategy on `buffer`, per round, the strategies taking
    turns after a warm-up round (it builds residuals and traces the tf.functions). Each runs
    in a tf.function, as in a Keras train step."""
    import tensorflow as tf

    def compiled(key, strategy):
        def run(b):
            return strategy(b, name=f"{tag}.{key}")
        function = tf.function(run, autograph=False)  # plain Python: nothing to convert
        return lambda: function(buffer)

    calls = {key: compiled(key, strategy) for key, strategy in strategies.items()}
    return by_key(timed_rounds(calls, repeats, tag))


def hitopk_steps(strategy, buffer, repeats: int, tag: str):
    """Figure 8: median total and median of each step of an eager HiTopK call (recording puts
    a barrier before each step; eager, since a step's wall time is taken between its ops)."""
    strategy.record_times = True
    totals: List[float] = []
    per_step: Dict[str, List[float]] = {}
    for times in timed_rounds({"call": lambda: strategy(buffer, name=tag)}, repeats, tag):
        totals.append(times["call"])
        for k, v in strategy.last_times.items():
            per_step.setdefault(k, []).append(slowest(v, f"{tag}.{k}.{len(totals)}"))
    return statistics.median(totals), {k: statistics.median(v) for k, v in per_step.items()}


def speedups(per_round: Dict[str, List[float]]) -> Dict[str, List[float]]:
    """base / HiTopK of each round, for every other strategy."""
    return {base: [b / h for b, h in zip(times, per_round["hitopk"])]
            for base, times in per_round.items() if base != "hitopk"}


def speedup_range(row: dict, base: str):
    """HiTopK's speed-up over `base`: (median, lowest, highest) of the per-round ratios."""
    ratios = speedups(row["rounds_seconds"])[base]
    return statistics.median(ratios), min(ratios), max(ratios)


def speedup_text(row: dict, base: str) -> str:
    median, low, high = speedup_range(row, base)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def fig7_table(rows: List[dict]) -> str:
    header = ["d", "Allreduce (ms)", "Hierarchical / Allreduce", "NaiveAG / Allreduce", "HiTopK / Allreduce",
              "HiTopK speed-up over Allreduce", "over Hierarchical"]
    return markdown_table(header, ([f"{r['d']:,}", f"{r['allreduce'] * 1e3:.1f}",
                                    *(f"{r[key] / r['allreduce']:.2f}" for key in STRATEGIES[1:]),
                                    speedup_text(r, "allreduce"), speedup_text(r, "hierarchical")] for r in rows))


def fig8_table(rows: List[dict]) -> str:
    from hvdx.comm import HiTopK

    header = ["d", "HiTopK total (ms)", *(f"{s} share" for s in HiTopK.STEPS)]
    return markdown_table(header, ([f"{r['d']:,}", f"{r['total'] * 1e3:.1f}",
                                    *(f"{r['steps'][s] / sum(r['steps'].values()):.0%}" for s in HiTopK.STEPS)]
                                   for r in rows))


def plot(rows: List[dict], breakdown: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hvdx.comm import HiTopK

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    d = [r["d"] for r in rows]
    for key in STRATEGIES:
        left.loglog(d, [r[key] * 1e3 for r in rows], marker="o", label=LABELS[key])
    left.set(xlabel="gradient buffer size d", ylabel="aggregation time (ms)",
             title="Aggregation time, density 0.01 (Figure 7)")
    left.legend()
    bottom = [0.0] * len(breakdown)
    labels = [f"d = {r['d'] / 1e6:.0f}M" for r in breakdown]
    for step in HiTopK.STEPS:
        heights = [r["steps"][step] * 1e3 for r in breakdown]
        right.bar(labels, heights, bottom=bottom, label=step)
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.set(ylabel="time (ms)", title="HiTopK breakdown (Figure 8)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fit_link(process_set, p: int, repeats: int, tag: str) -> dict:
    """alpha (s) and beta (s/byte) of eq. 3, t = alpha log2 p + (p - 1) B beta, by least squares
    over all-gathers of B bytes per rank. Every rank gathers in its own set at once, so the n
    cross sets share each node's link as HiTopK's n streams do (beta is per stream)."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    times = []
    for nbytes in FIT_BYTES:
        x = tf.ones([nbytes // 4], tf.float32)
        gather = lambda: hvd.allgather(x, process_set=process_set, name=f"fit.{tag}")  # noqa: E731
        times.append(median_time(gather, max(repeats, 5), f"fit.{tag}.{nbytes}"))
    design = np.array([[np.log2(p), (p - 1) * b] for b in FIT_BYTES], dtype=np.float64)
    alpha, beta = nonnegative_fit(design, np.array(times))
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bytes_per_rank": FIT_BYTES, "seconds": times, "ranks": p}


def nonnegative_fit(design, seconds):
    """Least squares of seconds ~ design @ (alpha, beta) with alpha, beta >= 0 (a latency or a
    time per byte below zero means nothing): the best of the unconstrained solution, if it is
    feasible, and of the fits with one of the two held at 0."""
    import numpy as np

    candidates = []
    (a, b), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if a >= 0 and b >= 0:
        candidates.append((a, b))
    for column in (0, 1):
        x = design[:, column]
        coefficient = max(0.0, float(x @ seconds / (x @ x)))
        candidates.append((coefficient, 0.0) if column == 0 else (0.0, coefficient))
    a, b = min(candidates, key=lambda c: float(np.sum((design @ np.array(c) - seconds) ** 2)))
    return float(a), float(b)


def mstopk_alone(length: int, density: float, repeats: int) -> float:
    """Slowest rank's median time of MSTopK on `length` elements, every rank at once."""
    import numpy as np
    import tensorflow as tf

    import hvdx

    x = tf.constant(np.random.default_rng(hvdx.topology().rank).standard_normal(length).astype(np.float32))
    k = max(1, round(density * length))
    return median_time(lambda: hvdx.mstopk(x, k)[0].numpy(), repeats, f"mstopk.alone.{length}")


def model_steps(d: int, m: int, n: int, density: float, links: dict, t2: float) -> Dict[str, float]:
    """Eqs. 7-10 of shi2021 with the measured alpha, beta. hvdx sends a (value, int32 index)
    pair per selected element in one all-gather, so eqs. 9-10 count 8 bytes per element."""
    import math

    ai, bi = links["intra"]["alpha_s"], links["intra"]["beta_s_per_byte"]  # both >= 0 (nonnegative_fit)
    ae, be = links["inter"]["alpha_s"], links["inter"]["beta_s_per_byte"]
    return {"reduce_scatter": (n - 1) * ai + 4 * (n - 1) * d / n * bi,                      # eq. 7
            "mstopk": t2,                                                                     # eq. 8
            "inter_allgather": ae * math.log2(m) + 8 * (m - 1) * density * d / n * be,        # eq. 9
            "intra_allgather": ai * math.log2(n) + 8 * (n - 1) * density * d * m / n * bi}    # eq. 10


def model_table(d: int, measured: Dict[str, float], model: Dict[str, float], links: dict) -> str:
    from hvdx.comm import HiTopK

    equations = {"reduce_scatter": "eq. 7", "mstopk": "eq. 8 (MSTopK alone on d/n elements)",
                 "inter_allgather": "eq. 9", "intra_allgather": "eq. 10"}
    cells = [[step, equations[step], f"{model[step] * 1e3:.1f}", f"{measured[step] * 1e3:.1f}",
              f"{measured[step] / model[step]:.1f}"] for step in HiTopK.STEPS]
    cells.append(["total", "", f"{sum(model.values()) * 1e3:.1f}", f"{sum(measured.values()) * 1e3:.1f}",
                  f"{sum(measured.values()) / sum(model.values()):.1f}"])
    table = markdown_table([f"step (d = {d:,})", "model", "model (ms)", "measured (ms)", "measured / model"],
                           cells, text_columns=2)
    link_lines = []
    for where in ("inter", "intra"):
        fit = links[where]
        rate = (f" ({8 / fit['beta_s_per_byte'] / 1e6:.0f} Mbit/s per stream)" if fit["beta_s_per_byte"] > 0
                else " (below the noise: taken as 0)")
        link_lines.append(f"alpha_{where} = {fit['alpha_s'] * 1e3:.1f} ms, beta_{where} = "
                          f"{fit['beta_s_per_byte'] * 1e9:.2f} ns/byte{rate}")
    return table + "\n\nFitted on all-gathers of " + ", ".join(
        f"{b // 1024:,} KiB" for b in FIT_BYTES) + " per rank: " + "; ".join(link_lines) + "."


def goals_text(rows: List[dict], breakdown: List[dict], network: dict, links: Optional[dict],
               ranks: int, d: int = 25_000_000) -> str:
    """The issue's goals at d = 25M, met or by how much missed, and why when missed."""
    row = next((r for r in rows if r["d"] == d), None)
    if row is None:
        return ""
    parts, missed = [], False
    for base, goal in GOALS.items():
        speedup, low, high = speedup_range(row, base)
        missed |= speedup < goal
        verdict = "met" if speedup >= goal else f"missed by {(1 - speedup / goal):.0%}"
        parts.append(f"HiTopK is **{speedup:.2f}x** faster than {LABELS[base]} (goal >= {goal:g}x: {verdict}; "
                     f"rounds ranged {low:.2f}-{high:.2f}x)")
    text = f"At d = {d:,}: " + "; ".join(parts) + "."
    steps = next((b["steps"] for b in breakdown if b["d"] == d), None)
    if not (missed and steps):
        return text
    share = steps["inter_allgather"] / sum(steps.values())
    text += (f" Why: Allreduce is bound by the {network['rate']} links, but HiTopK is not: its one step on them "
             f"(inter_allgather) is {share:.0%} of its time. The rest is CPU and memory work of {ranks} ranks "
             f"sharing {os.cpu_count()} cores and one memory bus (the paper's ranks each have a GPU), and the "
             "intra-node reduce-scatter runs over TCP on loopback rather than NVLink.")
    if links:
        small = min(links["intra"]["seconds"][0], links["inter"]["seconds"][0])
        text += (f" Each Horovod collective also costs its negotiation: a {FIT_BYTES[0] // 1024} KiB all-gather "
                 f"takes {small * 1e3:.0f} ms here, and HiTopK makes three collectives to Allreduce's one.")
    if rows[-1]["d"] > d:
        big = speedup_range(rows[-1], "allreduce")[0]
        if big > speedup_range(row, "allreduce")[0]:
            text += (f" At d = {rows[-1]['d']:,}, where the links weigh more, HiTopK is {big:.2f}x faster "
                     "than Allreduce.")
    return text


def run_ranks(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    import hvdx

    topo = hvdx.init()
    network = cluster_description()
    rows, breakdown = [], []
    for d in args.sizes:
        buffer = tf.constant(np.random.default_rng(topo.rank).standard_normal(d).astype(np.float32))
        per_round = aggregate_times({key: hvdx.comm.get(key, strict=False, density=args.density) for key in STRATEGIES},
                                    buffer, args.repeats, f"agg{d}")
        row = {"d": d, **{key: statistics.median(t) for key, t in per_round.items()},
               "rounds_seconds": per_round}
        rows.append(row)
        if topo.rank == 0:
            print(json.dumps(row), flush=True)
    for d in args.breakdown_sizes:
        buffer = tf.constant(np.random.default_rng(topo.rank).standard_normal(d).astype(np.float32))
        total, steps = hitopk_steps(hvdx.comm.HiTopK(density=args.density), buffer, args.repeats, f"bd{d}")
        breakdown.append({"d": d, "total": total, "steps": steps})
        if topo.rank == 0:
            print(json.dumps(breakdown[-1]), flush=True)
    models = []
    if network is not None:
        links = {"inter": fit_link(topo.cross_set, topo.num_nodes, args.repeats, "inter"),
                 "intra": fit_link(topo.local_set, topo.local_size, args.repeats, "intra")}
        for entry in breakdown:
            d = entry["d"]
            t2 = mstopk_alone(-(-d // topo.local_size), args.density, args.repeats)
            models.append({"d": d, "links": links,
                           "model": model_steps(d, topo.num_nodes, topo.local_size, args.density, links, t2),
                           "measured": entry["steps"]})
        if topo.rank == 0:
            print(json.dumps(links), flush=True)
    if topo.rank == 0:
        report(args, topo, network, rows, breakdown, models)
    hvdx.barrier()


def report(args, topo, network: Optional[dict], rows, breakdown, models) -> None:
    stem = "comm" if network is None else "comm_cluster"
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"figures": "shi2021 Figures 7 and 8", "density": args.density, "repeats": args.repeats,
              "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
              "network": network or "loopback (no link shaping)", "aggregate_seconds": rows,
              "hitopk_breakdown_seconds": breakdown, "model_eqs_7_10": models}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, breakdown, args.out / f"{stem}.png")
    print(fig7_table(rows))
    print(fig8_table(breakdown))
    for entry in models:
        print(model_table(entry["d"], entry["measured"], entry["model"], entry["links"]))
    readme = args.readme or (HERE / "README.md" if args.out == HERE / "results" else None)
    if readme is None:
        return
    common = (f"density {args.density}, float32; the slowest rank's time, median of {args.repeats} rounds "
              f"after a warm-up round; in each round the strategies take turns, each in a tf.function as in a "
              f"Keras train step, and a speed-up is the median of the per-round ratios (their range in "
              f"parentheses). Plot: "
              f"`results/{stem}.png`, raw times: `results/{stem}.json`.")
    tables = ("\n\nAggregation time (Figure 7), ratios to Allreduce (below 1: faster than Allreduce):\n\n"
              + fig7_table(rows) + "\n\nHiTopK's four steps (Figure 8; eager, a barrier before each step), "
              "share of their sum:\n\n" + fig8_table(breakdown))
    if network is None:
        body = (f"Measured by `python benchmarks/comm.py`: {topo.num_nodes} nodes x {topo.local_size} ranks over "
                f"loopback on {os.cpu_count()} CPU cores, " + common + " Over loopback inter- and intra-node links "
                "are equally fast, so this is not the setting of the paper's speed-ups (see the emulated-cluster "
                "run below)." + tables)
        update_readme("comm", body, readme)
        return
    delay = (f"delay {network['delay']}" if network["delay_applied"] else
             "no added delay (this kernel has no netem)")
    body = (f"Measured by `python benchmarks/comm.py --cluster`: {topo.num_nodes} nodes x {topo.local_size} ranks "
            f"on the emulated cluster of `hvdx/runner/cluster.py` (one network namespace per node; each node's "
            f"link shaped to {network['rate']} each way with tbf, {delay}; ranks of a node talk over its "
            f"loopback), all {topo.size} ranks on {os.cpu_count()} CPU cores, " + common + "\n\n"
            + goals_text(rows, breakdown, network, models[0]["links"] if models else None, topo.size) + tables)
    for entry in models:
        body += ("\n\nThe time model of eqs. 7-10 with alpha and beta measured on the emulated links, beside "
                 "the measured steps:\n\n" + model_table(entry["d"], entry["measured"], entry["model"],
                                                         entry["links"])
                 + "\n\nThe measured intra_allgather includes adding the received pairs into the d-vector "
                 "(Algorithm 2, lines 15-22), which eq. 10 does not count.")
    update_readme("comm-cluster", body, readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"buffer sizes d (default {DEFAULT_SIZES}; on a cluster {CLUSTER_SIZES})")
    parser.add_argument("--breakdown-sizes", type=int, nargs="*", default=None,
                        help=f"d for Figure 8 (default {BREAKDOWN_SIZES}; on a cluster {CLUSTER_BREAKDOWN_SIZES})")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--cluster", action="store_true",
                        help="run on the emulated cluster (hvdx/runner/cluster.py; needs root)")
    parser.add_argument("--rate", default="1gbit", help="inter-node link rate with --cluster (tc syntax)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--readme", type=Path, default=None)
    args = parser.parse_args()
    if not under_launcher():
        raise SystemExit(launch_ranks([__file__, *sys.argv[1:]], args.nodes, args.ranks_per_node, cluster=args.cluster,
                                      rate=args.rate))
    on_cluster = cluster_description() is not None
    if args.sizes is None:
        args.sizes = CLUSTER_SIZES if on_cluster else DEFAULT_SIZES
    if args.breakdown_sizes is None:
        args.breakdown_sizes = CLUSTER_BREAKDOWN_SIZES if on_cluster else BREAKDOWN_SIZES
    run_ranks(args)


if __name__ == "__main__":
    main()
