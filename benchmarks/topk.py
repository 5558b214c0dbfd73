"""Figure 6 of shi2021: top-k selection time against the vector size, k = 0.001 d, and
against the distribution of the vector.

Distributions (at d = 25M by default): normal, Laplace, Student-t(3), Cauchy, and real
gradients: the flattened gradient of one step of Keras' ResNet-50 (weights=None, random
images) and of a Transformer-style model (embedding + MultiHeadAttention/Dense blocks),
and the error-feedback buffer HiTopK actually selects from (ResNet-50 gradients of 5 steps
plus the residual of what top-k did not send, density 0.001). Per distribution MSTopK,
tf.math.top_k(|x|) and the floor reduce_max(|x|) take turns in every round; the goal is
MSTopK <= 3x the floor and >= 2x faster than top_k on every distribution.

The size sweep compares, in one run on the same inputs: hvdx's MSTopK op (Algorithm 1, N = 30),
tf.math.top_k on |x|, a DGC-style double-sampling top-k (threshold from a 1 % sample,
exact top-k over the survivors) and NumPy's argpartition, against one reduce_max(|x|) as
the memory-bound floor. Also sparse accumulation (the receiving side of the sparse
all-gather) against tf.math.unsorted_segment_sum, tf.scatter_nd and
tf.tensor_scatter_nd_add. Each time is the median of repeats after a warm-up; the tables
report ratios against baselines measured in the same run.

    python benchmarks/topk.py                      # the full figure (several minutes)
    python benchmarks/topk.py --quick --out /tmp/x # smoke run: small d, small models

Writes <out>/topk.json, <out>/topk.png and the tables of benchmarks/README.md.
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
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hvdx  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvdx import zoo  # noqa: E402
try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import add_output_arguments, markdown_table, readme_path, update_readme  # noqa: E402
except ImportError:
    from benchmarks.common import add_output_arguments, markdown_table, readme_path, update_readme  # noqa: E402

DEFAULT_SIZES = [2**18, 2**20, 2**22, 2**24, 25_000_000, 2**26, 2**27]
DENSITY = 0.001


SYNC = {"gpu": False}  # set by --device gpu


def synced(result: object) -> object:
    """Waits for a result on the GPU (eager GPU ops return before they finish) by reading
    it back; eager CPU ops are done when they return, and their results are left alone."""
    first = result[0] if isinstance(result, (tuple, list)) else result
    return first.numpy() if SYNC["gpu"] and hasattr(first, "numpy") else first


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds, its result read back (on a GPU, finished)."""
    for _ in range(warmup):
        synced(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        synced(fn())
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


DISTRIBUTIONS = ["normal", "laplace", "student_t3", "cauchy", "resnet_grad", "transformer_grad", "resnet_ef"]
GOAL_FLOOR, GOAL_TOPK = 3.0, 2.0  # MSTopK <= 3x the floor, >= 2x faster than tf.math.top_k
EF_STEPS = 5


def resnet_model(quick: bool) -> tf.keras.Model:
    """Keras' ResNet-50 (25.6M parameters), or a small residual CNN for --quick."""
    # Not hvdx.zoo's: ResNet-50 with Keras' softmax top, and a quick CNN of biased convolutions
    # with batch norm on the second one only: the gradients this benchmark has always captured.
    if not quick:
        return tf.keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    inputs = tf.keras.Input((32, 32, 3))
    h = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        r = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
        r = tf.keras.layers.BatchNormalization()(tf.keras.layers.Conv2D(16, 3, padding="same")(r))
        h = tf.keras.layers.ReLU()(h + r)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(10)(h))


def transformer_model(quick: bool) -> tf.keras.Model:
    """Embedding + blocks of MultiHeadAttention and a Dense feed-forward (pre-norm), ~25.8M
    parameters (vocabulary 16000, width 512, 3 blocks), or a small one for --quick."""
    return zoo.transformer(*((1000, 32, 1, 2, 16) if quick else (16000, 512, 3, 8, 64)))


