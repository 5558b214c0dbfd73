"""Figures 7 and 8 of shi2021: gradient aggregation time of the hvdx.comm strategies.

Figure 7: Allreduce (dense), Hierarchical (2DTAR), SparseAllgather (NaiveAG) and HiTopK
(HiTopKComm) on d-element float32 buffers at density 0.01, as ratios to Allreduce from the
same run. Figure 8: HiTopK's four steps (reduce-scatter, MSTopK, inter-node all-gather,
intra-node all-gather) at d = 25M and 110M. A time is the slowest rank's, median of
repeats after a warm-up.

    python benchmarks/comm.py            # launches itself on 2 nodes x 2 ranks (loopback)
    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python benchmarks/comm.py   # the same

Over loopback every link is equally fast, so this measures the algorithms' own costs, not
the intra/inter-node bandwidth gap the paper exploits: the emulated-cluster launcher
(shaped links between network namespaces) is the setting for the paper's speed-ups.
Writes <out>/comm.json, <out>/comm.png and the tables of benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = [1_000_000, 4_000_000, 16_000_000, 25_000_000, 64_000_000, 100_000_000]
BREAKDOWN_SIZES = [25_000_000, 110_000_000]
STRATEGIES = ["allreduce", "hierarchical", "sparse_allgather", "hitopk"]
LABELS = {"allreduce": "Allreduce (dense)", "hierarchical": "Hierarchical (2DTAR)",
          "sparse_allgather": "SparseAllgather (NaiveAG)", "hitopk": "HiTopK (HiTopKComm)"}


def under_launcher() -> bool:
    return any(v in os.environ for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def relaunch(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE.parent))
    from tests.harness import hosts  # the emulated-node host list

    horovodrun = Path(sys.executable).parent / "horovodrun"
    command = [str(horovodrun), "-np", str(args.nodes * args.ranks_per_node),
               "-H", hosts(args.nodes, args.ranks_per_node), "--gloo", sys.executable, __file__, *sys.argv[1:]]
    print("launching:", " ".join(command), flush=True)
    return subprocess.call(command, env=dict(os.environ, PYTHONPATH=str(HERE.parent)))


def slowest(seconds: float, name: str) -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    return float(hvd.allreduce(tf.constant(seconds, tf.float64), op=hvd.Max, name=name))


def measure(strategy, buffer, repeats: int, tag: str, steps: bool = False):
    """Median over repeats of the slowest rank's time, and of each recorded step's.

    Totals run the strategy in a tf.function, as a Keras train step does; the step
    breakdown needs eager execution (each step's wall time is taken between its ops).
    """
    import tensorflow as tf

    import hvdx

    call = (lambda b: strategy(b, name=tag)) if steps else tf.function(lambda b: strategy(b, name=tag))
    totals: List[float] = []
    per_step: Dict[str, List[float]] = {}
    for r in range(repeats + 1):  # the first call is the warm-up (and builds residuals)
        hvdx.barrier()
        start = time.perf_counter()
        call(buffer)
        elapsed = slowest(time.perf_counter() - start, f"{tag}.t{r}")
        step_times = {k: slowest(v, f"{tag}.{k}.{r}") for k, v in strategy.last_times.items()} if steps else {}
        if r:
            totals.append(elapsed)
            for k, v in step_times.items():
                per_step.setdefault(k, []).append(v)
    return statistics.median(totals), {k: statistics.median(v) for k, v in per_step.items()}


def fig7_table(rows: List[dict]) -> str:
    lines = ["| d | Allreduce (ms) | Hierarchical / Allreduce | NaiveAG / Allreduce | HiTopK / Allreduce | Allreduce / HiTopK |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = r["allreduce"]
        lines.append(f"| {r['d']:,} | {base * 1e3:.1f} | {r['hierarchical'] / base:.2f} | "
                     f"{r['sparse_allgather'] / base:.2f} | {r['hitopk'] / base:.2f} | {base / r['hitopk']:.2f}x |")
    return "\n".join(lines)


def fig8_table(rows: List[dict]) -> str:
    from hvdx.comm import HiTopK

    lines = ["| d | HiTopK total (ms) | " + " | ".join(f"{s} share" for s in HiTopK.STEPS) + " |",
             "| ---: | ---: | " + " | ".join("---:" for _ in HiTopK.STEPS) + " |"]
    for r in rows:
        total = sum(r["steps"].values())
        lines.append(f"| {r['d']:,} | {r['total'] * 1e3:.1f} | "
                     + " | ".join(f"{r['steps'][s] / total:.0%}" for s in HiTopK.STEPS) + " |")
    return "\n".join(lines)


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


def run_ranks(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    import hvdx
    from report import update_readme

    topo = hvdx.init()
    rows, breakdown = [], []
    for d in args.sizes:
        buffer = tf.constant(np.random.default_rng(topo.rank).standard_normal(d).astype(np.float32))
        row = {"d": d}
        for key in STRATEGIES:
            strategy = hvdx.comm.get(key, density=args.density)
            row[key], _ = measure(strategy, buffer, args.repeats, f"{key}{d}")
        rows.append(row)
        if topo.rank == 0:
            print(json.dumps(row), flush=True)
    for d in args.breakdown_sizes:
        buffer = tf.constant(np.random.default_rng(topo.rank).standard_normal(d).astype(np.float32))
        strategy = hvdx.comm.HiTopK(density=args.density)
        strategy.record_times = True
        total, steps = measure(strategy, buffer, args.repeats, f"bd{d}", steps=True)
        breakdown.append({"d": d, "total": total, "steps": steps})
        if topo.rank == 0:
            print(json.dumps(breakdown[-1]), flush=True)
    if topo.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"figures": "shi2021 Figures 7 and 8", "density": args.density, "repeats": args.repeats,
                  "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
                  "network": "loopback (no link shaping)", "aggregate_seconds": rows,
                  "hitopk_breakdown_seconds": breakdown}
        (args.out / "comm.json").write_text(json.dumps(result, indent=2))
        plot(rows, breakdown, args.out / "comm.png")
        print(fig7_table(rows))
        print(fig8_table(breakdown))
        readme = args.readme or (HERE / "README.md" if args.out == HERE / "results" else None)
        if readme is not None:
            body = (f"Measured by `python benchmarks/comm.py`: {topo.num_nodes} nodes x {topo.local_size} "
                    f"ranks over loopback on {os.cpu_count()} CPU cores, density {args.density}, float32; "
                    f"the slowest rank's time, median of {args.repeats} repeats after a warm-up. Over "
                    "loopback inter- and intra-node links are equally fast, so this is not the setting "
                    "of the paper's speed-ups (see the emulated-cluster runs). Plot: `results/comm.png`, "
                    "raw times: `results/comm.json`.\n\nAggregation time (Figure 7), ratios to Allreduce "
                    "(below 1: faster than Allreduce):\n\n" + fig7_table(rows) +
                    "\n\nHiTopK's four steps (Figure 8), share of its time:\n\n" + fig8_table(breakdown))
            update_readme("comm", body, readme)
    hvdx.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--breakdown-sizes", type=int, nargs="*", default=BREAKDOWN_SIZES)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--readme", type=Path, default=None)
    args = parser.parse_args()
    if not under_launcher():
        raise SystemExit(relaunch(args))
    run_ranks(args)


if __name__ == "__main__":
    main()
