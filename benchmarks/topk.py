"""Figure 6 of shi2021: top-k selection time against the vector size, k = 0.001 d.

Compares, in one run on the same inputs: hvdx's MSTopK op (Algorithm 1, N = 30),
tf.math.top_k on |x|, a DGC-style double-sampling top-k (threshold from a 1 % sample,
exact top-k over the survivors) and NumPy's argpartition, against one reduce_max(|x|) as
the memory-bound floor. Also sparse accumulation (the receiving side of the sparse
all-gather) against tf.math.unsorted_segment_sum, tf.scatter_nd and
tf.tensor_scatter_nd_add. Each time is the median of repeats after a warm-up; the tables
report ratios against baselines measured in the same run.

    python benchmarks/topk.py                      # the full figure (a few minutes)
    python benchmarks/topk.py --sizes 262144 --repeats 1 --out /tmp/x   # smoke run

Writes <out>/topk.json, <out>/topk.png and the tables of benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdx  # noqa: E402
from report import markdown_table, update_readme  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = [2**18, 2**20, 2**22, 2**24, 25_000_000, 2**26, 2**27]
DENSITY = 0.001


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds (eager CPU ops run synchronously)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dgc_topk(x: tf.Tensor, k: int, sample_ratio: float = 0.01):
    """DGC's double sampling (Lin et al. 2018): a threshold from the top of a random
    sample, then an exact top-k over the elements above it (all of x if too few)."""
    a = tf.abs(x)
    d = int(x.shape[0])
    n_sample = max(1, int(d * sample_ratio))
    sample = tf.gather(a, tf.random.uniform([n_sample], 0, d, dtype=tf.int32))
    k_sample = max(1, int(k * sample_ratio))
    threshold = tf.math.top_k(sample, k_sample, sorted=False).values[-1]
    survivors = tf.where(a >= threshold)[:, 0]
    if int(tf.size(survivors)) < k:
        return tf.math.top_k(a, k, sorted=False).indices
    picked = tf.math.top_k(tf.gather(a, survivors), k, sorted=False).indices
    return tf.gather(survivors, picked)


def bench_topk(d: int, repeats: int, rng: np.random.Generator) -> Dict[str, float]:
    x_np = rng.standard_normal(d).astype(np.float32)
    x = tf.constant(x_np)
    k = max(1, int(DENSITY * d))
    methods = {
        "floor_reduce_max_abs": lambda: tf.reduce_max(tf.abs(x)),
        "mstopk": lambda: hvdx.mstopk(x, k),
        "tf_top_k": lambda: tf.math.top_k(tf.abs(x), k, sorted=False),
        "dgc_double_sampling": lambda: dgc_topk(x, k),
        "np_argpartition": lambda: np.argpartition(np.abs(x_np), d - k)[d - k:],
    }
    row = {"d": d, "k": k}
    for name, fn in methods.items():
        row[name] = median_time(fn, repeats)
    return row


def bench_accumulate(d: int, repeats: int, rng: np.random.Generator) -> Dict[str, float]:
    """HiTopKComm's receive side on 2 nodes: 2 k (value, index) pairs into d elements."""
    nnz = 2 * max(1, int(10 * DENSITY * d))  # density 0.01, as in the aggregation benchmark
    values = tf.constant(rng.standard_normal(nnz).astype(np.float32))
    indices = tf.constant(rng.integers(0, d, nnz).astype(np.int32))
    zeros = tf.zeros([d])
    methods = {
        "sparse_accumulate": lambda: hvdx.sparse_accumulate(values, indices, d),
        "sparse_accumulate_out": lambda: hvdx.sparse_accumulate(values, indices, d, out=zeros),
        "unsorted_segment_sum": lambda: tf.math.unsorted_segment_sum(values, indices, d),
        "scatter_nd": lambda: tf.scatter_nd(indices[:, None], values, [d]),
        "tensor_scatter_nd_add": lambda: tf.tensor_scatter_nd_add(zeros, indices[:, None], values),
    }
    row = {"d": d, "nnz": nnz}
    for name, fn in methods.items():
        row[name] = median_time(fn, repeats)
    return row