def model_gradients(name: str, quick: bool, steps: int, rng: np.random.Generator):
    """Flattened gradients of `steps` SGD steps of the model on random data (batch 4)."""
    model = resnet_model(quick) if name == "resnet" else transformer_model(quick)
    optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shape = model.input_shape[1:]
    classes = model.output_shape[-1]
    for _ in range(steps):
        if name == "resnet":
            inputs = tf.constant(rng.standard_normal((4, *shape)).astype(np.float32))
            labels = tf.constant(rng.integers(0, classes, 4))
        else:
            inputs = tf.constant(rng.integers(0, classes, (4, *shape)).astype(np.int32))
            labels = tf.constant(rng.integers(0, classes, (4, *shape)))
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(inputs, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        yield tf.concat([tf.reshape(g, [-1]) for g in grads], 0).numpy()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


def error_feedback_buffer(quick: bool, rng: np.random.Generator) -> np.ndarray:
    """What HiTopK selects from after EF_STEPS steps: this step's gradient plus the residual
    (every earlier step's gradient minus what top-k sent), at density DENSITY."""
    residual = None
    for g in model_gradients("resnet", quick, EF_STEPS, rng):
        buffer = g if residual is None else residual + g
        k = max(1, int(DENSITY * buffer.size))
        _, indices = hvdx.mstopk(buffer, k)
        residual = buffer.copy()
        residual[indices.numpy()] = 0.0
    return buffer


def distribution(name: str, d: int, quick: bool, cache: Path, rng: np.random.Generator) -> np.ndarray:
    """The vector of one distribution: synthetic ones of length d, captured gradients at the
    model's own size (cached in `cache`, never in the checkout)."""
    if name == "normal":
        return rng.standard_normal(d).astype(np.float32)
    if name == "laplace":
        return rng.laplace(size=d).astype(np.float32)
    if name == "student_t3":
        return rng.standard_t(3, d).astype(np.float32)
    if name == "cauchy":
        return rng.standard_cauchy(d).astype(np.float32)
    path = cache / f"{name}-tf{tf.__version__}{'-quick' if quick else ''}.npy"
    if path.exists():
        return np.load(path)
    if name == "resnet_ef":
        x = error_feedback_buffer(quick, rng)
    else:
        x = next(model_gradients(name.split("_")[0], quick, 1, rng))
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, x.astype(np.float32))
    return x.astype(np.float32)


def bench_distribution(name: str, x_np: np.ndarray, rounds: int, warmup: int = 1) -> dict:
    """MSTopK, tf.math.top_k(|x|) and reduce_max(|x|) taking turns in every round."""
    x = tf.constant(x_np)
    d = int(x_np.size)
    k = max(1, int(DENSITY * d))
    methods = {
        "mstopk": lambda: hvdx.mstopk(x, k)[1].numpy(),
        "tf_top_k": lambda: tf.math.top_k(tf.abs(x), k, sorted=False).indices.numpy(),
        "floor": lambda: tf.reduce_max(tf.abs(x)).numpy(),
    }
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for r in range(warmup + rounds):
        for m, fn in methods.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                times[m].append(time.perf_counter() - start)
    a = np.abs(x_np[np.isfinite(x_np)].astype(np.float64))
    row = {"distribution": name, "d": d, "k": k, "max_over_mean": float(a.max() / a.mean()),
           "rounds_seconds": times, **{m: statistics.median(t) for m, t in times.items()}}
    row["mstopk_over_floor"] = statistics.median(m / f for m, f in zip(times["mstopk"], times["floor"]))
    row["top_k_over_mstopk"] = statistics.median(t / m for t, m in zip(times["tf_top_k"], times["mstopk"]))
    row["met"] = row["mstopk_over_floor"] <= GOAL_FLOOR and row["top_k_over_mstopk"] >= GOAL_TOPK
    return row


def verdict(row: dict) -> str:
    if row["met"]:
        return "met"
    misses = []
    if row["mstopk_over_floor"] > GOAL_FLOOR:
        misses.append(f"{row['mstopk_over_floor'] / GOAL_FLOOR - 1:.0%} over 3x floor")
    if row["top_k_over_mstopk"] < GOAL_TOPK:
        misses.append(f"{1 - row['top_k_over_mstopk'] / GOAL_TOPK:.0%} short of 2x top_k")
    return "missed: " + ", ".join(misses)


def worst_case(rows: List[dict]) -> str:
    floor = max(rows, key=lambda r: r["mstopk_over_floor"])
    topk = min(rows, key=lambda r: r["top_k_over_mstopk"])
    met = sum(r["met"] for r in rows)
    return (f"**Worst case over the {len(rows)} distributions: MSTopK {floor['mstopk_over_floor']:.2f}x the floor "
            f"({floor['distribution']}), {topk['top_k_over_mstopk']:.1f}x faster than tf.math.top_k "
            f"({topk['distribution']}); goals (<= {GOAL_FLOOR:g}x floor, >= {GOAL_TOPK:g}x top_k) met on "
            f"{met} of {len(rows)}.**")


def distribution_table(rows: List[dict]) -> str:
    header = ["distribution", "d", "k", "max/mean", "MSTopK (ms)", "top_k (ms)", "floor (ms)", "MSTopK / floor",
              "top_k / MSTopK", "verdict"]
    return markdown_table(header, ([r["distribution"], f"{r['d']:,}", f"{r['k']:,}", f"{r['max_over_mean']:.0f}",
                                    f"{r['mstopk'] * 1e3:.1f}", f"{r['tf_top_k'] * 1e3:.1f}", f"{r['floor'] * 1e3:.1f}",
                                    f"{r['mstopk_over_floor']:.2f}x", f"{r['top_k_over_mstopk']:.1f}x", verdict(r)]
                                   for r in rows), text_columns=1)


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


def plot(topk_rows: List[dict], acc_rows: List[dict], dist_rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 4.5))
    names = [r["distribution"] for r in dist_rows]
    for j, (key, label) in enumerate([("mstopk", "MSTopK (hvdx)"), ("tf_top_k", "tf.math.top_k"),
                                      ("floor", "reduce_max(|x|) floor")]):
        middle.bar(np.arange(len(names)) + (j - 1) * 0.27, [r[key] * 1e3 for r in dist_rows], 0.27, label=label)
    middle.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
    middle.set(ylabel="time (ms)", title="Top-k by distribution, k = 0.001 d")
    middle.legend()
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
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"sizes of the normal sweep (default {DEFAULT_SIZES}; --quick: 65536 100003)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--distributions", nargs="*", default=DISTRIBUTIONS, choices=DISTRIBUTIONS)
    parser.add_argument("--d", type=int, default=None, help="size of the synthetic distributions (default 25M; "
                        "--quick: 100003); gradients have their model's size")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the distribution comparison")
    parser.add_argument("--quick", action="store_true", help="small sizes and small models (smoke test)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="where the ops run; gpu writes topk_gpu.json/png and the README's GPU section")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hvdx" / "topk",
                        help="where captured gradients are kept between runs")
    add_output_arguments(parser)
    args = parser.parse_args()
    sizes = args.sizes or ([65536, 100003] if args.quick else DEFAULT_SIZES)
    dist_d = args.d or (100_003 if args.quick else 25_000_000)
    readme = readme_path(args)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "gpu"
    if gpu and not tf.config.list_physical_devices("GPU"):
        raise SystemExit("--device gpu: TensorFlow sees no GPU (tensorflow-cpu installed, or no driver)")
    SYNC["gpu"] = gpu
    with tf.device("/GPU:0" if gpu else "/CPU:0"):
        run(args, sizes, dist_d, readme, gpu)