def topk_table(rows: List[dict]) -> str:
    header = ["d", "k", "floor (ms)", "MSTopK / floor", "tf.math.top_k / MSTopK", "DGC / MSTopK",
              "argpartition / MSTopK"]
    return markdown_table(header, ([f"{r['d']:,}", f"{r['k']:,}", f"{r['floor_reduce_max_abs'] * 1e3:.2f}",
                                    f"{r['mstopk'] / r['floor_reduce_max_abs']:.2f}x",
                                    *(f"{r[key] / r['mstopk']:.1f}x"
                                      for key in ("tf_top_k", "dgc_double_sampling", "np_argpartition"))]
                                   for r in rows))


def accumulate_table(rows: List[dict]) -> str:
    header = ["d", "nnz", "sparse_accumulate (ms)", "unsorted_segment_sum / ours", "scatter_nd / ours",
              "tensor_scatter_nd_add / ours (with out)"]
    return markdown_table(header, ([f"{r['d']:,}", f"{r['nnz']:,}", f"{r['sparse_accumulate'] * 1e3:.2f}",
                                    f"{r['unsorted_segment_sum'] / r['sparse_accumulate']:.1f}x",
                                    f"{r['scatter_nd'] / r['sparse_accumulate']:.1f}x",
                                    f"{r['tensor_scatter_nd_add'] / r['sparse_accumulate_out']:.1f}x"]
                                   for r in rows))


def plot(topk_rows: List[dict], acc_rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    d = [r["d"] for r in topk_rows]
    for key, label in [("mstopk", "MSTopK (hvdx)"), ("tf_top_k", "tf.math.top_k"),
                       ("dgc_double_sampling", "DGC double sampling"), ("np_argpartition", "np.argpartition"),
                       ("floor_reduce_max_abs", "reduce_max(|x|) floor")]:
        left.loglog(d, [r[key] * 1e3 for r in topk_rows], marker="o", label=label,
                    linestyle="--" if key.startswith("floor") else "-")
    left.set(xlabel="vector size d", ylabel="time (ms)", title="Top-k selection, k = 0.001 d (Figure 6)")
    left.legend()
    d = [r["d"] for r in acc_rows]
    for key, label in [("sparse_accumulate", "sparse_accumulate (hvdx)"),
                       ("unsorted_segment_sum", "unsorted_segment_sum"), ("scatter_nd", "scatter_nd"),
                       ("tensor_scatter_nd_add", "tensor_scatter_nd_add")]:
        right.loglog(d, [r[key] * 1e3 for r in acc_rows], marker="o", label=label)
    right.set(xlabel="dense size d", ylabel="time (ms)", title="Sparse accumulation, nnz = 0.02 d")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--readme", type=Path, default=None,
                        help="README to update (default: benchmarks/README.md when --out is the default)")
    args = parser.parse_args()
    readme = args.readme or (HERE / "README.md" if args.out == HERE / "results" else None)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    topk_rows, acc_rows = [], []
    for d in args.sizes:
        topk_rows.append(bench_topk(d, args.repeats, rng))
        acc_rows.append(bench_accumulate(d, args.repeats, rng))
        print(json.dumps(topk_rows[-1]), json.dumps(acc_rows[-1]), flush=True)
    machine = {"cpus": os.cpu_count(), "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
               "processor": platform.processor() or platform.machine(), "tensorflow": tf.__version__,
               "hvdx_build": hvdx.ops.build_info()}
    result = {"figure": "shi2021 Figure 6", "density": DENSITY, "repeats": args.repeats, "machine": machine,
              "topk_seconds": topk_rows, "accumulate_seconds": acc_rows}
    (args.out / "topk.json").write_text(json.dumps(result, indent=2))
    plot(topk_rows, acc_rows, args.out / "topk.png")
    print(topk_table(topk_rows))
    print(accumulate_table(acc_rows))
    if readme is not None:
        body = (f"Measured by `python benchmarks/topk.py` on {os.cpu_count()} CPU cores "
                f"(TensorFlow {tf.__version__}); medians of {args.repeats} repeats after a warm-up, "
                "as ratios against baselines from the same run. Plot: `results/topk.png`, raw "
                "times: `results/topk.json`.\n\nTop-k selection, k = 0.001 d (shi2021 Figure 6); "
                "the floor is one `reduce_max(|x|)`:\n\n" + topk_table(topk_rows) +
                "\n\nSparse accumulation of nnz = 0.02 d (value, index) pairs into d elements "
                "(ratios above 1: hvdx is faster):\n\n" + accumulate_table(acc_rows))
        update_readme("topk", body, readme)


if __name__ == "__main__":
    main()