def run(args: argparse.Namespace, sizes: List[int], dist_d: int, readme: Optional[Path], gpu: bool) -> None:
    rng = np.random.default_rng(0)
    dist_rows = []
    for name in args.distributions:
        x = distribution(name, dist_d, args.quick, args.cache, rng)
        dist_rows.append(bench_distribution(name, x, args.rounds))
        del x
        print(json.dumps({k: v for k, v in dist_rows[-1].items() if k != "rounds_seconds"}), flush=True)
    topk_rows, acc_rows = [], []
    for d in sizes:
        topk_rows.append(bench_topk(d, args.repeats, rng))
        acc_rows.append(bench_accumulate(d, args.repeats, rng))
        print(json.dumps(topk_rows[-1]), json.dumps(acc_rows[-1]), flush=True)
    machine = {"cpus": os.cpu_count(), "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
               "processor": platform.processor() or platform.machine(), "tensorflow": tf.__version__,
               "hvdx_build": hvdx.ops.build_info(), "device": "gpu" if gpu else "cpu"}
    if gpu:
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        machine["gpu"] = details.get("device_name", "GPU")
    stem = "topk_gpu" if gpu else "topk"
    result = {"figure": "shi2021 Figure 6", "density": DENSITY, "repeats": args.repeats, "machine": machine,
              "goals": {"mstopk_over_floor_at_most": GOAL_FLOOR, "top_k_over_mstopk_at_least": GOAL_TOPK},
              "distribution_rounds": args.rounds, "distributions": dist_rows,
              "topk_seconds": topk_rows, "accumulate_seconds": acc_rows}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(topk_rows, acc_rows, dist_rows, args.out / f"{stem}.png")
    if dist_rows:
        print(worst_case(dist_rows))
        print(distribution_table(dist_rows))
    print(topk_table(topk_rows))
    print(accumulate_table(acc_rows))
    if readme is not None:
        dist_text = ""
        if dist_rows:
            dist_text = (
                f"Top-k selection by distribution, k = 0.001 d, {args.rounds} rounds after a warm-up in which "
                "MSTopK, `tf.math.top_k(tf.abs(x), k)` and the floor `tf.reduce_max(tf.abs(x))` take turns "
                "(times: medians; ratios: medians of the per-round ratios). Goals: MSTopK <= 3x the floor "
                "and >= 2x faster than top_k. Gradients are Keras models' own sizes: `resnet_grad` one step "
                "of ResNet-50 (weights=None, 4 random 224x224 images), `transformer_grad` one step of an "
                "embedding + 3 x (MultiHeadAttention, Dense 2048) model (4 x 64 random tokens), `resnet_ef` "
                f"the error-feedback buffer after {EF_STEPS} ResNet-50 steps (gradient + residual of what "
                "MSTopK at density 0.001 did not send).\n\n" + worst_case(dist_rows) + "\n\n" +
                distribution_table(dist_rows) + "\n\n")
        where = (f"one {machine['gpu']} (`--device gpu`, hvdx's CUDA kernels)" if gpu
                 else f"{os.cpu_count()} CPU cores")
        body = (f"Measured by `python benchmarks/topk.py{' --quick' if args.quick else ''}"
                f"{' --device gpu' if gpu else ''}` on {where} (TensorFlow {tf.__version__}); medians of "
                f"{args.repeats} repeats after a warm-up, as ratios against baselines from the same run. Plot: "
                f"`results/{stem}.png`, raw times: `results/{stem}.json`.\n\n" + dist_text + "Top-k selection of normally distributed "
                "vectors, k = 0.001 d (shi2021 Figure 6); the floor is one `reduce_max(|x|)`:\n\n" +
                topk_table(topk_rows) +
                "\n\nSparse accumulation of nnz = 0.02 d (value, index) pairs into d elements "
                "(ratios above 1: hvdx is faster):\n\n" + accumulate_table(acc_rows))
        update_readme("topk-gpu" if gpu else "topk", body, readme)


if __name__ == "__main__":
    main()
